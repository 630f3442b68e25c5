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

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from primus_v4.errors import ConfigError
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
    """A model's expert dispatcher for experts sharded over an EP group: routed copies go to the
    rank owning their expert and come back for `combine(y_RKD, weight_RK)`, the model's own
    weighted sum over the top-k."""

    def __init__(
        self,
        ep: Axis,
        num_experts: int,
        *,
        combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        if num_experts % ep.size:
            raise ConfigError(f"num_moe_experts {num_experts} is not divisible by ep {ep.size}")
        self.ep, self._combine = ep, combine
        self.num_local = num_experts // ep.size
        self.sent_rows = 0  # routed copies sent by the last dispatch (a test/metrics hook)

    def dispatch(
        self, x_RD: torch.Tensor, expert_RK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, list[list[int]], Any]:
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
        self.sent_rows = int(flat_M.numel())
        # Not regrouped by expert: one block per source rank (each sorted by local expert), run
        # by the experts block by block so that a weight gradient adds the source ranks' own
        # gradients, as one process adds its micro-batches' (MoE._routed).
        return x_recv, recv_PL.tolist(), (order_M, send_splits, recv_splits)

    def combine(self, y_MD: torch.Tensor, weight_RK: torch.Tensor, handle: Any) -> torch.Tensor:
        order_M, send_splits, recv_splits = handle
        r, k = weight_RK.shape
        y_back = all_to_all_rows(y_MD, send_splits, recv_splits, self.ep.group)
        y_RKD = y_back.index_select(0, _inverse(order_M)).view(r, k, y_MD.shape[-1])
        return self._combine(y_RKD, weight_RK)
