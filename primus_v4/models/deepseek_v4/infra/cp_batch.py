"""DeepSeek-V4's batch under context parallelism: a pack split contiguously over the CP ranks.

Legend: S = rows of the whole pack, T = rows on this rank (S / cp).

`shard_batch` splits a `ThdBatch`: rank r holds rows [r*T, (r+1)*T) of tokens, labels, loss
mask, positions and padding mask; `cu_seqlens` stays global (the model derives every row's
possibly negative sample start from it). MTP streams are shifted in GLOBAL order by
`mtp.mtp_streams` (logical sample ends and padding masked) BEFORE slicing, so a shift never reads
a row of another rank or another sample. `required_local_rows` is the fewest rows a rank may
hold: every boundary (sliding window, compressor windows) its right neighbour needs.
Loss bookkeeping: each rank's masked sums and counts are its own rows only; the trainer sums them
over DP x CP (`shard_token_counts` + `training.loss.reduce_counts`), so the reported loss and the
summed gradients equal CP = 1. The collectives are `primus_v4.parallel.context_parallel`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from primus_v4.data.mtp_shift import MtpStreams, mtp_streams, shift_in_sample
from primus_v4.data.thd import ThdBatch, TokenCounts, to_packed_seq_params
from primus_v4.mcore import megatron_import
from primus_v4.models.deepseek_v4.geometry import required_local_rows
from primus_v4.models.deepseek_v4.layout import LocalComm, SeqComm
from primus_v4.parallel.context_parallel import ContextParallelError, CpComm, split_rows


def seq_comm(cp_axis: Any) -> SeqComm:
    """The comm for a `ParallelContext.cp` axis: `LocalComm` when CP = 1."""
    if cp_axis.size == 1:
        return LocalComm()
    return CpComm(cp_axis.group)


# ---------------------------------------------------------------------------------------------
# The contiguous split of a pack
# ---------------------------------------------------------------------------------------------


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
            with megatron_import():
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
    # data.seq_length % cp and the rows per rank are config rules (schema.py, ParallelDims):
    # a pack that breaks them here is a bug, not a user's choice
    assert s % cp_size == 0, f"pack length {s} is not divisible by cp={cp_size}"
    assert s // cp_size >= min_local_rows, (
        f"cp={cp_size} leaves {s // cp_size} rows per rank, fewer than {min_local_rows}"
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

    required_rows = staticmethod(required_local_rows)  # a family's own boundary rows

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
        # one rank holds the whole pack: no boundary rows to hand on
        self.min_rows = self.required_rows(model_cfg) if self.size > 1 else 1
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
