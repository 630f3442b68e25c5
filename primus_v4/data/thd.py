"""The THD batch contract: one pack = one row of S tokens holding many samples (micro-batch 1).

Legend: S = tokens in the pack, N = segments (samples, plus a trailing padding segment if any).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primus_v4.mcore import megatron_import

IGNORE_LABEL = -100


@dataclass(frozen=True, kw_only=True)
class ThdBatch:
    """One packed row. Invariants are checked on construction so a bad pack never reaches a layer.

    input_ids_S:    token ids.
    labels_S:       next token inside the same sample (any value where loss_mask is 0).
    loss_mask_S:    1.0 only on supervised response tokens whose label is real.
    position_ids_S: restart at 0 at every segment start.
    cu_seqlens_N1:  int32, starts at 0, strictly increasing, ends at S.
    padding_mask_S: True = padding (trailing only; never supervised, never routed).
    """

    input_ids_S: torch.Tensor
    labels_S: torch.Tensor
    loss_mask_S: torch.Tensor
    position_ids_S: torch.Tensor
    cu_seqlens_N1: torch.Tensor
    padding_mask_S: torch.Tensor
    token_types_S: torch.Tensor | None = None
    """A row with images: int8 token types (-1 text and padding; 0-3 an image span's parts)."""
    images: tuple[tuple[torch.Tensor, tuple[int, int]], ...] = ()
    """A row with images: (bf16 patches [h * w, 3, p, p], (h, w)) per span, in span order."""

    def __post_init__(self) -> None:
        s = self.input_ids_S.shape[0]
        for name in ("input_ids_S", "labels_S", "loss_mask_S", "position_ids_S", "padding_mask_S"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != s:
                raise ValueError(f"ThdBatch.{name} must have shape [{s}], got {tuple(t.shape)}")
        cu = self.cu_seqlens_N1
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"ThdBatch.cu_seqlens must be 1-D int32 with >= 2 entries, got {cu}")
        if int(cu[0]) != 0 or int(cu[-1]) != s:
            raise ValueError(f"ThdBatch.cu_seqlens must start at 0 and end at S={s}, got {cu}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"ThdBatch.cu_seqlens must be strictly increasing, got {cu}")
        if self.token_types_S is not None:
            types = self.token_types_S
            if types.dim() != 1 or types.shape[0] != s:
                raise ValueError(f"ThdBatch.token_types must have shape [{s}], got "
                                 f"{tuple(types.shape)}")  # fmt: skip
            spans = int((types == 0).sum())
            if spans != len(self.images):
                raise ValueError(f"ThdBatch: {spans} image spans but {len(self.images)} images")
        elif self.images:
            raise ValueError("ThdBatch: images without token_types")
        if self.padding_mask_S.dtype != torch.bool:
            raise ValueError("ThdBatch.padding_mask must be bool (True = pad)")
        if bool((self.loss_mask_S[self.padding_mask_S] != 0).any()):
            raise ValueError("ThdBatch: a padding position is supervised (loss_mask=1 on pad)")
        starts = segment_starts(cu)
        expected = torch.arange(s, dtype=torch.long) - starts
        if not torch.equal(self.position_ids_S.long(), expected):
            raise ValueError("ThdBatch.position_ids must restart at 0 at every cu_seqlens start")
        ends = cu[1:].long() - 1
        if bool((self.loss_mask_S[ends] != 0).any()):
            raise ValueError(
                "ThdBatch: the last token of a segment is supervised but has no target"
            )

    @property
    def seq_length(self) -> int:
        return self.input_ids_S.shape[0]

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask_S.sum().item())

    @property
    def num_real(self) -> int:
        return int((~self.padding_mask_S).sum().item())

    @property
    def num_samples(self) -> int:
        """Segments that are samples: their first row is real (padding only ever trails)."""
        return int((~self.padding_mask_S[self.cu_seqlens_N1[:-1].long()]).sum().item())


def segment_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-row start index of the row's segment: [S] int64 from cu_seqlens [N+1]."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lengths)


def to_packed_seq_params(batch: ThdBatch):
    """The one conversion from a ThdBatch to megatron-core's `PackedSeqParams(qkv_format="thd")`."""
    with megatron_import():
        from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.cu_seqlens_N1
    max_len = int((cu[1:] - cu[:-1]).max().item())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


@dataclass(frozen=True, kw_only=True)
class TokenCounts:
    """Token counts of one optimizer step (denominators and throughput numbers)."""

    supervised: int
    """Main-loss denominator: supervised tokens of the whole global batch."""
    mtp: tuple[int, ...] = ()
    """Per MTP depth: that depth's supervised tokens of the whole global batch."""
    real: int = 0
    """Non-padding tokens."""
    total: int = 0
    """All row positions (rows x seq_length)."""
    samples: int = 0
    """Samples of the global batch: the MoE balance loss is a mean over them (CP ranks each
    count the whole pack, matching the replicated balance loss each of them adds)."""
    draft: int = 0
    """Draft target slots of the global batch (a drafter in training: the draft loss's
    denominator; 0 otherwise)."""

    def as_tensor(self) -> torch.Tensor:
        values = [self.supervised, *self.mtp, self.real, self.total, self.samples, self.draft]
        return torch.tensor(values, dtype=torch.int64)
