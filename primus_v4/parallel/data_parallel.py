"""Which replicas a parameter's gradient is summed over: data parallel (DP x CP) or expert-DP.

The loss is a token mean whose denominator is summed over micro-batches, DP and CP ranks before
backward (docs/DESIGN.md section 3), so each rank's backward yields its share of the *global*
gradient: replicas must SUM, never average (DDP's default average would divide by dp x cp).

  * replicated parameters (everything but sharded experts): DP x CP (`ctx.dp_cp`); CP ranks
    hold different rows of the same pack, so their partial gradients add up too.
  * expert-parallel shards (tagged `expert_parallel = True` by expert_parallel.shard_moe): the
    all-to-all backward already brought every EP peer's tokens to the owner, so only the
    expert-data-parallel replicas of the same shard remain (`ctx.expert_dp`).
  * rows sharded over DP x CP whose owner already summed every rank's gradient (tagged
    `owner_reduced = True`, e.g. a trainable sharded Engram table): no replicas at all.
The sum itself is the sharded optimizer's bucketed reduce-scatter (training.optim.zero).
"""

from __future__ import annotations

from torch import nn

from primus_v4.parallel.groups import Axis, ParallelContext

BUCKET_BYTES = 64 * 2**20  # 64 MiB: large enough to amortize launch cost, small enough to overlap


def is_expert_param(p: nn.Parameter) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def replica_axis(p: nn.Parameter, ctx: ParallelContext) -> Axis:
    """The axis whose ranks hold replicas of `p` (see the module docstring)."""
    if getattr(p, "owner_reduced", False):
        return Axis.alone(ctx.rank)
    return ctx.expert_dp if is_expert_param(p) else ctx.dp_cp
