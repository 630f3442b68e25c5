"""Global gradient norm and clipping when parameters are split over ranks (PP stages, EP shards).

Each parameter must count once in the global norm:
  * replicated over DP x CP (after `data_parallel.sum_gradients` every replica holds the same
    gradient): counted from the local copy, never summed over DP x CP;
  * split over pipeline stages: squares summed over the PP group; the last stage's MTP copy of
    the embedding (tagged `pipeline_duplicate`) is skipped, its gradient equals the first's;
  * expert shards (tagged `expert_parallel`): squares summed over the EP group first.
Clipping then scales every local gradient by the same factor, as torch's clip_grad_norm_ does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from primus_v4.parallel.data_parallel import is_expert_param
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
def clip_grad_norm(params: list[nn.Parameter], ctx: ParallelContext, max_norm: float) -> float:
    """Clip to `max_norm` by the global norm over all ranks' parameters; returns that norm."""
    with_grad = [p for p in params if p.grad is not None]
    dense = [p.grad for p in with_grad if not is_expert_param(p)
             and not getattr(p, "pipeline_duplicate", False)]  # fmt: skip
    experts = [p.grad for p in with_grad if is_expert_param(p)]
    expert_sq = square_sum(experts, ctx.device)
    if ctx.ep.size > 1:
        dist.all_reduce(expert_sq, group=ctx.ep.group)
    total_sq = square_sum(dense, ctx.device) + expert_sq
    if ctx.pp.size > 1:
        dist.all_reduce(total_sq, group=ctx.pp.group)
    norm = float(total_sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in with_grad:
            p.grad.mul_(coef)
    return norm
