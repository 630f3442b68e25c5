"""Compressor: window plan (ownership, capacity, visibility) and pooling against a direct loop.

Legend: T = local rows, P = compact windows, C = slots per rank, D = pooled dim.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4.models.deepseek_v4.compressor import Compressor, build_window_plan
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import LocalComm, RowLayout
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding


class _RankOnly(LocalComm):
    """A comm that only knows its place (enough for the arithmetic plan)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _ragged(seed: int, total: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: int(torch.randint(1, 12, (1,), generator=g))]
    return torch.cat((torch.tensor([0]), (cuts + 1).sort().values, torch.tensor([total])))


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_every_window_owned_once_and_visibility_is_global(ratio: int, cp: int) -> None:
    for seed in range(6):
        total = 1024
        cu = _ragged(seed, total)
        full = build_window_plan(
            RowLayout.from_cu_seqlens(cu, local_rows=total), ratio, overlap=True
        )
        owned, t = [], total // cp
        for rank in range(cp):
            lay = RowLayout.from_cu_seqlens(cu, local_rows=t, comm=_RankOnly(rank, cp))
            plan = build_window_plan(lay, ratio, overlap=ratio == 4)
            assert plan.capacity == max(1, (t + ratio - 1) // ratio)
            torch.testing.assert_close(plan.lo_T, full.lo_T[rank * t : (rank + 1) * t])
            torch.testing.assert_close(plan.hi_T, full.hi_T[rank * t : (rank + 1) * t])
            mine = plan.slot_P // plan.capacity == rank
            used = plan.own_win_C[plan.own_win_C >= 0]
            assert used.numel() == int(mine.sum())
            owned.append(plan.slot_P)
        assert all(torch.equal(owned[0], o) for o in owned)  # every rank derives the same slots
        assert owned[0].unique().numel() == owned[0].numel() == full.num_windows
        assert full.num_windows == int(((cu[1:] - cu[:-1]) // ratio).sum())


def test_window_visibility_rule() -> None:
    cu = torch.tensor([0, 3, 12, 13, 21])  # lengths 3, 9, 1, 8
    plan = build_window_plan(RowLayout.from_cu_seqlens(cu, local_rows=21), 4, overlap=True)
    # sample 1 has windows 0 (rows 3..6) and 1 (rows 7..10): compact ids 0, 1.
    assert plan.hi_T[:3].tolist() == [0, 0, 0]
    assert (plan.hi_T[3:12] - plan.lo_T[3:12]).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert plan.lo_T[12].item() == plan.hi_T[12].item() == 2
    assert (plan.hi_T[13:] - plan.lo_T[13:]).tolist() == [0, 0, 0, 1, 1, 1, 1, 2]


def _direct_pool(comp: Compressor, x_TD, cu, rope) -> torch.Tensor:
    """One window at a time, straight from the definition in compressor.py."""
    kv, gate = comp.wkv(x_TD), comp.wgate(x_TD)
    r, d, out = comp.ratio, comp.dim, []
    for s in range(cu.numel() - 1):
        start, length = int(cu[s]), int(cu[s + 1] - cu[s])
        for g in range(length // r):
            rows = torch.arange(start + g * r, start + (g + 1) * r)
            k_w, g_w = kv[rows], gate[rows] + comp.ape
            if comp.overlap:
                k_w, g_w = k_w[:, d:], g_w[:, d:]
                if g > 0:  # the previous window of the same sample, first half of the channels
                    k_w = torch.cat((kv[rows - r][:, :d], k_w))
                    g_w = torch.cat(((gate[rows - r] + comp.ape)[:, :d], g_w))
            pooled = comp.norm((k_w * g_w.softmax(0)).sum(0))
            pooled = rope(pooled[None], torch.tensor([g * r]))[0]
            out.append(pooled)
    return torch.stack(out) if out else x_TD.new_zeros(0, d)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False)])
def test_pool_matches_direct_loop(ratio: int, overlap: bool) -> None:
    torch.manual_seed(0)
    cfg = DeepseekV4Config.preset("tiny")
    comp = Compressor(64, 16, ratio=ratio, overlap=overlap, init_std=0.2)
    with torch.no_grad():
        comp.ape.normal_()
    rope = RotaryEmbedding(cfg, compressed=True)
    cu = torch.tensor([0, 1, 4, 13, 150, 420, 423, 700])
    x = torch.randn(700, 64)
    got = comp(x, layout=RowLayout.from_cu_seqlens(cu, local_rows=700), rope=rope)
    want = _direct_pool(comp, x, cu, rope)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32, different sum order


@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False)])
def test_empty_pool_keeps_parameters_in_graph(ratio: int, overlap: bool) -> None:
    comp = Compressor(64, 16, ratio=ratio, overlap=overlap)
    cfg = DeepseekV4Config.preset("tiny")
    cu = torch.tensor([0, 1, 3, 4])  # every sample shorter than the ratio: no window at all
    pool = comp(
        torch.randn(4, 64),
        layout=RowLayout.from_cu_seqlens(cu, local_rows=4),
        rope=RotaryEmbedding(cfg, compressed=True),
    )
    assert pool.shape == (0, 16)
    (pool.sum() + 0.0).backward()
    for name, p in comp.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_layout_is_required() -> None:
    comp = Compressor(64, 16, ratio=4, overlap=True)
    cfg = DeepseekV4Config.preset("tiny")
    with pytest.raises(ValueError, match="no RowLayout"):
        comp(torch.randn(8, 64), layout=None, rope=RotaryEmbedding(cfg, compressed=True))
