"""Context parallel (DESIGN.md section 6): a pack split contiguously over the CP ranks.

Legend: S = rows of the whole pack, T = rows on this rank (S / cp), n = boundary rows,
C = pool slots per rank, X = trailing feature dims.

Two halves, kept apart like the rest of the package (math inside the model, communication and
row bookkeeping outside):
- `CpComm`, the `SeqComm` over a CP process group that attention, compressors and the MoE balance
  loss call through `RowLayout.comm`: the left-boundary exchange (one batched isend/irecv ring
  step; rank 0 receives zeros; backward sends the boundary gradient back to its owner), the pool
  all-gather (backward = reduce-scatter) and an autograd all-reduce for per-segment statistics.
- `shard_batch`, the contiguous split of a `ThdBatch`: rank r holds rows [r*T, (r+1)*T) of tokens,
  labels, loss mask, positions and padding mask; `cu_seqlens` stays global (the model derives
  every row's possibly negative sample start from it). MTP streams are shifted in GLOBAL order by
  `mtp.mtp_streams` (logical sample ends and padding masked) BEFORE slicing, so a shift never reads
  a row of another rank or another sample.
Loss bookkeeping: each rank's masked sums and counts are its own rows only; the trainer sums them
over DP x CP (`shard_token_counts` + `training.loss.reduce_counts`), so the reported loss and the
summed gradients equal CP = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from primus_v4.data.thd import ThdBatch, to_packed_seq_params
from primus_v4.errors import ConfigError, PrimusError
from primus_v4.models.deepseek_v4.compressor import boundary_rows
from primus_v4.models.deepseek_v4.config import LAYER_KINDS
from primus_v4.models.deepseek_v4.layout import LocalComm, SeqComm
from primus_v4.models.deepseek_v4.mtp import MtpStreams, mtp_streams, shift_in_sample
from primus_v4.training.loss import TokenCounts


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


def seq_comm(cp_axis: Any) -> SeqComm:
    """The comm for a `ParallelContext.cp` axis: `LocalComm` when CP = 1."""
    if cp_axis.size == 1:
        return LocalComm()
    return CpComm(cp_axis.group)


# ---------------------------------------------------------------------------------------------
# The contiguous split of a pack
# ---------------------------------------------------------------------------------------------


def required_local_rows(model_cfg: Any) -> int:
    """Fewest rows a CP rank may hold: every boundary it must send to its right neighbour."""
    need = max(model_cfg.attn_sliding_window - 1, 1)
    ratios = list(model_cfg.compress_ratios)
    if model_cfg.mtp_num_layers:
        ratios.append(model_cfg.mtp_compress_ratio or 0)
    for r in ratios:
        if r:  # CSA layers pool with overlap (their indexer's compressor too); HCA without
            need = max(need, boundary_rows(r, overlap=LAYER_KINDS[r] == "csa"))
    return need


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
    if s % cp_size:
        raise ConfigError(
            f"{name}: pack length {s} is not divisible by parallel.cp={cp_size}; choose a "
            f"data.seq_length that is a multiple of cp"
        )
    t = s // cp_size
    return x[cp_rank * t : (cp_rank + 1) * t]


@dataclass(frozen=True, kw_only=True)
class CpShard:
    """This CP rank's rows of one pack (all [T] except `cu_seqlens_N1`, which stays global)."""

    input_ids_T: torch.Tensor
    labels_T: torch.Tensor
    loss_mask_T: torch.Tensor
    position_ids_T: torch.Tensor
    padding_mask_T: torch.Tensor
    cu_seqlens_N1: torch.Tensor
    max_seqlen: int
    cp_rank: int
    cp_size: int
    mtp: tuple[MtpStreams, ...] = ()
    """Per MTP depth: globally shifted streams, sliced like input_ids."""
    mtp_padding_T: tuple[torch.Tensor, ...] = ()
    """Per MTP depth: the padding mask of the embedded token t+k (True = pad or vacated slot)."""

    @property
    def local_rows(self) -> int:
        return self.input_ids_T.shape[0]

    @property
    def global_start(self) -> int:
        return self.cp_rank * self.local_rows

    def model_inputs(
        self, comm: SeqComm, *, device: torch.device | str = "cpu", packed: bool = True
    ) -> dict[str, Any]:
        """Keyword inputs of `DeepseekV4Model.forward` for this rank ([1, T] rows)."""
        dev = torch.device(device)
        psp = None
        if packed:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = self.cu_seqlens_N1.to(dev)  # global: every rank sees the whole pack's segments
            psp = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=self.max_seqlen,
                max_seqlen_kv=self.max_seqlen,
            )
        mtp = [
            MtpStreams(
                input_ids=s.input_ids.to(dev),
                labels=None if s.labels is None else s.labels.to(dev),
                loss_mask=None if s.loss_mask is None else s.loss_mask.to(dev),
            )
            for s in self.mtp
        ]
        return {
            "input_ids": self.input_ids_T[None].to(dev),
            "position_ids": self.position_ids_T[None].to(dev),
            "packed_seq_params": psp,
            "labels": self.labels_T[None].to(dev),
            "loss_mask": self.loss_mask_T[None].to(dev),
            "padding_mask": self.padding_mask_T[None].to(dev),
            "comm": comm,
            "mtp_inputs": mtp or None,
        }


