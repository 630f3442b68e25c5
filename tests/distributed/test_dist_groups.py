"""Rank layout on 4 gloo processes: megatron's groups for PP2 x CP2 and CP2 x EP2, and the
sharded optimizer's gradient sums and global grad norm over them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn

from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel
from primus_v4.training.optim.zero import ShardedAdamW

AXES = ("pp", "cp", "dp", "dp_cp", "ep", "expert_dp")
MAX_NORM = 1.0


def _reduced_grads(rank: int, ctx) -> dict:
    """ShardedAdamW's reduced gradient chunks, global norm and clipped chunks, where every
    gradient element on rank r is r + 1: a replicated [4] parameter and a [2] expert shard."""
    shared = nn.Parameter(torch.zeros(4))
    expert = nn.Parameter(torch.zeros(2))
    expert.expert_parallel = True
    opt = ShardedAdamW([("shared", shared), ("expert", expert)], ctx, lr=1e-2, betas=(0.9, 0.95),
                       eps=1e-8, weight_decay=0.0, offload_fraction=0.0)  # fmt: skip
    opt.zero_grad()
    ((rank + 1.0) * (shared.sum() + expert.sum())).backward()
    opt.reduce_gradients()
    out = {s.name: (s.lo, s.hi, s.grad.tolist()) for s in opt.slots}
    out["norm"] = opt.clip_grad_norm(MAX_NORM)
    out["clipped"] = {s.name: s.grad.tolist() for s in opt.slots}
    opt.remove_hooks()
    return out


def _check_grads(seen: dict, norm_sq: float) -> None:
    """Replicated grads sum over DP x CP, expert grads over expert-DP; each rank owns its chunk
    (torch.chunk of the flat parameter over its replicas); the norm counts every element once."""
    grads = seen["grads"]
    for name, numel, axis in (("shared", 4, "dp_cp"), ("expert", 2, "expert_dp")):
        ranks = seen[axis]
        c = math.ceil(numel / len(ranks))
        lo, hi, values = grads[name]
        assert (lo, hi) == (ranks.index(seen["rank"]) * c, ranks.index(seen["rank"]) * c + c)
        assert values == [sum(ranks) + len(ranks)] * c  # sum of rank + 1 over the replicas
    assert math.isclose(grads["norm"], math.sqrt(norm_sq), rel_tol=1e-12)
    coef = MAX_NORM / (grads["norm"] + 1e-6)  # < 1: every layout's norm exceeds MAX_NORM
    for name in ("shared", "expert"):
        want = [v * coef for v in grads[name][2]]
        assert grads["clipped"][name] == pytest.approx(want, rel=1e-6)  # float32 products


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
        seen["rank"] = rank
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
        # Each stage holds its own parameters, reduced over its CP pair: 1 + 2 = 3 on stage 0,
        # 3 + 4 = 7 on stage 1; the norm sums both stages' 4 + 2 elements.
        _check_grads(seen, 6 * 3.0**2 + 6 * 7.0**2)
    # dp = 4 / 2 = 2; EP groups span DP x CP (here the CP pairs), independent of CP.
    for rank, seen in enumerate(cp2_ep2):
        assert seen["pp"] == [rank]
        assert seen["cp"] == seen["ep"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert seen["dp"] == seen["expert_dp"] == [rank % 2, rank % 2 + 2]
        assert seen["dp_cp"] == [0, 1, 2, 3]
        assert seen["ep_sum"] == sum(seen["ep"]) and seen["dp_cp_sum"] == 6.0
        # shared: 1 + 2 + 3 + 4 = 10 over all four ranks; the EP group's two expert shards sum
        # over their expert-DP pairs, 1 + 3 = 4 (ranks 0, 2) and 2 + 4 = 6 (ranks 1, 3).
        _check_grads(seen, 4 * 10.0**2 + 2 * 4.0**2 + 2 * 6.0**2)


def _one_rank(rank: int, world: int) -> tuple:
    ctx = init_parallel(ParallelDims(world=world), backend="gloo")
    seen = (ctx.dp.ranks, ctx.ep.size, ctx.dp_cp_group is not None)
    destroy_parallel()
    return seen


def test_one_rank_gets_trivial_groups() -> None:
    assert run_ranks(_one_rank, 1, timeout_s=60) == [((0,), 1, True)]
