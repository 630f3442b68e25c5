"""Global gradient norm when each gradient element lives on exactly one rank.

After the sharded optimizer's reduce-scatter (training.optim.zero) rank r holds the summed
gradient of its own chunks only, so every element counts once when the squares are summed:
  * chunks of replicated parameters over DP x CP (the replicas own disjoint chunks);
  * chunks of expert shards over expert-DP (the chunks of one shard), then over EP (the shards);
  * the per-stage totals over the PP group. The caller leaves out the last stage's MTP copy of
    the embedding (tagged `pipeline_duplicate`): its gradient equals the first stage's copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_v4.parallel.groups import ParallelContext

_CHUNK = 1 << 24  # elements cast to float64 at once: 128 MiB, never a float64 embedding copy


def square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # float64 accumulation: a float32 norm of an 8M-entry embedding gradient is off by ~1e-4
    # relative on CPU, and the result must not depend on how the sum is split over ranks.
    # Kept on the device: RCCL/NCCL reduce device tensors, and there is one sync at the end.
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        for chunk in g.detach().reshape(-1).split(_CHUNK):
            total += chunk.double().square().sum()
    return total


@torch.no_grad()
def global_grad_norm(
    dense: list[torch.Tensor], experts: list[torch.Tensor], ctx: ParallelContext
) -> float:
    """L2 norm over every rank's owned gradient chunks: `dense` of replicated parameters,
    `experts` of expert shards (module docstring)."""
    expert_sq = square_sum(experts, ctx.device)
    for axis in (ctx.expert_dp, ctx.ep):
        if axis.size > 1:
            dist.all_reduce(expert_sq, group=axis.group)
    dense_sq = square_sum(dense, ctx.device)
    if ctx.dp_cp.size > 1:
        dist.all_reduce(dense_sq, group=ctx.dp_cp.group)
    total_sq = dense_sq + expert_sq
    if ctx.pp.size > 1:
        dist.all_reduce(total_sq, group=ctx.pp.group)
    return float(total_sq.sqrt())