def shard_batch(
    batch: ThdBatch,
    *,
    cp_rank: int,
    cp_size: int,
    mtp_depths: int = 0,
    min_local_rows: int = 1,
    packed: bool = True,
) -> CpShard:
    """Contiguous rows of `batch` for CP rank `cp_rank`; MTP streams shifted globally first.

    packed=False (BSHD rows): the model treats the row as ONE sequence, padding included, so the
    MTP shift runs over [0, S] exactly as the model's own CP = 1 shift does.
    """
    s = batch.seq_length
    if not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"cp rank {cp_rank} is outside a CP group of {cp_size}")
    if s % cp_size:
        raise ConfigError(
            f"pack length {s} is not divisible by parallel.cp={cp_size}; choose a "
            f"data.seq_length that is a multiple of cp"
        )
    if s // cp_size < min_local_rows:
        raise ConfigError(
            f"parallel.cp={cp_size} leaves {s // cp_size} rows per rank of a {s}-row pack, fewer "
            f"than the {min_local_rows} boundary rows a rank must hand to its neighbour (sliding "
            f"window - 1, compressor windows); use cp <= {max(s // max(min_local_rows, 1), 1)} "
            "or a longer data.seq_length"
        )

    def cut(x: torch.Tensor) -> torch.Tensor:
        return split_rows(x, cp_rank, cp_size)

    cu = batch.cu_seqlens_N1
    if not packed:
        cu = torch.tensor([0, s], dtype=cu.dtype, device=cu.device)

    depths = [
        mtp_streams(
            input_ids_S=batch.input_ids_S,
            cu_seqlens=cu,
            depth=k,
            labels_S=batch.labels_S,
            loss_mask_S=batch.loss_mask_S,
            padding_mask_S=batch.padding_mask_S,
        )
        for k in range(1, mtp_depths + 1)
    ]
    t = s // cp_size
    return CpShard(
        input_ids_T=cut(batch.input_ids_S),
        labels_T=cut(batch.labels_S),
        loss_mask_T=cut(batch.loss_mask_S),
        position_ids_T=cut(batch.position_ids_S),
        padding_mask_T=cut(batch.padding_mask_S),
        cu_seqlens_N1=batch.cu_seqlens_N1,
        max_seqlen=to_packed_seq_params(batch).max_seqlen_q,
        cp_rank=cp_rank,
        cp_size=cp_size,
        mtp=tuple(d.local_slice(cp_rank * t, (cp_rank + 1) * t) for d in depths),
        mtp_padding_T=tuple(
            cut(shifted_padding_mask(batch.padding_mask_S, cu, k)) for k in range(1, mtp_depths + 1)
        ),
    )


