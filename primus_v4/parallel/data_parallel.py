"""Gradient reduction across data-parallel replicas (DP x CP) and expert-data-parallel replicas.

The loss is a token mean whose denominator is summed over micro-batches, DP and CP ranks before
backward (docs/DESIGN.md section 3), so each rank's backward yields its share of the *global* gradient:
replicas must SUM, never average (DDP's default average would divide by dp x cp).

Which group a parameter reduces over:
  * replicated parameters (everything but sharded experts): DP x CP (`ctx.dp_cp`); CP ranks
    hold different rows of the same pack, so their partial gradients add up too.
  * expert-parallel shards (tagged `expert_parallel = True` by expert_parallel.shard_moe): the
    all-to-all backward already brought every EP peer's tokens to the owner, so only the
    expert-data-parallel replicas of the same shard remain (`ctx.expert_dp`).
Gradients are flattened into buckets so each all-reduce moves one large tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from primus_v4.parallel.groups import Axis, ParallelContext

BUCKET_BYTES = 64 * 2**20  # 64 MiB: large enough to amortize launch cost, small enough to overlap


def is_expert_param(p: nn.Parameter) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or size >= BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket


def _sum_over(grads: list[torch.Tensor], axis: Axis) -> None:
    if axis.size == 1:
        return
    for bucket in _buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=axis.group)
        for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            dst.copy_(src)


@torch.no_grad()
def sum_gradients(params: list[nn.Parameter], ctx: ParallelContext) -> None:
    """Sum gradients over the replicas of each parameter (see the module docstring)."""
    for p in params:
        if p.grad is None and is_expert_param(p) and p.requires_grad:
            # A shard whose experts got no tokens on this rank has no gradient; zeros keep the
            # replicas' buckets alike and give it the optimizer step its unsharded original
            # (whose other experts always get tokens) takes.
            p.grad = torch.zeros_like(p)
    replicated = [p.grad for p in params if p.grad is not None and not is_expert_param(p)]
    experts = [p.grad for p in params if p.grad is not None and is_expert_param(p)]
    _sum_over(replicated, ctx.dp_cp)
    _sum_over(experts, ctx.expert_dp)
