"""Rank layout on 4 gloo processes: megatron's groups for PP2 x CP2 and CP2 x EP2."""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

from primus_v4.parallel.data_parallel import sum_gradients
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel

AXES = ("pp", "cp", "dp", "dp_cp", "ep", "expert_dp")


def _reduced_grads(rank: int, ctx) -> tuple[float, float]:
    """(replicated, expert) gradient after sum_gradients; each rank starts from rank + 1."""
    shared = nn.Parameter(torch.zeros(3))
    expert = nn.Parameter(torch.zeros(2))
    expert.expert_parallel = True
    shared.grad = torch.full((3,), rank + 1.0)
    expert.grad = torch.full((2,), rank + 1.0)
    sum_gradients([shared, expert], ctx)
    return shared.grad[0].item(), expert.grad[0].item()


def _layouts(rank: int, world: int, layouts: list[dict[str, int]]) -> list[dict]:
    out = []
    for sizes in layouts:
        ctx = init_parallel(ParallelDims(world=world, **sizes), backend="gloo")
        seen = {name: list(getattr(ctx, name).ranks) for name in AXES}
        # A collective on each group proves the group is usable, not just listed.
        for name in AXES:
            axis = getattr(ctx, name)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=axis.group)
            seen[f"{name}_sum"] = total.item()
            assert axis.rank == axis.ranks.index(rank)
        seen["first_last"] = (ctx.is_first_stage, ctx.is_last_stage)
        seen["grads"] = _reduced_grads(rank, ctx)
        out.append(seen)
        destroy_parallel()
    return out


def test_group_memberships_match_megatron_layout() -> None:
    pp2_cp2, cp2_ep2 = zip(
        *run_ranks(_layouts, 4, [{"pp": 2, "cp": 2}, {"cp": 2, "ep": 2}], timeout_s=90),
        strict=True,
    )
    # tp-cp-ep-dp-pp: CP neighbours first, PP outermost; dp = 4 / (2 x 2) = 1.
    for rank, seen in enumerate(pp2_cp2):
        assert seen["pp"] == [rank % 2, rank % 2 + 2]
        assert seen["cp"] == seen["dp_cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert seen["dp"] == seen["ep"] == [rank]
        assert seen["expert_dp"] == seen["cp"]  # experts fold over DP x CP of a stage
        assert seen["first_last"] == (rank < 2, rank >= 2)
        assert seen["pp_sum"] == sum(seen["pp"])
        # Replicated grads sum over DP x CP (the CP pair); expert grads over expert-DP (same).
        assert seen["grads"] == (sum(seen["cp"]) + 2.0,) * 2
    # dp = 4 / 2 = 2; EP groups span DP x CP (here the CP pairs), independent of CP.
    for rank, seen in enumerate(cp2_ep2):
        assert seen["pp"] == [rank]
        assert seen["cp"] == seen["ep"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert seen["dp"] == seen["expert_dp"] == [rank % 2, rank % 2 + 2]
        assert seen["dp_cp"] == [0, 1, 2, 3]
        assert seen["ep_sum"] == sum(seen["ep"]) and seen["dp_cp_sum"] == 6.0
        assert seen["grads"] == (10.0, sum(seen["expert_dp"]) + 2.0)  # 1+2+3+4; expert-DP pair


def _one_rank(rank: int, world: int) -> tuple:
    ctx = init_parallel(ParallelDims(world=world), backend="gloo")
    seen = (ctx.dp.ranks, ctx.ep.size, ctx.dp_cp_group is not None)
    destroy_parallel()
    return seen


def test_one_rank_gets_trivial_groups() -> None:
    assert run_ranks(_one_rank, 1, timeout_s=60) == [((0,), 1, True)]
