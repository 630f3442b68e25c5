"""Step objective: token-mean over supervised tokens with a denominator summed over the step.

docs/DESIGN.md section 3: the loss of a step is sum(CE over every supervised token of the global
batch) / (number of those tokens). The count is taken up front from the batches' loss masks and
summed over micro-batches (and over DP/CP ranks when a group is given), so each micro-batch
backpropagates `loss_sum / N` and the accumulated gradient equals the one-shot gradient no matter
how the tokens were split into packs, micro-batches or ranks. MTP depths get the same treatment
with their own counts; the MoE aux loss (already scaled by its coefficient in the model) is
averaged over micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from primus_v4.data.mtp_shift import mtp_streams
from primus_v4.data.thd import ThdBatch, TokenCounts


def mtp_loss_mask(batch: ThdBatch, depth: int) -> torch.Tensor:
    """Supervised positions of MTP depth `depth` (1-based), by the model's own shift rule (the
    mask at t+depth inside t's sample; never another sample's token or padding)."""
    streams = mtp_streams(
        input_ids_S=batch.input_ids_S,
        cu_seqlens=batch.cu_seqlens_N1,
        depth=depth,
        labels_S=batch.labels_S,
        loss_mask_S=batch.loss_mask_S,
        padding_mask_S=batch.padding_mask_S,
    )
    assert streams.loss_mask is not None
    return streams.loss_mask


def count_tokens(batches: Sequence[ThdBatch], *, mtp_depths: int) -> TokenCounts:
    """Counts over this rank's micro-batches of one step, from the loss and padding masks."""
    mtp = tuple(
        int(sum(int(mtp_loss_mask(b, d).sum().item()) for b in batches))
        for d in range(1, mtp_depths + 1)
    )
    return TokenCounts(
        supervised=sum(b.num_supervised for b in batches),
        mtp=mtp,
        real=sum(b.num_real for b in batches),
        total=sum(b.seq_length for b in batches),
        samples=sum(b.num_samples for b in batches),
    )


def _comm_device(group: Any) -> torch.device:
    """Where a small tensor must live to be all-reduced over `group` (RCCL/NCCL: the GPU)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_counts(counts: TokenCounts, group: Any = None) -> TokenCounts:
    """Sum the counts over a process group (DP x CP ranks); identity when `group` is None."""
    if group is None:
        return counts
    import torch.distributed as dist

    summed = counts.as_tensor().to(_comm_device(group))
    dist.all_reduce(summed, group=group)
    values = [int(v) for v in summed.tolist()]
    depths = len(counts.mtp)
    return TokenCounts(
        supervised=values[0],
        mtp=tuple(values[1 : 1 + depths]),
        real=values[1 + depths],
        total=values[2 + depths],
        samples=values[3 + depths],
        draft=values[4 + depths],
    )


@dataclass
class StepLoss:
    """Accumulates the reported (detached) loss terms of one step over its micro-batches."""

    counts: TokenCounts
    mtp_scale: float = 0.1
    """Weight of the MTP loss in the objective (the model config's mtp_loss_scaling_factor)."""
    grad_scale: float = 1.0
    """Multiplies the objective (a wrapper that averages gradients over n ranks sets n)."""
    loss_sum: float = 0.0
    mtp_sums: list[float] = field(default_factory=list)
    aux_sum: float = 0.0
    draft_sums: list[float] = field(default_factory=list)
    """A drafter's summed measures (the model output's `draft.sums()`), empty without one."""
    _draft_report: Any = None

    def objective(self, out: Any, *, samples: int | float | torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step loss (backward this).

        `samples` is the micro-batch's sample count: its balance loss (a mean over those
        samples) enters with weight samples / counts.samples, so the step's balance loss is a
        mean over every sample of the global batch however they are packed or split.
        """
        n = max(self.counts.supervised, 1)  # an all-masked step contributes exactly zero
        total = out.loss_sum / n
        depth_sums = list(getattr(out, "mtp_loss_sums", None) or [])
        if depth_sums:
            if not self.mtp_sums:
                self.mtp_sums = [0.0] * len(depth_sums)
            terms = [s / max(c, 1) for s, c in zip(depth_sums, self.counts.mtp, strict=True)]
            total = total + self.mtp_scale * torch.stack(terms).mean()
            for d, s in enumerate(depth_sums):
                self.mtp_sums[d] += float(s.detach())
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            weighted = aux * samples
            total = total + weighted / max(self.counts.samples, 1)
            self.aux_sum += float(weighted.detach())
        draft = getattr(out, "draft", None)
        if draft is not None:  # the draft objective, a mean over the step's target slots
            total = total + draft.objective / max(self.counts.draft, 1)
            values = draft.sums()
            old = self.draft_sums or [0.0] * len(values)
            self.draft_sums = [a + b for a, b in zip(old, values, strict=True)]
            self._draft_report = draft.report
        self.loss_sum += float(out.loss_sum.detach())
        return total * self.grad_scale

    def reported(self, group: Any = None) -> dict[str, float]:
        """loss (token mean), mtp_loss (mean over depths of token means), aux_loss (mean over
        samples); sums are first added up over `group` (the ranks that share counts)."""
        depths = len(self.mtp_sums)
        sums = [self.loss_sum, self.aux_sum, *self.mtp_sums, *self.draft_sums]
        if group is not None:
            import torch.distributed as dist

            packed = torch.tensor(sums, dtype=torch.float64, device=_comm_device(group))
            dist.all_reduce(packed, group=group)
            sums = packed.tolist()
        loss_sum, aux_sum, mtp_sums = sums[0], sums[1], sums[2 : 2 + depths]
        mtp = [s / max(c, 1) for s, c in zip(mtp_sums, self.counts.mtp, strict=False)]
        out: dict[str, Any] = {
            "loss": loss_sum / max(self.counts.supervised, 1),
            "mtp_loss": sum(mtp) / len(mtp) if mtp else 0.0,
            "aux_loss": aux_sum / max(self.counts.samples, 1),
        }
        if self._draft_report is not None:
            out.update(self._draft_report(sums[2 + depths :]))
        return out
