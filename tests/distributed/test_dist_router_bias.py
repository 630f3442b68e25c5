"""Router bias update under EP=2 (2 gloo processes, each its own pack as under data parallel):
the global loads are the sum of both ranks' loads, and both ranks apply the same update, equal
to one process routing both packs."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from harness import run_ranks
from test_dist_expert_parallel import _moe, _pack

from primus_v4.models.deepseek_v4.infra.parallelize import shard_moe
from primus_v4.models.deepseek_v4.router_bias import RouterBiasUpdate
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel

RATE = 1e-3


def _run(rank: int, world: int) -> dict:
    ctx = init_parallel(ParallelDims(world=world, ep=2), backend="gloo")
    ref = _moe(layer_idx=1).train()
    with torch.no_grad():
        ref.router.bias.normal_(0.0, 0.1)  # a checkpoint's non-trivial bias
    ep = copy.deepcopy(ref)
    shard_moe(ep, ctx.ep)
    ref_update = RouterBiasUpdate([ref], rate=RATE)
    for r in range(world):  # one process routes both packs
        x_TD, routing, _, _ = _pack(r)
        ref(x_TD, routing)
    ref_update.step()
    update = RouterBiasUpdate([ep], rate=RATE, group=ctx.dp_cp_group)
    x_TD, routing, _, _ = _pack(rank)
    ep(x_TD, routing)
    update.step()
    biases = [torch.empty_like(ep.router.bias) for _ in range(world)]
    dist.all_gather(biases, ep.router.bias)
    destroy_parallel()
    return {
        "same_on_ranks": all(torch.equal(b, biases[0]) for b in biases),
        "equal_to_one_process": torch.equal(ep.router.bias, ref.router.bias),
        "moved": bool((ep.router.bias != _moe(layer_idx=1).router.bias).any()),
    }


def test_router_bias_update_is_global_and_identical_under_ep() -> None:
    for result in run_ranks(_run, 2, timeout_s=120):
        assert result == {"same_on_ranks": True, "equal_to_one_process": True, "moved": True}
