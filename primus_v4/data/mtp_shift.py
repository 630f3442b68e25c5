"""Multi-token prediction's shift of a pack: depth k (1-based) at row t reads row t + k of the
same sample, never across a sample end (see models/deepseek_v4/mtp.py for the depth module).

Legend: S = rows of the whole pack (global order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primus_v4.data.thd import IGNORE_LABEL


def shift_in_sample(
    x_S: torch.Tensor, cu_seqlens: torch.Tensor, k: int, fill: float | int | bool
) -> torch.Tensor:
    """out[t] = x[t + k] when row t + k lies in t's own segment, else `fill` (global order)."""
    s = x_S.shape[0]
    cu = cu_seqlens.to(device=x_S.device, dtype=torch.long)
    end_S = torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1], output_size=s)
    src_S = torch.arange(s, device=x_S.device) + k
    inside_S = src_S < end_S
    shifted = x_S.index_select(0, src_S.clamp(max=s - 1))
    return torch.where(inside_S, shifted, torch.full_like(shifted, fill))


@dataclass(frozen=True, kw_only=True)
class MtpStreams:
    """Inputs and targets of one MTP depth, row-aligned with the main stream.

    input_ids: token t+k of the same sample (0 where that crosses the sample end; masked).
    labels:    label at t+k (the token t+k+1) or IGNORE_LABEL; None when no labels were given.
    loss_mask: loss_mask at t+k, 0 where t+k crosses the sample end or is padding.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    def local_slice(self, start: int, stop: int) -> MtpStreams:
        """This CP rank's contiguous rows of globally shifted streams."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return MtpStreams(
            input_ids=self.input_ids[start:stop],
            labels=cut(self.labels),
            loss_mask=cut(self.loss_mask),
        )


def mtp_streams(
    *,
    input_ids_S: torch.Tensor,
    cu_seqlens: torch.Tensor,
    depth: int,
    labels_S: torch.Tensor | None = None,
    loss_mask_S: torch.Tensor | None = None,
    padding_mask_S: torch.Tensor | None = None,
) -> MtpStreams:
    """Shift the GLOBAL streams of one pack for MTP depth `depth` (>= 1); see module docstring."""
    if depth < 1:
        raise ValueError(f"MTP depth is 1-based, got {depth}")
    ids = shift_in_sample(input_ids_S, cu_seqlens, depth, 0)
    if labels_S is None:
        return MtpStreams(input_ids=ids)
    labels = shift_in_sample(labels_S, cu_seqlens, depth, IGNORE_LABEL)
    base = loss_mask_S if loss_mask_S is not None else (labels_S != IGNORE_LABEL)
    mask = shift_in_sample(base.to(torch.float32), cu_seqlens, depth, 0.0)
    if padding_mask_S is not None:
        pad = shift_in_sample(padding_mask_S.bool(), cu_seqlens, depth, True)
        mask = torch.where(pad, 0.0, mask)
    return MtpStreams(input_ids=ids, labels=labels, loss_mask=mask)
