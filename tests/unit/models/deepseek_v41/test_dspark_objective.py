"""The DSpark drafter's training objective (models/deepseek_v41/dspark_objective.py) on the tiny
golden release: anchors only where the target is supervised, the same however the samples are
packed; the chunked objective equals one computed from the materialized draft logits; gradients
reach only the drafter; acceptance and tau count greedy prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v41.dspark_objective import (
    DraftWeights,
    sample_anchors,
    slot_targets,
)

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "dsv41_dspark_golden"


@pytest.fixture
def golden(dspark_golden):
    return dspark_golden


@pytest.fixture
def model(dspark_model):
    return dspark_model


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _psp(lengths: list[int]) -> PackedSeqParams:
    cu = _cu(lengths).int()
    n = int(cu[-1])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                           max_seqlen_kv=n)  # fmt: skip


def _sample(ids: torch.Tensor, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's next-token labels: its first `prompt` rows unsupervised, the last none."""
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[:prompt] = -100
    return ids, labels


def _docs(golden) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_sample(golden[f"doc{d}.input_ids"], prompt=p) for d, p in ((0, 5), (1, 20), (2, 40))]


def _pack(docs, order):
    ids = torch.cat([docs[d][0] for d in order])
    labels = torch.cat([docs[d][1] for d in order])
    lengths = [len(docs[d][0]) for d in order]
    return ids, labels, lengths


def test_anchors_are_supervised_and_the_same_however_packed(golden) -> None:
    docs = _docs(golden)
    per_order = []
    for order in ((0, 1, 2), (2, 0, 1)):
        ids, labels, lengths = _pack(docs, order)
        layout = RowLayout.from_cu_seqlens(_cu(lengths), local_rows=len(ids))
        anchors = sample_anchors(ids, labels, layout, None, seed=3, rate=0.25)
        assert (labels[anchors] != -100).all()  # the first draft target is supervised
        assert (anchors > layout.seq_start_T[anchors]).all()  # never a sample's first row
        starts = _cu(lengths)[:-1]
        mine = {}
        for d, lo, n in zip(order, starts.tolist(), lengths, strict=True):
            mine[d] = [int(a) - lo for a in anchors if lo <= a < lo + n]
        per_order.append(mine)
    assert per_order[0] == per_order[1]
    chosen = sum(len(v) for v in per_order[0].values())
    supervised = sum(int((lab != -100).sum()) for _, lab in docs)
    print(f"rate 0.25: {chosen} anchors of {supervised} supervised rows")
    assert 0.1 * supervised < chosen < 0.4 * supervised
    ids, labels, lengths = _pack(docs, (0, 1, 2))
    layout = RowLayout.from_cu_seqlens(_cu(lengths), local_rows=len(ids))
    other = sample_anchors(ids, labels, layout, None, seed=4, rate=0.25)
    assert not torch.equal(other, sample_anchors(ids, labels, layout, None, seed=3, rate=0.25))


def test_the_chunked_objective_equals_the_materialized_one(model, golden) -> None:
    docs = _docs(golden)
    ids, labels, lengths = _pack(docs, (1, 0, 2))
    psp, b = _psp(lengths), model.cfg.dspark_block_size
    w = DraftWeights(ce=1.0, kl=0.5, confidence=0.2, decay=0.8)
    got = {c: model.draft_objective(ids[None], packed_seq_params=psp, labels=labels[None],
                                    seed=1, rate=0.3, weights=w, chunk=c)
           for c in (7, 4096)}  # fmt: skip
    small, whole = got[7], got[4096]
    assert small.anchors == whole.anchors > 10
    torch.testing.assert_close(small.objective, whole.objective, rtol=1e-6, atol=1e-6)
    layout = RowLayout.from_cu_seqlens(_cu(lengths), local_rows=len(ids))
    anchors = sample_anchors(ids, labels, layout, None, seed=1, rate=0.3)
    with torch.no_grad():
        out = model.draft(ids[None], packed_seq_params=psp, anchors=anchors)
        ref_logits = model(ids[None], packed_seq_params=psp).logits[0]
    rows, target, valid = slot_targets(anchors, labels, layout, b)
    logq = out.logits.reshape(-1, out.logits.shape[-1]).log_softmax(-1)
    logp = ref_logits[rows].log_softmax(-1)
    decay = 0.8 ** (torch.arange(len(rows)) % b).float() * valid
    ce = -(logq.gather(1, target.clamp(min=0)[:, None]).squeeze(1) * decay).sum()
    kl = ((logp.exp() * (logp - logq)).sum(-1) * decay).sum()
    match = (logq.argmax(-1) == logp.argmax(-1)).float().view(-1, b) * valid.view(-1, b)
    accepted = match.cumprod(1) * valid.view(-1, b)
    bce = F.binary_cross_entropy_with_logits(out.confidence, accepted, reduction="none")
    want = ce + 0.5 * kl + 0.2 * (bce * decay.view(-1, b)).sum()
    pairs = zip(whole.accepted_B, whole.targets_B, strict=True)
    rates = [round(a / max(t, 1), 3) for a, t in pairs]
    print(f"objective {float(whole.objective.detach()):.6f} vs materialized {float(want):.6f}; "
          f"tau {whole.tau:.3f}, acceptance per slot {rates}")  # fmt: skip
    torch.testing.assert_close(whole.objective, want, rtol=1e-5, atol=1e-5)
    assert whole.ce_sum == pytest.approx(float(ce), rel=1e-5)
    assert whole.kl_sum == pytest.approx(float(kl), rel=1e-5)
    assert whole.accepted_B == [int(v) for v in accepted.sum(0)]
    assert whole.slots == int(valid.sum()) and whole.targets_B == [
        int(v) for v in valid.view(-1, b).sum(0)
    ]
    assert whole.tau == pytest.approx(float(accepted[valid.view(-1, b)[:, 0]].sum(1).mean()))


def test_gradients_reach_only_the_drafter(model, golden) -> None:
    ids, labels, lengths = _pack(_docs(golden), (0, 1, 2))
    model.zero_grad(set_to_none=True)
    terms = model.draft_objective(ids[None], packed_seq_params=_psp(lengths), labels=labels[None],
                                  rate=0.3, chunk=16)  # fmt: skip
    terms.objective.backward()
    touched = {n for n, p in model.named_parameters() if p.grad is not None}
    assert touched and all(n.startswith("dspark.") for n in touched), sorted(touched)[:5]
    assert "dspark.stages.2.confidence_head.proj.weight" in touched
    assert "dspark.stages.0.main_proj.weight" in touched
    model.zero_grad(set_to_none=True)
