"""Attention (dense / CSA / HCA): packed == per sample, no cross-sample flow, direct reference.

Legend: S = pack rows, T = rows of one sample, D = hidden, H = heads, P = compressed windows.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import RowLayout

# Ragged: 1-token, shorter than 4, not multiples of 4 or 128, > 2 x 128, trailing padding segment.
LENS = [1, 3, 37, 130, 9, 300, 6, 263, 31]
RATIOS = {"dense": 0, "csa": 4, "hca": 128}


def _cfg(**kw) -> DeepseekV4Config:
    # std 0.2 makes outputs O(1) so 1e-5 absolute is a meaningful float32 tolerance.
    base = dict(attn_sliding_window=8, init_method_std=0.2, index_topk=8, index_topk_chunk=16)
    return DeepseekV4Config.preset("tiny", **{**base, **kw})


def _layer(cfg: DeepseekV4Config, kind: str, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    att = Attention(cfg, compress_ratio=RATIOS[kind], layer_idx=1)
    with torch.no_grad():  # non-trivial sink and position bias (both start at zero)
        att.attn_sink.normal_()
        if att.compressor is not None:
            att.compressor.ape.normal_()
    return att


def _pack(lens: list[int], hidden: int, seed: int = 1):
    cu = torch.tensor([0, *lens]).cumsum(0)
    layout = RowLayout.from_cu_seqlens(cu, local_rows=int(cu[-1]))
    pos = torch.arange(int(cu[-1])) - layout.seq_start_T
    g = torch.Generator().manual_seed(seed)
    return cu, layout, pos, torch.randn(int(cu[-1]), hidden, generator=g)


@pytest.mark.parametrize(
    "kind,window", [("dense", 8), ("csa", 8), ("hca", 8), ("hca", 128), ("csa", 128)]
)
def test_packed_equals_each_sample_alone(kind: str, window: int) -> None:
    cfg = _cfg(attn_sliding_window=window)
    att = _layer(cfg, kind)
    cu, layout, pos, x = _pack(LENS, cfg.hidden_size)
    x = x.requires_grad_(True)
    y = att(x, positions_T=pos, layout=layout)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    packed_param_grads = {n: p.grad.clone() for n, p in att.named_parameters() if p.requires_grad}
    att.zero_grad()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        xs = x[a:b].detach().clone().requires_grad_(True)
        ys = att(xs, positions_T=pos[a:b], layout=RowLayout.unpacked(b - a))
        (ys * g[a:b]).sum().backward()
        # float32 with O(1) values: only chunking / summation order differs (~1e-6 observed).
        torch.testing.assert_close(ys, y[a:b], rtol=0, atol=1e-5)
        torch.testing.assert_close(xs.grad, x.grad[a:b], rtol=0, atol=1e-5)
    for n, p in att.named_parameters():
        if p.requires_grad:  # sums over ~800 rows in another order: relative to the largest entry
            ref = packed_param_grads[n]
            assert (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max(), n


@pytest.mark.parametrize("kind", ["dense", "csa", "hca"])
def test_no_flow_between_samples(kind: str) -> None:
    cfg = _cfg()
    att = _layer(cfg, kind)
    lens = [300, 263]  # A then B, both with compressed windows
    _, layout, pos, x = _pack(lens, cfg.hidden_size)
    x = x.requires_grad_(True)
    y = att(x, positions_T=pos, layout=layout)
    y[300:].square().sum().backward()
    assert torch.count_nonzero(x.grad[:300]) == 0  # exactly zero, not small
    with torch.no_grad():
        x2 = x.detach().clone()
        x2[:300] += torch.randn(300, cfg.hidden_size)
        y2 = att(x2, positions_T=pos, layout=layout)
    assert torch.equal(y2[300:], y[300:].detach())  # bit-identical


def _direct(att: Attention, x_TD: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    """One sample, full [T, T + P] masked softmax straight from the definition (small T only)."""
    t, w = x_TD.shape[0], att.window
    q, kv, qr = att._qkv(x_TD, pos_T)
    row = torch.arange(t)
    mask = (row[:, None] - row[None, :] >= 0) & (row[:, None] - row[None, :] < w)
    keys = kv
    if att.compressor is not None:
        layout = RowLayout.unpacked(t)
        pool = att.compressor(x_TD, layout=layout, rope=att.rope)
        g = torch.arange(pool.shape[0])
        vis = (g[None, :] + 1) * att.ratio - 1 <= row[:, None]
        if att.indexer is not None:
            sel = att.indexer(x_TD, qr, positions_T=pos_T, layout=layout, rope=att.rope)
            chosen = torch.zeros_like(vis)
            for k in range(sel.shape[1]):
                ok = sel[:, k] >= 0
                chosen[ok, sel[ok, k]] = True
            assert not bool((chosen & ~vis).any())
            vis = chosen
        keys, mask = torch.cat((kv, pool)), torch.cat((mask, vis), 1)
    s = torch.einsum("thd,nd->thn", q, keys) * att.scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, att.attn_sink[None, :, None].expand(t, -1, 1)), -1)
    o = torch.einsum("thn,nd->thd", s.softmax(-1)[..., :-1], keys)
    return att._output(o, pos_T)


@pytest.mark.parametrize("kind", ["dense", "csa", "hca"])
def test_matches_direct_masked_softmax(kind: str) -> None:
    cfg = _cfg()
    att = _layer(cfg, kind)
    _, _, pos, x = _pack([300], cfg.hidden_size)
    got = att(x, positions_T=pos, layout=RowLayout.unpacked(300))
    torch.testing.assert_close(got, _direct(att, x, pos), rtol=0, atol=1e-5)  # f32 sum order


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_empty_pool_gives_finite_compressor_grads(kind: str) -> None:
    cfg = _cfg()
    att = _layer(cfg, kind)
    _, layout, pos, x = _pack([1, 3, 2, 3], cfg.hidden_size)  # every sample shorter than 4
    att(x, positions_T=pos, layout=layout).sum().backward()
    for name, p in att.compressor.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert all(p.grad is None for p in (att.indexer.parameters() if att.indexer else []))


def test_layout_none_raises() -> None:
    att = _layer(_cfg(), "csa")
    with pytest.raises(ValueError, match="no RowLayout"):
        att(torch.randn(5, 64), positions_T=torch.arange(5), layout=None)
    with pytest.raises(ValueError, match="local_rows"):
        att(torch.randn(5, 64), positions_T=torch.arange(5), layout=RowLayout.unpacked(6))