def shifted_padding_mask(padding_S: torch.Tensor, cu_seqlens: torch.Tensor, k: int) -> torch.Tensor:
    """Padding of the token t+k embedded by MTP depth k, in global order: True where t+k is pad
    or lies past t's sample end (a vacated slot is padding, never a real token)."""
    return shift_in_sample(padding_S.bool(), cu_seqlens, k, True)


def shard_token_counts(shards: Sequence[CpShard], *, samples: int) -> TokenCounts:
    """This rank's token counts (its own rows only) for `training.loss.reduce_counts` over
    DP x CP: summed over the CP group they equal the counts of the unsplit packs, and
    `samples` (the whole packs' samples: each CP rank counts every sample of its packs) makes
    the replicated MoE balance loss an exact mean after the sum."""
    depths = len(shards[0].mtp) if shards else 0
    return TokenCounts(
        supervised=int(sum(int(s.loss_mask_T.sum()) for s in shards)),
        mtp=tuple(int(sum(int(s.mtp[d].loss_mask.sum()) for s in shards)) for d in range(depths)),
        real=int(sum(int((~s.padding_mask_T).sum()) for s in shards)),
        total=sum(s.local_rows for s in shards),
        samples=samples,
    )


class CpSplitter:
    """The trainer's CP hook: this rank's rows of each pack and its share of the token counts.

    The counts cover this rank's rows only; `training.loss.reduce_counts` sums them over DP x CP,
    which restores the unsplit packs' denominators (and counts each pack's samples once per CP
    rank, matching the cp replicated copies of the balance loss that rank objectives add up).
    """

    def __init__(
        self,
        cp_axis: Any,
        model_cfg: Any,
        *,
        packed: bool,
        device: torch.device | str = "cpu",
        seq_length: int | None = None,
    ) -> None:
        self.comm = seq_comm(cp_axis)
        self.rank, self.size = cp_axis.rank, cp_axis.size
        self.mtp_depths = int(model_cfg.mtp_num_layers or 0)
        self.min_rows = required_local_rows(model_cfg)
        if seq_length is not None and seq_length // self.size < self.min_rows:
            # Fail at start-up, not at the first step: every pack has seq_length rows.
            raise ConfigError(
                f"data.seq_length={seq_length} over parallel.cp={self.size} leaves "
                f"{seq_length // self.size} rows per rank, fewer than the {self.min_rows} "
                "boundary rows a rank hands to its neighbour (sliding window - 1, compressor "
                "windows); raise data.seq_length or lower parallel.cp"
            )
        self.packed, self.device = packed, torch.device(device)
        self._cache: list[tuple[ThdBatch, CpShard]] = []

    def shard(self, row: ThdBatch) -> CpShard:
        # Counting and the forward of the same pack reuse one split (the MTP shifts cost O(S)).
        # The cache holds the row itself, so an identity match can never be a recycled object.
        for cached, shard in self._cache:
            if cached is row:
                return shard
        shard = shard_batch(
            row,
            cp_rank=self.rank,
            cp_size=self.size,
            mtp_depths=self.mtp_depths,
            min_local_rows=self.min_rows,
            packed=self.packed,
        )
        self._cache.append((row, shard))
        return shard

    def token_counts(self, rows: Sequence[ThdBatch]) -> TokenCounts:
        """Counts of this step's rows; called first each step, so it also resets the cache."""
        self._cache = []
        return shard_token_counts(
            [self.shard(r) for r in rows], samples=sum(r.num_samples for r in rows)
        )

    def model_inputs(self, row: ThdBatch) -> dict[str, Any]:
        return self.shard(row).model_inputs(self.comm, device=self.device, packed=self.packed)
