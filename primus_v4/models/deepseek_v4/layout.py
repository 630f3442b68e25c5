"""Where every local row of a (possibly context-parallel) pack sits in its sample.

Legend: T = rows on this rank, S = rows in the whole pack (T * cp_size), N = segments.
The model builds one `RowLayout` per forward from `packed_seq_params` (or a single segment for an
unpacked sequence) and hands the same object to every attention, compressor and indexer call.
Communication is a `SeqComm` passed in from outside; `LocalComm` is the single-rank case, where
"rows from the previous rank" are zeros and a gather is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class SeqComm(Protocol):
    """Sequence-axis communication used by attention layers (context parallel seam)."""

    rank: int
    size: int

    def left_rows(self, x_TX: torch.Tensor, n: int) -> torch.Tensor:
        """The previous rank's last `n` rows of `x` ([n, ...]), zeros on rank 0; autograd-aware."""
        ...

    def gather_rows(self, x_PX: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-size per-rank blocks in rank order; backward is a reduce-scatter."""
        ...


class LocalComm:
    """One rank holds the whole pack."""

    rank = 0
    size = 1

    def left_rows(self, x_TX: torch.Tensor, n: int) -> torch.Tensor:
        return x_TX.new_zeros((n, *x_TX.shape[1:]))

    def gather_rows(self, x_PX: torch.Tensor) -> torch.Tensor:
        return x_PX


@dataclass(frozen=True, kw_only=True)
class RowLayout:
    """Segment geometry of this rank's rows.

    cu_seqlens: int64 [N+1], global over the whole pack (never sliced under CP).
    global_start: global index of this rank's first row (cp_rank * T).
    local_rows: T.
    seq_start_T: int64 [T], local index of each row's segment start (negative when the segment
        began on an earlier rank; rows of a segment can look back to that index, not before).
    packed: True when the caller passed packing metadata (False = one unpacked sequence).
    comm: sequence-axis communication (LocalComm when CP = 1).
    """

    cu_seqlens: torch.Tensor
    global_start: int
    local_rows: int
    seq_start_T: torch.Tensor
    packed: bool
    comm: SeqComm = field(default_factory=LocalComm)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor,
        *,
        local_rows: int,
        comm: SeqComm | None = None,
        packed: bool = True,
    ) -> RowLayout:
        comm = comm or LocalComm()
        cu = cu_seqlens.to(torch.long).flatten()
        total = local_rows * comm.size
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the pack length {total} "
                f"({local_rows} local rows x cp {comm.size}); got first={int(cu[0])}, "
                f"last={int(cu[-1])}. A short cu_seqlens would let tail rows attend across samples."
            )
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {cu.tolist()}")
        global_start = comm.rank * local_rows
        lengths = cu[1:] - cu[:-1]
        starts_S = torch.repeat_interleave(cu[:-1], lengths)
        seq_start_T = starts_S[global_start : global_start + local_rows] - global_start
        return cls(
            cu_seqlens=cu,
            global_start=global_start,
            local_rows=local_rows,
            seq_start_T=seq_start_T,
            packed=packed,
            comm=comm,
        )

    @classmethod
    def unpacked(cls, length: int, *, comm: SeqComm | None = None) -> RowLayout:
        """One sequence of `length` local rows per rank (the BSHD / single-sample case)."""
        comm = comm or LocalComm()
        cu = torch.tensor([0, length * comm.size], dtype=torch.long)
        return cls.from_cu_seqlens(cu, local_rows=length, comm=comm, packed=False)


def require_layout(layout: RowLayout | None, where: str) -> RowLayout:
    """Fail loudly when a layer is called without segment metadata (the silent cross-sample bug)."""
    if layout is None:
        raise ValueError(
            f"{where} received no RowLayout: without segment metadata a packed layer would attend "
            "across samples. Pass layout=RowLayout.from_cu_seqlens(...) (or RowLayout.unpacked(T))."
        )
    return layout
