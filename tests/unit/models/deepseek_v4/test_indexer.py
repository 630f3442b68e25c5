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
    # One-shot dense scoring over the same keys: the picks are a top-k of every row (no visible
    # key outscores a pick), the same set as the dense definition's wherever the k-th score is
    # not tied (equal scores, exact zeros above all, may resolve either way: torch.topk's).
    with torch.no_grad():
        # The query comes from the attention's q-LoRA latent qr (the release has no indexer wq_a).
        q = indexer.wq_b(qr).view(700, cfg.index_n_heads, cfg.index_head_dim)
        q = rope(q, pos)
        k = indexer.compressor(x, layout=layout, rope=rope, plan=plan)
        w = indexer.weights_proj(x)
        want = _dense_topk(q, w, k, plan.lo_T, plan.hi_T, 8, indexer.scale)
        s = (torch.einsum("thd,pd->thp", q, k).relu() * w[..., None]).sum(1) * indexer.scale
    col = torch.arange(k.shape[0])
    visible = (col >= plan.lo_T[:, None]) & (col < plan.hi_T[:, None])
    spare = torch.zeros(700, k.shape[0] + 1, dtype=torch.bool)  # -1 -> the spare last column
    picked = spare.scatter_(1, sel.masked_fill(~ok, k.shape[0]), True)[:, :-1]
    worst_pick = s.masked_fill(~picked, float("inf")).amin(1)
    best_other = s.masked_fill(~visible | picked, float("-inf")).amax(1)
    assert bool((worst_pick >= best_other - 1e-6).all())
    untied = torch.isclose(worst_pick, best_other, rtol=0, atol=1e-6).logical_not()
    assert int(untied.sum()) > 600  # most rows have no tie at the k-th score
    for row in untied.nonzero().flatten().tolist():
        assert set(sel[row].tolist()) == set(want[row].tolist()), row


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


def test_short_samples_take_torch_topk_over_their_row_and_long_ones_the_running_topk(
    monkeypatch,
) -> None:
    """With `end_T`, a sample of at most SAMPLE_ROW_MAX windows selects as HF lays it out: per
    query one row over the sample's windows (past the visible end -inf), torch.topk of
    min(K, windows), -inf picks -1 (so equal scores resolve as torch.topk resolves them there).
    Longer samples keep the running top-k, row for row the same as without `end_T`. One head:
    half of all scores are exactly 0, so ties at the k-th place are everywhere."""
    from primus_v4.kernels import indexer_topk as it

    monkeypatch.setattr(it, "SAMPLE_ROW_MAX", 20)
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 9, 120, 125, 200, 203])
    nwin = (cu[1:] - cu[:-1]) // 4  # 2, 27, 1, 18, 0 windows: samples 1 (27) is long
    wbase = torch.cumsum(nwin, 0) - nwin
    t, h, d, p = int(cu[-1]), 1, 8, int(nwin.sum())
    q, w, k = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g), torch.randn(p, d)
    seg = torch.searchsorted(cu, torch.arange(t), right=True) - 1
    lo = wbase[seg]
    hi = lo + (torch.arange(t) - cu[seg] + 1) // 4
    end = lo + nwin[seg]
    args = dict(lo_T=lo, hi_T=hi, topk=6, chunk=5, scale=0.3, row_elems=64)
    got = it.indexer_topk_torch(q, w, k, end_T=end, **args)
    running = it.indexer_topk_torch(q, w, k, **args)
    long_rows = nwin[seg] > 20
    assert int(long_rows.sum()) == 111
    assert torch.equal(got[long_rows], running[long_rows])
    s = (torch.einsum("thd,pd->thp", q, k).relu() * w[..., None]).sum(1) * 0.3
    ties = 0
    for row in (~long_rows).nonzero().flatten().tolist():
        a, b = int(lo[row]), int(end[row])
        want = torch.full((6,), -1)
        if b > a:
            r = s[row, a:b].masked_fill(torch.arange(b - a) >= hi[row] - a, float("-inf"))
            v, i = r.topk(min(6, b - a))
            want[: v.numel()] = torch.where(v == float("-inf"), -1, i + a)
            ties += int((r == v[-1]).sum()) > 1 and v[-1] == 0
        assert torch.equal(got[row], want), row
    assert ties >= 10  # rows whose k-th place is a tie of exact zeros
