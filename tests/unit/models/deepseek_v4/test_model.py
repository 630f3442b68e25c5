"""Whole tiny model (dense, CSA, HCA layers + 1 MTP depth): a pack behaves exactly like its
samples run one at a time, and no information crosses a sample boundary.

Legend: S = rows of the pack, V = vocab, D = hidden.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.mtp import MTPDepth

# Ragged: one-token sample, shorter than the CSA ratio, not a multiple of 4, longer than the
# HCA ratio (one 128-row key) and the window, then trailing padding as its own segment.
LENGTHS = [1, 3, 9, 130, 6]
PAD = 5
TOL = 1e-5  # float32: packed and alone run GEMMs / softmaxes over different row counts


def tiny_cfg(**kw) -> DeepseekV4Config:
    # Window 8 and index top-k 4 make the window and the indexer selection bite at these lengths.
    base = dict(vocab_size=256, attn_sliding_window=8, index_topk=4, ce_chunk_size=64)
    base.update(kw)
    return DeepseekV4Config.preset("tiny", **base)


@pytest.fixture(scope="module")
def model() -> DeepseekV4Model:
    torch.manual_seed(0)
    return DeepseekV4Model(tiny_cfg(init_method_std=0.05))


def make_pack(lengths=LENGTHS, pad=PAD, seed=0):
    gen = torch.Generator().manual_seed(seed)
    segs = [*lengths, pad] if pad else list(lengths)
    s = sum(segs)
    ids = torch.randint(1, 256, (s,), generator=gen)
    cu = torch.tensor([0, *torch.tensor(segs).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in segs])
    padding = torch.zeros(s, dtype=torch.bool)
    if pad:
        padding[-pad:] = True
        ids[-pad:] = 0
    labels = torch.full((s,), -100)
    loss_mask = torch.zeros(s)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if not padding[a]:
            labels[a : b - 1] = ids[a + 1 : b]
            loss_mask[a : b - 1] = 1.0
    return dict(ids=ids, cu=cu, pos=pos, padding=padding, labels=labels, loss_mask=loss_mask)


def psp_of(cu: torch.Tensor) -> PackedSeqParams:
    m = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m
    )


def run(model, ids, *, cu=None, pos=None, padding=None, labels=None, loss_mask=None):
    """Forward with every embedding output (main, then one per MTP depth) as a grad leaf."""
    embs: list[torch.Tensor] = []

    def leaf(_mod, _inp, out):
        out = out.detach().requires_grad_(True)
        embs.append(out)
        return out

    handle = model.embedding.register_forward_hook(leaf)
    try:
        out = model(
            ids[None],
            None if pos is None else pos[None],
            packed_seq_params=None if cu is None else psp_of(cu),
            labels=None if labels is None else labels[None],
            loss_mask=None if loss_mask is None else loss_mask[None],
            padding_mask=None if padding is None else padding[None],
        )
    finally:
        handle.remove()
    return out, embs


def _probe(logits, gen_seed: int, rows: slice | None = None):
    # Scaled by 1/V so input gradients are O(1) and TOL is a float32-noise-sized bound.
    g = torch.randn(logits.shape[1:], generator=torch.Generator().manual_seed(gen_seed))
    g = g / logits.shape[-1]
    return g if rows is None else g[rows]


def test_pack_equals_each_sample_alone(model):
    p = make_pack()
    out, embs = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
    heads = [out.logits, *out.mtp_logits]
    loss = sum((h[0] * _probe(h, i)).sum() for i, h in enumerate(heads))
    grads = torch.autograd.grad(loss, embs)
    cu = p["cu"].tolist()
    for a, b in itertools.pairwise(cu[:-1]):  # every real sample (not the pad segment)
        rows = slice(a, b)
        o, e = run(model, p["ids"][rows])
        alone = [o.logits, *o.mtp_logits]
        loss_alone = sum((h[0] * _probe(heads[i], i, rows)).sum() for i, h in enumerate(alone))
        grads_alone = torch.autograd.grad(loss_alone, e)
        for packed_h, alone_h in zip(heads, alone, strict=True):
            torch.testing.assert_close(packed_h[0, rows], alone_h[0], rtol=0, atol=TOL)
        for g, ga in zip(grads, grads_alone, strict=True):
            torch.testing.assert_close(g[rows], ga, rtol=0, atol=TOL)


def cross_sample_grad(model, p, victim: int, source: int) -> float:
    """Largest |d (main + MTP loss of sample `victim`) / d embeddings of sample `source`|."""
    cu = p["cu"].tolist()
    only = torch.zeros_like(p["loss_mask"])
    only[cu[victim] : cu[victim + 1]] = p["loss_mask"][cu[victim] : cu[victim + 1]]
    out, embs = run(
        model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
        labels=p["labels"], loss_mask=only,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss_sum + sum(out.mtp_loss_sums), embs)
    return max(float(g[cu[source] : cu[source + 1]].abs().max()) for g in grads)


def test_no_gradient_crosses_samples(model):
    p = make_pack()
    for victim, source in [(3, 2), (4, 3), (2, 1), (3, 0)]:
        assert cross_sample_grad(model, p, victim, source) == 0.0, (victim, source)
    assert cross_sample_grad(model, p, 3, 3) > 0.0  # the probe is live


def _rowwise_experts(x_MD, counts, w_gate_up, w_down, *, limit):
    """Grouped experts with one GEMM per row: CPU GEMM bits depend on a group's row count, which
    changes when another sample is rerouted; per-row products keep the bit-identity test about
    information flow, not about BLAS blocking."""
    from primus_v4.kernels.grouped_experts import clamped_swiglu

    e_M = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    h = torch.bmm(x_MD[:, None], w_gate_up[e_M].transpose(1, 2))
    return torch.bmm(clamped_swiglu(h, limit), w_down[e_M].transpose(1, 2))[:, 0]


def test_perturbing_a_sample_leaves_others_bit_identical(model, monkeypatch):
    for module in model.modules():
        if hasattr(module, "grouped_experts"):
            monkeypatch.setattr(module, "grouped_experts", _rowwise_experts)
    p = make_pack()
    cu = p["cu"].tolist()
    base, _ = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
    ids = p["ids"].clone()
    ids[cu[2] : cu[3]] = torch.randint(1, 256, (cu[3] - cu[2],))  # replace sample 2 entirely
    pert, _ = run(model, ids, cu=p["cu"], pos=p["pos"], padding=p["padding"])
    for h0, h1 in zip(
        [base.logits, *base.mtp_logits], [pert.logits, *pert.mtp_logits], strict=True
    ):
        assert torch.equal(h0[0, : cu[2]], h1[0, : cu[2]])
        assert torch.equal(h0[0, cu[3] :], h1[0, cu[3] :])
        assert not torch.equal(h0[0, cu[2] : cu[3]], h1[0, cu[2] : cu[3]])


def test_mtp_that_drops_the_layout_is_detected(model, monkeypatch):
    """The silent-MTP bug: a depth running its layer as one long sequence must be caught."""
    p = make_pack()
    assert cross_sample_grad(model, p, 3, 2) == 0.0
    original = MTPDepth.forward

    def forgetful(self, h_TKD, emb_TD, *, positions_T, layout, routing):
        unpacked = RowLayout.unpacked(layout.local_rows)
        return original(self, h_TKD, emb_TD, positions_T=positions_T, layout=unpacked,
                        routing=routing)  # fmt: skip

    monkeypatch.setattr(MTPDepth, "forward", forgetful)
    assert cross_sample_grad(model, p, 3, 2) > 0.0
    # The parity check sees it too: sample 3's MTP logits change once packed with sample 2.
    cu = p["cu"].tolist()
    packed, _ = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
    alone, _ = run(model, p["ids"][cu[3] : cu[4]])
    gap = (packed.mtp_logits[0][0, cu[3] : cu[4]] - alone.mtp_logits[0][0]).abs().max()
    assert gap > 100 * TOL
    torch.testing.assert_close(packed.logits[0, cu[3] : cu[4]], alone.logits[0], rtol=0, atol=TOL)


def test_chunked_loss_matches_logits_and_mtp_targets(model):
    p = make_pack()
    out, _ = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
    lab, _ = run(
        model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
        labels=p["labels"], loss_mask=p["loss_mask"],
    )  # fmt: skip
    assert lab.logits is None and lab.mtp_logits == []
    ce = torch.nn.functional.cross_entropy(out.logits[0], p["labels"], reduction="none")
    m = p["loss_mask"]
    torch.testing.assert_close(lab.loss, (ce * m).sum() / m.sum(), rtol=1e-6, atol=1e-6)  # fp32
    # Depth 1 target of t is the label at t+1 of the same sample; sample ends drop out.
    cu = p["cu"].tolist()
    mtp_mask = torch.zeros_like(m)
    mtp_labels = torch.zeros_like(p["labels"])
    for a, b in itertools.pairwise(cu):
        mtp_mask[a : b - 1] = m[a + 1 : b]
        mtp_labels[a : b - 1] = p["labels"][a + 1 : b].clamp(min=0)
    ce1 = torch.nn.functional.cross_entropy(out.mtp_logits[0][0], mtp_labels, reduction="none")
    assert lab.mtp_num_tokens[0].item() == mtp_mask.sum().item()
    torch.testing.assert_close(lab.mtp_loss_sums[0], (ce1 * mtp_mask).sum(), rtol=1e-6, atol=1e-5)


def test_lm_head_on_all_rows_gives_the_same_losses_and_grads(model, ce_rows):
    p = make_pack()
    heads = {}
    for rows in ("supervised", "all"):
        twin = DeepseekV4Model(tiny_cfg(init_method_std=0.05, lm_head_rows=rows))
        twin.load_state_dict(model.state_dict())
        ce_rows.clear()
        out, _ = run(
            twin, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
            labels=p["labels"], loss_mask=p["loss_mask"],
        )  # fmt: skip
        (out.loss + out.mtp_loss).backward()
        grads = {n: q.grad.clone() for n, q in twin.named_parameters() if q.grad is not None}
        heads[rows] = (out.loss.detach(), out.mtp_loss.detach(), grads, sum(ce_rows))
    s_rows = p["ids"].shape[0]
    assert heads["all"][3] == 2 * s_rows  # main head + one MTP depth, every row
    assert heads["supervised"][3] < heads["all"][3]
    torch.testing.assert_close(heads["all"][0], heads["supervised"][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(heads["all"][1], heads["supervised"][1], rtol=1e-6, atol=1e-6)
    assert heads["all"][2].keys() == heads["supervised"][2].keys()
    for name, g in heads["supervised"][2].items():
        torch.testing.assert_close(heads["all"][2][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_all_padding_pack_gives_zero_losses_and_finite_grads(model):
    s = 12
    ids = torch.zeros(s, dtype=torch.long)
    out = model(
        ids[None],
        packed_seq_params=psp_of(torch.tensor([0, s], dtype=torch.int32)),
        labels=torch.full((1, s), -100),
        loss_mask=torch.zeros(1, s),
        padding_mask=torch.ones(1, s, dtype=torch.bool),
    )
    total = out.loss + out.mtp_loss + out.aux_loss
    assert total.item() == 0.0 and out.num_tokens.item() == 0
    model.zero_grad(set_to_none=True)
    total.backward()
    for name, prm in model.named_parameters():
        assert prm.grad is None or torch.isfinite(prm.grad).all(), name
    model.zero_grad(set_to_none=True)


def test_activation_checkpointing_matches_and_keeps_isolation():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    plain = DeepseekV4Model(cfg)
    ckpt = DeepseekV4Model(cfg, activation_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    p = make_pack(lengths=[3, 9, 20], pad=2)
    results = []
    for m in (plain, ckpt):
        out, embs = run(
            m, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
            labels=p["labels"], loss_mask=p["loss_mask"],
        )  # fmt: skip
        total = out.loss + out.mtp_loss + out.aux_loss
        params = [q for q in m.parameters() if q.requires_grad]
        grads = torch.autograd.grad(total, [*embs, *params], allow_unused=True)
        results.append((total, grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for g0, g1 in zip(results[0][1], results[1][1], strict=True):
        assert (g0 is None) == (g1 is None)
        if g0 is not None:
            torch.testing.assert_close(g0, g1, rtol=0, atol=1e-7)  # recompute is the same math
    assert cross_sample_grad(ckpt, p, 2, 1) == 0.0


def test_two_mtp_depths_pack_equals_alone():
    torch.manual_seed(0)
    m = DeepseekV4Model(tiny_cfg(mtp_num_layers=2, mtp_compress_ratio=4, init_method_std=0.05))
    p = make_pack(lengths=[2, 7, 12], pad=3)
    out, _ = run(m, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
    assert len(out.mtp_logits) == 2
    cu = p["cu"].tolist()
    for a, b in itertools.pairwise(cu[:-1]):
        alone, _ = run(m, p["ids"][a:b])
        heads, heads_alone = [out.logits, *out.mtp_logits], [alone.logits, *alone.mtp_logits]
        for h, ha in zip(heads, heads_alone, strict=True):
            torch.testing.assert_close(h[0, a:b], ha[0], rtol=0, atol=TOL)


def test_layer_without_layout_fails_loudly(model):
    x_TKD = torch.zeros(4, model.cfg.hc_mult, model.cfg.hidden_size)
    with pytest.raises(ValueError, match="RowLayout"):
        model.layers[0](x_TKD, positions_T=torch.arange(4), layout=None, routing=None)
