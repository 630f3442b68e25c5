"""Expert parallel: experts sharded over the EP group, routed copies exchanged with all-to-all.

Legend: R = routed (non-padding) rows on this rank, K = top-k, E = experts (global),
L = E / ep local experts, P = ep ranks, M = routed copies this rank's experts process, D = hidden.

EP rank r owns experts [r * L, (r + 1) * L). Routing (top-k or the token-id hash table) is
computed before dispatch and is untouched; padding rows were already dropped by the MoE layer
(only `routed_rows_R` reach the dispatcher), so they are never sent. gloo and RCCL both provide
`all_to_all_single` with uneven splits, so dispatch is one count exchange plus one row exchange
each way; its backward is the same exchange with the splits swapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.moe import combine_experts
from primus_v4.parallel.groups import Axis


class _AllToAll(torch.autograd.Function):
    """Rows exchanged by split sizes; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):  # type: ignore[override]
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        in_splits, out_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Autograd-aware all-to-all along dim 0."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class AllToAllDispatcher:
    """`Dispatcher` for experts sharded over an EP group (see moe.Dispatcher)."""

    def __init__(self, ep: Axis, num_experts: int) -> None:
        if num_experts % ep.size:
            raise ConfigError(f"num_moe_experts {num_experts} is not divisible by ep {ep.size}")
        self.ep = ep
        self.num_local = num_experts // ep.size
        self.sent_rows = 0  # routed copies sent by the last dispatch (a test/metrics hook)

    def dispatch(
        self, x_RD: torch.Tensor, expert_RK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, list[int], Any]:
        p, n_local, k = self.ep.size, self.num_local, expert_RK.shape[1]
        flat_M = expert_RK.reshape(-1)
        # Sorting by global expert id also groups the copies by destination rank.
        order_M = torch.argsort(flat_M, stable=True)
        x_sorted = x_RD.index_select(0, order_M // k)
        send_PL = torch.bincount(flat_M, minlength=num_experts).view(p, n_local)
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL, send_PL, group=self.ep.group)
        send_splits = send_PL.sum(1).tolist()
        recv_splits = recv_PL.sum(1).tolist()
        x_recv = all_to_all_rows(x_sorted, recv_splits, send_splits, self.ep.group)
        # Received blocks come per source rank, each sorted by local expert; regroup by expert.
        local_id = torch.arange(n_local, device=x_RD.device).repeat(p)
        expert_of_row = torch.repeat_interleave(local_id, recv_PL.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        self.sent_rows = int(flat_M.numel())
        handle = (order_M, regroup, send_splits, recv_splits)
        return x_recv.index_select(0, regroup), recv_PL.sum(0).tolist(), handle

    def combine(self, y_MD: torch.Tensor, weight_RK: torch.Tensor, handle: Any) -> torch.Tensor:
        order_M, regroup, send_splits, recv_splits = handle
        r, k = weight_RK.shape
        y_recv = y_MD.index_select(0, _inverse(regroup))
        y_back = all_to_all_rows(y_recv, send_splits, recv_splits, self.ep.group)
        y_RKD = y_back.index_select(0, _inverse(order_M)).view(r, k, y_MD.shape[-1])
        return combine_experts(y_RKD, weight_RK)


def shard_moe(moe: nn.Module, ep: Axis) -> None:
    """Keep this rank's experts of `moe` (weights [E, ...] -> [L, ...]) and dispatch over `ep`.

    Sharded parameters are tagged `expert_parallel = True`: their gradients are summed over
    the expert-data-parallel group, not over DP x CP like the replicated ones; `expert_group`
    (the EP group) lets checkpoints store them as shards of one global [E, ...] tensor.
    On the meta device the shard is shapes only; `init_weights` later draws its own experts.
    """
    if ep.size == 1:
        return
    num_experts = moe.num_experts
    dispatcher = AllToAllDispatcher(ep, num_experts)
    lo = ep.rank * dispatcher.num_local
    for name in ("w_gate_up", "w_down"):
        full = getattr(moe, name)
        local = nn.Parameter(full.detach()[lo : lo + dispatcher.num_local].clone())
        local.expert_parallel = True  # type: ignore[attr-defined]
        # Checkpoints save the shard as rows [lo, lo + L) of the global [E, ...] tensor.
        local.expert_group = ep.group  # type: ignore[attr-defined]
        setattr(moe, name, local)
    moe.expert_offset = lo  # init draws expert i of the shard as global expert lo + i
    moe.dispatcher = dispatcher


def apply_expert_parallel(model: nn.Module, ep: Axis) -> int:
    """Shard every MoE layer of `model` over `ep`; returns how many layers were sharded."""
    from primus_v4.models.deepseek_v4.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        shard_moe(moe, ep)
    return len(layers)
