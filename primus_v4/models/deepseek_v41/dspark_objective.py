"""What training the DSpark drafter optimizes and measures (dspark.py; docs/DESIGN.md section 15).

Legend: T = rows of the pack, K = anchors, B = draft block size, N = K x B slots, C = a chunk of
slots, D = hidden, R = Markov rank, V = vocab.

Anchors (`sample_anchors`): a row a is a candidate when its next token is a supervised target
(labels[a] != -100: a response token), it is not its sample's first row, and it is not padding.
A candidate anchors a block when a hash of (seed, its position in the sample, its token and the
one before) falls under `rate`: the choice depends on the sample's own data only, so it is the
same however the samples are packed, and the same for a given seed on every run and rank.

Targets: slot i of anchor a drafts the token after row a + i: its target is labels[a + i], taken
only while row a + i is in the anchor's sample and supervised (slots past the sample's end are
neither targets nor measured).

The objective per target slot, weighted by decay**i (later slots count less when decay < 1):
- `ce` x cross entropy to the data token (what the drafter should say);
- `kl` x KL(p_backbone || q_draft), p the backbone's own next-token distribution at the same
  position (row a + i): a server accepts a draft by the backbone's verdict, not the data's, so
  the drafter learns the backbone it serves (forward KL, as NeMo AutoModel's DSpark recipe
  distills to the target model; with kl = 0 it is plain SFT of the drafter);
- `confidence` x binary cross entropy of the confidence head's score against the slot's greedy
  acceptance (the draft's argmax equals the backbone's here and at every earlier slot): what the
  head predicts, and what a server reads to stop drafting early.
Measured beside it: per slot the greedy acceptance rate, and tau, the accepted prefix length per
anchor (of the target slots), whose mean is the expected accepted length per block under teacher
forcing (the Markov inputs are the data tokens, not the drafter's own choices).

Gradients reach only the drafter: the backbone's states it reads and the teacher are detached,
and the shared embedding and LM head enter as detached weights. The [C, V] logits of a chunk of
slots are recomputed in the backward (activation checkpointing), so K x B x V never exists whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from primus_v4.models.deepseek_v4.layout import RowLayout

IGNORE = -100
_MASK = (1 << 31) - 1


@dataclass(kw_only=True)
class DraftWeights:
    ce: float = 1.0
    kl: float = 1.0
    confidence: float = 0.1
    decay: float = 1.0


@dataclass(kw_only=True)
class DraftTerms:
    """Sums over the target slots of one pack (floats detached; `objective` carries the graph)."""

    objective: torch.Tensor
    loss_sum: float = 0.0
    """The objective's value (ce + kl + confidence terms, before the run's loss weight)."""
    ce_sum: float = 0.0
    kl_sum: float = 0.0
    confidence_sum: float = 0.0
    slots: int = 0
    accepted_B: list[int] = field(default_factory=list)
    targets_B: list[int] = field(default_factory=list)
    tau_sum: float = 0.0
    anchors: int = 0

    @property
    def tau(self) -> float:
        """Mean accepted prefix length per anchor (greedy, teacher forced)."""
        return self.tau_sum / max(self.anchors, 1)

    def sums(self) -> list[float]:
        """What adds up over packs and ranks (`report` reads it back): the loss, ce, kl and
        confidence sums, slots, tau sum, anchors, then per slot accepted, then targets."""
        head = [self.loss_sum, self.ce_sum, self.kl_sum, self.confidence_sum, self.slots,
                self.tau_sum, self.anchors]  # fmt: skip
        return [float(v) for v in (*head, *self.accepted_B, *self.targets_B)]

    @staticmethod
    def report(sums: list[float]) -> dict[str, float | list[float]]:
        """Metrics of summed `sums`: per-slot means of the objective and its terms, the
        expected accepted length per block (tau) and each slot's greedy acceptance rate (of the
        anchors whose block reaches that slot)."""
        loss, ce, kl, conf, slots, tau, anchors = sums[:7]
        block = (len(sums) - 7) // 2
        accepted, targets = sums[7 : 7 + block], sums[7 + block :]
        per = max(slots, 1)
        return {
            "draft_loss": loss / per,
            "draft_ce": ce / per,
            "draft_kl": kl / per,
            "draft_confidence": conf / per,
            "draft_tau": tau / max(anchors, 1),
            "draft_accept": [a / max(t, 1) for a, t in zip(accepted, targets, strict=True)],
        }


def _mix(x: torch.Tensor, salt: int) -> torch.Tensor:
    """A 31-bit integer hash of int64 values (xorshift-multiply), elementwise."""
    x = (x ^ salt) & _MASK
    for mult in (0x5BD1E995, 0x27D4EB2D):
        x = ((x ^ (x >> 15)) * mult) & _MASK
    return x ^ (x >> 13)


def sample_anchors(
    ids_T: torch.Tensor,
    labels_T: torch.Tensor,
    layout: RowLayout,
    pad_T: torch.Tensor | None,
    *,
    seed: int,
    rate: float,
) -> torch.Tensor:
    """Rows of the pack that anchor a draft block (see the module docstring), ascending."""
    dev = ids_T.device
    t = ids_T.shape[0]
    row_T = torch.arange(t, device=dev)
    start_T = layout.seq_start_T.to(dev)
    ok = (labels_T != IGNORE) & (row_T > start_T)
    if pad_T is not None:
        ok &= ~pad_T.to(dev).bool()
    prev_T = torch.cat((ids_T[:1], ids_T[:-1]))
    h = _mix(row_T - start_T, seed)
    h = _mix(h ^ ids_T.long(), 0x1B873593)
    h = _mix(h ^ prev_T.long(), 0x68E31DA4)
    ok &= h < int(rate * _MASK)
    return torch.nonzero(ok).flatten()


def count_slots(
    ids_T: torch.Tensor,
    targets_T: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad_T: torch.Tensor | None,
    *,
    seed: int,
    rate: float,
    block: int,
) -> int:
    """The target slots of a whole pack's anchors (the draft loss's denominator, counted before
    the forward like the main loss's supervised tokens); `targets_T` IGNORE where unsupervised."""
    layout = RowLayout.from_cu_seqlens(cu_seqlens, local_rows=ids_T.shape[0])
    anchors = sample_anchors(ids_T, targets_T, layout, pad_T, seed=seed, rate=rate)
    return int(slot_targets(anchors, targets_T, layout, block)[2].sum())


