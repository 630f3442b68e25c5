"""Lightning indexer: exact chunked top-k, visibility of every selection, frozen and detached.

Legend: T = rows, H = indexer heads, D = indexer head dim, P = compact windows, K = top-k.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4.kernels.indexer_topk import indexer_topk_torch
from primus_v4.models.deepseek_v4.compressor import build_window_plan
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.indexer import Indexer
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding

CU = torch.tensor([0, 1, 3, 40, 41, 300, 307, 640, 700])  # ragged, one-token, trailing segment


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    cfg = DeepseekV4Config.preset("tiny", init_method_std=0.2, index_topk=8, index_topk_chunk=5)
    layout = RowLayout.from_cu_seqlens(CU, local_rows=700)
    pos = torch.arange(700) - layout.seq_start_T
    return cfg, layout, pos, torch.randn(700, cfg.hidden_size), torch.randn(700, cfg.q_lora_rank)


def _dense_topk(q, w, k, lo, hi, topk, scale):
    """All scores at once ([T, P]) and one stable sort: the definition the chunked path must hit."""
    s = torch.einsum("thd,pd->thp", q, k).relu() * w[..., None]
    s = s.sum(1) * scale
    col = torch.arange(k.shape[0])
    s = s.masked_fill((col < lo[:, None]) | (col >= hi[:, None]), float("-inf"))
    v, i = torch.sort(s, dim=1, descending=True, stable=True)
    v, i = v[:, :topk], i[:, :topk]
    if i.shape[1] < topk:
        pad = topk - i.shape[1]
        v = torch.cat((v, v.new_full((v.shape[0], pad), float("-inf"))), 1)
        i = torch.cat((i, i.new_full((i.shape[0], pad), -1)), 1)
    return i.masked_fill(v == float("-inf"), -1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_topk_equals_one_shot(chunk: int) -> None:
    g = torch.Generator().manual_seed(1)
    t, h, d, p = 300, 4, 16, 90
    q, w, k = (
        torch.randn(t, h, d, generator=g),
        torch.randn(t, h, generator=g),
        torch.randn(p, d, generator=g),
    )
    lo = torch.sort(torch.randint(0, p, (t,), generator=g)).values
    hi = torch.minimum(lo + torch.randint(0, 30, (t,), generator=g), torch.tensor(p))
    got = indexer_topk_torch(
        q, w, k, lo_T=lo, hi_T=hi, topk=8, chunk=chunk, scale=0.1, row_elems=2048
    )
    one_shot = indexer_topk_torch(q, w, k, lo_T=lo, hi_T=hi, topk=8, chunk=10**6, scale=0.1)
    assert torch.equal(got, one_shot)
    assert torch.equal(got, _dense_topk(q, w, k, lo, hi, 8, 0.1))


def test_selection_is_visible_own_sample_and_exact() -> None:
    cfg, layout, pos, x, qr = _inputs()
    indexer = Indexer(cfg, ratio=4)
    rope = RotaryEmbedding(cfg, compressed=True)
    plan = build_window_plan(layout, 4, overlap=True)
    sel = indexer(x, qr, positions_T=pos, layout=layout, rope=rope, plan=plan)
    assert sel.shape == (700, 8)
    ok = sel >= 0
    lo, hi = plan.lo_T[:, None].expand_as(sel), plan.hi_T[:, None].expand_as(sel)
    assert bool(((sel >= lo) & (sel < hi))[ok].all())  # own sample, window complete
    n_vis = (plan.hi_T - plan.lo_T).clamp(max=8)
    assert torch.equal(ok.sum(1), n_vis)  # every visible key is used until K are chosen
    # One-shot dense scoring over the same keys selects exactly the same set.
    with torch.no_grad():
        # The query comes from the attention's q-LoRA latent qr (the release has no indexer wq_a).
        q = indexer.wq_b(qr).view(700, cfg.index_n_heads, cfg.index_head_dim)
        q = rope(q, pos)
        k = indexer.compressor(x, layout=layout, rope=rope, plan=plan)
        want = _dense_topk(q, indexer.weights_proj(x), k, plan.lo_T, plan.hi_T, 8, indexer.scale)
    assert torch.equal(sel, want)


def test_indexer_is_frozen_and_detached() -> None:
    cfg, layout, pos, x, qr = _inputs()
    indexer = Indexer(cfg, ratio=4)
    assert all(not p.requires_grad for p in indexer.parameters())
    x, qr = x.requires_grad_(True), qr.requires_grad_(True)
    rope = RotaryEmbedding(cfg, compressed=True)
    sel = indexer(x, qr, positions_T=pos, layout=layout, rope=rope)
    assert not sel.requires_grad and sel.dtype == torch.long
    with pytest.raises(ValueError, match="no RowLayout"):
        indexer(x, qr, positions_T=pos, layout=None, rope=rope)
