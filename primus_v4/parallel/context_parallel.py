"""Context parallel collectives: a pack split contiguously over the CP ranks.

Legend: T = rows on this rank (S / cp), n = boundary rows, C = pool slots per rank,
X = trailing feature dims.

`CpComm` is the sequence comm over a CP process group that a model's layers call through its
row layout: the left-boundary exchange (one batched isend/irecv ring step; rank 0 receives
zeros; backward sends the boundary gradient back to its owner), the pool all-gather (backward =
reduce-scatter) and an autograd all-reduce for per-segment statistics. `split_rows` is the
contiguous split: rank r holds rows [r*T, (r+1)*T). How a model's batch is split (which
boundaries its layers need, which shifted streams it precomputes) is the model's own
(models/deepseek_v4/infra/cp_batch.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from primus_v4.errors import ConfigError, PrimusError


class ContextParallelError(PrimusError):
    """A pack or a tensor that cannot be split or exchanged over the CP ranks."""


# ---------------------------------------------------------------------------------------------
# Collectives (autograd Functions)
# ---------------------------------------------------------------------------------------------


def _ring_step(send: torch.Tensor | None, recv: torch.Tensor | None, comm: CpComm, up: bool):
    """One ring step: send to the next (up) / previous rank, receive from the other side."""
    to, frm = (comm.rank + 1, comm.rank - 1) if up else (comm.rank - 1, comm.rank + 1)
    ops = []
    if send is not None and 0 <= to < comm.size:
        ops.append(dist.P2POp(dist.isend, send, group=comm.group, group_peer=to))
    if recv is not None and 0 <= frm < comm.size:
        ops.append(dist.P2POp(dist.irecv, recv, group=comm.group, group_peer=frm))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _LeftRows(torch.autograd.Function):
    """Forward: the previous rank's last n rows (zeros on rank 0). Backward: the gradient of those
    rows goes back to the previous rank and lands on its tail rows (the last rank sends none)."""

    @staticmethod
    def forward(ctx, x_TX: torch.Tensor, n: int, comm: CpComm) -> torch.Tensor:  # type: ignore[override]
        ctx.n, ctx.comm, ctx.shape = n, comm, x_TX.shape
        recv = x_TX.new_zeros((n, *x_TX.shape[1:]))
        tail = x_TX[x_TX.shape[0] - n :].contiguous() if n else None
        if n:
            _ring_step(tail, recv if comm.rank > 0 else None, comm, up=True)
        return recv

    @staticmethod
    def backward(ctx, grad_nX: torch.Tensor):  # type: ignore[override]
        n, comm = ctx.n, ctx.comm
        grad_TX = grad_nX.new_zeros(ctx.shape)
        if n:
            back = grad_nX.new_empty((n, *ctx.shape[1:]))
            has_next = comm.rank + 1 < comm.size
            # Rank 0's boundary rows were zeros, not anyone's data: their gradient is dropped.
            send = grad_nX.contiguous() if comm.rank > 0 else None
            _ring_step(send, back if has_next else None, comm, up=False)
            if has_next:
                grad_TX[ctx.shape[0] - n :] = back
        return grad_TX, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: equal-size per-rank blocks concatenated in rank order (= sequence order).
    Backward: a reduce-scatter of the gathered gradient (every rank's gradient of my block)."""

    @staticmethod
    def forward(ctx, x_CX: torch.Tensor, comm: CpComm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        out = x_CX.new_empty((comm.size * x_CX.shape[0], *x_CX.shape[1:]))
        dist.all_gather_into_tensor(out, x_CX.contiguous(), group=comm.group)
        return out

    @staticmethod
    def backward(ctx, grad_GX: torch.Tensor):  # type: ignore[override]
        comm = ctx.comm
        c = grad_GX.shape[0] // comm.size
        if comm.reduce_scatter_native:
            out = grad_GX.new_empty((c, *grad_GX.shape[1:]))
            dist.reduce_scatter_tensor(out, grad_GX.contiguous(), group=comm.group)
            return out, None
        # gloo has no reduce-scatter: all-reduce a private copy (never the caller's grad_output,
        # which autograd may share with other consumers) and keep my block.
        summed = grad_GX.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=comm.group)
        return summed[comm.rank * c : (comm.rank + 1) * c].clone(), None


class _AllReduceSum(torch.autograd.Function):
    """Sum over CP ranks; backward sums the gradients too (each rank's input feeds every rank's
    copy of the sum), so per-rank objectives that add up to the global one give global grads."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CpComm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=comm.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.comm.group)
        return out, None


class CpComm:
    """`SeqComm` over a context-parallel process group (gloo on CPU, RCCL/NCCL on GPU).

    Ranks of `group` are in sequence order: group rank r holds pack rows [r*T, (r+1)*T).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # gloo implements no reduce-scatter; the pool gather's backward falls back to all-reduce.
        self.reduce_scatter_native = dist.get_backend(group) != "gloo"

    def left_rows(self, x_TX: torch.Tensor, n: int) -> torch.Tensor:
        if n > x_TX.shape[0]:
            # Every rank holds T rows, so all ranks raise together instead of one hanging.
            raise ContextParallelError(
                f"context parallel rank {self.rank}: asked for the previous rank's last {n} rows "
                f"but ranks hold only {x_TX.shape[0]} rows; use fewer CP ranks or a longer "
                f"data.seq_length (each rank needs >= {n} rows)"
            )
        return _LeftRows.apply(x_TX, n, self)

    def gather_rows(self, x_CX: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(x_CX, self)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(x, self)


def split_rows(x: torch.Tensor, cp_rank: int, cp_size: int, name: str = "tensor") -> torch.Tensor:
    """Rank `cp_rank`'s contiguous rows of a [S] (or [1, S]) tensor."""
    if x.dim() == 2:
        if x.shape[0] != 1:
            raise ConfigError(
                f"{name}: context parallel with THD packs needs micro-batch size 1 (one pack "
                f"per micro-batch), got a batch of {x.shape[0]}; set train.micro_batch_size=1"
            )
        x = x[0]
    s = x.shape[0]
    assert s % cp_size == 0, f"{name}: {s} rows do not split over cp={cp_size} (schema.py checks)"
    t = s // cp_size
    return x[cp_rank * t : (cp_rank + 1) * t]
