"""Random packed-layout inputs for the sparse-attention op, built with the model's own geometry.

Legend: S = pack rows, T = this rank's rows, W = sliding window, P = pool rows, K = top-k.

A case is one pack (uneven samples, some shorter than the window or a pool ratio) as one CP
rank sees it, with three candidate kinds at once in one call, each over its own region of the
key buffer so every query's candidates stay distinct (the op's contract):
  [W-1 boundary rows | T local rows | pool A (ratio 4) | pool B (ratio 2)]
- range 0: the sliding window, as `Attention._window_ranges` computes it (clipped at the sample
  start, reaching into the boundary rows when the sample began on an earlier CP rank);
- range 1: the complete ratio-4 windows visible in the query's sample (HCA's pool range, empty
  for early rows), from `build_window_plan`;
- indices: up to K distinct visible ratio-2 windows (CSA's top-k), in random order, -1 padded
  and with -1 holes among them.
Some key rows repeat others exactly (tied scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.compressor import build_window_plan
from primus_v4.models.deepseek_v4.layout import RowLayout


@dataclass(frozen=True, kw_only=True)
class _Rank:
    rank: int
    size: int


def packed_case(
    *,
    lengths: list[int],
    window: int,
    topk: int,
    heads: int,
    dim: int,
    cp: tuple[int, int] = (0, 1),
    seed: int = 0,
) -> tuple[tuple[torch.Tensor, ...], dict]:
    """((q, kv, sink), kwargs) in float32 for `sparse_attention(*args, **kwargs)`."""
    gen = torch.Generator().manual_seed(seed)
    rank, size = cp
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1]) // size
    assert t * size == int(cu[-1]), "the pack must split evenly over the CP ranks"
    layout = RowLayout.from_cu_seqlens(cu, local_rows=t, comm=_Rank(rank=rank, size=size))
    lo_w, hi_w = Attention._window_ranges(SimpleNamespace(window=window), layout)
    pool_a = build_window_plan(layout, 4, overlap=False)
    pool_b = build_window_plan(layout, 2, overlap=False)
    off_a = window - 1 + t
    off_b = off_a + pool_a.num_windows
    n = off_b + pool_b.num_windows
    lo = torch.stack((lo_w, pool_a.lo_T + off_a), 1)
    hi = torch.stack((hi_w, pool_a.hi_T + off_a), 1)
    idx = torch.full((t, topk), -1, dtype=torch.long)
    for row in range(t):
        a, b = int(pool_b.lo_T[row]), int(pool_b.hi_T[row])
        picks = (a + torch.randperm(b - a, generator=gen)[:topk]) + off_b
        slots = torch.randperm(topk, generator=gen)[: picks.numel()]
        idx[row, slots] = picks
    idx[torch.rand(t, topk, generator=gen) < 0.15] = -1  # holes among the picks
    q = torch.randn(t, heads, dim, generator=gen)
    kv = torch.randn(n, dim, generator=gen)
    ties = torch.randperm(n, generator=gen)[: n // 8]
    kv[ties] = kv[ties.roll(1)]  # some keys equal others: tied scores
    sink = torch.randn(heads, generator=gen)
    kwargs = {"lo_TR": lo, "hi_TR": hi, "idx_TK": idx, "scale": dim**-0.5}
    return (q, kv, sink), kwargs


def dense_mask(kwargs: dict, n: int) -> torch.Tensor:
    """[T, N] bool: every candidate of every query (the op's definition, densely)."""
    lo, hi, idx = kwargs["lo_TR"], kwargs["hi_TR"], kwargs["idx_TK"]
    col = torch.arange(n)
    mask = torch.zeros(lo.shape[0], n, dtype=torch.bool)
    for r in range(lo.shape[1]):
        mask |= (col >= lo[:, r : r + 1]) & (col < hi[:, r : r + 1])
    if idx is not None:
        rows, slots = (idx >= 0).nonzero(as_tuple=True)
        mask[rows, idx[rows, slots]] = True
    return mask