def slot_targets(
    anchors_K: torch.Tensor, labels_T: torch.Tensor, layout: RowLayout, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows a + i [N], target token [N] (IGNORE where none), valid [N] bool) of K anchors."""
    t = labels_T.shape[0]
    cu = layout.cu_seqlens.to(labels_T.device)
    end_K = cu[torch.searchsorted(cu, anchors_K + layout.global_start, right=True)]
    end_K = end_K - layout.global_start
    rows_KB = anchors_K[:, None] + torch.arange(block, device=labels_T.device)
    inside = rows_KB < end_K[:, None]
    target_KB = torch.where(inside, labels_T[rows_KB.clamp(max=t - 1)], IGNORE)
    return rows_KB.clamp(max=t - 1).flatten(), target_KB.flatten(), (target_KB != IGNORE).flatten()


def _chunk_terms(
    h_CD: torch.Tensor,
    markov_CR: torch.Tensor,
    teacher_CD: torch.Tensor,
    target_C: torch.Tensor,
    weight_C: torch.Tensor,
    head_fn,
    head_weight: torch.Tensor,
    w: DraftWeights,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective, ce and kl sums, greedy match [C], confidence [C]) of a chunk of slots."""
    logits_CV, conf_C = head_fn(h_CD, markov_CR, head_weight)
    logq_CV = logits_CV.log_softmax(-1)
    with torch.no_grad():
        teacher_CV = F.linear(teacher_CD.float(), head_weight.float())
        logp_CV = teacher_CV.log_softmax(-1)
        match_C = (logits_CV.argmax(-1) == teacher_CV.argmax(-1)).float()
    ce_C = -logq_CV.gather(1, target_C.clamp(min=0)[:, None]).squeeze(1)
    kl_C = (logp_CV.exp() * (logp_CV - logq_CV)).sum(-1)
    ce, kl = (ce_C * weight_C).sum(), (kl_C * weight_C).sum()
    return w.ce * ce + w.kl * kl, ce, kl, match_C, conf_C


def draft_terms(
    drafter,
    h_ND: torch.Tensor,
    markov_NR: torch.Tensor,
    teacher_ND: torch.Tensor,
    target_N: torch.Tensor,
    valid_N: torch.Tensor,
    *,
    head_weight: torch.Tensor,
    block: int,
    weights: DraftWeights,
    chunk: int = 4096,
) -> DraftTerms:
    """The objective and measures of N = K x B slots (see the module docstring); `teacher_ND`
    the backbone's final normed states at rows a + i, `head_weight` the shared LM head."""
    n = h_ND.shape[0]
    head_weight, teacher_ND = head_weight.detach(), teacher_ND.detach()
    slot_N = torch.arange(n, device=h_ND.device) % block
    decay_N = torch.as_tensor(weights.decay, dtype=torch.float32) ** slot_N.float()
    weight_N = torch.where(valid_N, decay_N.to(h_ND.device), 0.0)
    objective = h_ND.new_zeros((), dtype=torch.float32)
    ce = kl = 0.0
    matches, confs = [], []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        args = (h_ND[lo:hi], markov_NR[lo:hi], teacher_ND[lo:hi], target_N[lo:hi],
                weight_N[lo:hi], drafter.head, head_weight, weights)  # fmt: skip
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part = _chunk_terms(*args)
        objective = objective + part[0]
        ce, kl = ce + float(part[1].detach()), kl + float(part[2].detach())
        matches.append(part[3])
        confs.append(part[4])
    match_KB = torch.cat(matches).view(-1, block)
    valid_KB = valid_N.view(-1, block)
    accepted_KB = (match_KB * valid_KB).cumprod(1) * valid_KB  # greedy: a prefix of matches
    conf_KB = torch.cat(confs).view(-1, block)
    bce_KB = F.binary_cross_entropy_with_logits(conf_KB, accepted_KB, reduction="none")
    bce = (bce_KB * weight_N.view(-1, block)).sum()
    objective = objective + weights.confidence * bce
    anchors = int(valid_KB[:, 0].sum())
    return DraftTerms(
        objective=objective,
        loss_sum=float(objective.detach()),
        ce_sum=ce,
        kl_sum=kl,
        confidence_sum=float(bce.detach()),
        slots=int(valid_N.sum()),
        accepted_B=[int(v) for v in accepted_KB.sum(0)],
        targets_B=[int(v) for v in valid_KB.sum(0)],
        tau_sum=float(accepted_KB[valid_KB[:, 0]].sum()),
        anchors=anchors,
    )
