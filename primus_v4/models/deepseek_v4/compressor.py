"""Compressor: pools every `ratio` rows of a sample into one key; context-parallel by construction.

Legend: T = rows on this rank, N = segments, P = compressed windows in the whole pack (compact,
window order), C = pool slots per rank (capacity), B = boundary rows, M = rows per window, D = dim.

Windows. Window g of sample s covers global rows [cu[s] + g*r, cu[s] + (g+1)*r); a sample of
length L has floor(L / r) windows (the remainder yields no key), so windows never cross samples.
Compact window order is (sample, g); the windows of one sample are contiguous there.
Visibility. Window g is visible to query row t of the SAME sample iff its last row <= t, i.e.
g < (u_t + 1) // r with u_t = t's offset in its sample: per query a compact range [lo_t, hi_t).
Pooling. kv and gate logits are two projections of the hidden rows; the gate gets a learned
per-row-in-window bias `ape` and a softmax over the window rows (per channel) weights the kv rows;
then a learned RMSNorm and RoPE at position g * r (the window's first row, in its own sample: the
same number packed or alone, for attention and indexer keys alike). Overlap (ratio 4): the `wkv` and
`wgate` projections (the release's `compressor.wkv` / `compressor.wgate`) are 2*D wide; window g
pools its own
rows on channels [D:2D] and window g-1's rows on channels [0:D] (2r rows in one softmax); window 0
of each sample has no predecessor: those rows get kv 0 and gate -inf (they drop out of the softmax),
so the overlap never stitches across samples.
Context parallel. A window belongs to the rank holding its last row. Each rank pools its windows
from [left_rows(hidden, B) ++ local hidden] (B = 2r with overlap, r without) into C fixed slots
(C = max(1, (T + r - 1) // r), the most windows whose last row can fall in T rows, equal on all
ranks); unused slots pool a real dummy window and are multiplied by 0, which keeps the parameters
in the graph when a rank (or the whole pack) has no window. `comm.gather_rows` concatenates the
slots in rank order; the global slot of every window is pure arithmetic on `cu_seqlens`, so every
rank compacts the gathered pool to window order without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from primus_v4 import kernels
from primus_v4.models.deepseek_v4.geometry import boundary_rows
from primus_v4.models.deepseek_v4.layout import RowLayout, require_layout
from primus_v4.models.deepseek_v4.norm import RMSNorm
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding


@dataclass(frozen=True, kw_only=True)
class WindowPlan:
    """Window geometry of one pack for one ratio, as seen from one rank (all int64)."""

    ratio: int
    capacity: int
    """C: pool slots per rank."""
    slot_P: torch.Tensor
    """Global gathered-pool slot (rank * C + local slot) of every compact window."""
    own_win_C: torch.Tensor
    """Window index within its sample of each local slot (-1 = unused slot)."""
    own_row_C: torch.Tensor
    """Boundary-buffer row of each local slot's first row (0 for unused slots)."""
    lo_T: torch.Tensor
    """First compact window visible to each local query (its sample's first window)."""
    hi_T: torch.Tensor
    """One past the last compact window visible to each local query."""
    end_T: torch.Tensor
    """One past the last compact window of each local query's sample."""

    @property
    def num_windows(self) -> int:
        return int(self.slot_P.numel())


def build_window_plan(layout: RowLayout, ratio: int, *, overlap: bool) -> WindowPlan:
    """Enumerate the pack's windows from global `cu_seqlens` (no communication)."""
    cu, t, size, rank = layout.cu_seqlens, layout.local_rows, layout.comm.size, layout.comm.rank
    dev = cu.device
    nwin_N = (cu[1:] - cu[:-1]) // ratio
    wbase_N = torch.cumsum(nwin_N, 0) - nwin_N
    p = int(nwin_N.sum())
    seq_P = torch.repeat_interleave(torch.arange(nwin_N.numel(), device=dev), nwin_N)
    win_P = torch.arange(p, device=dev) - wbase_N[seq_P]
    first_P = cu[seq_P] + win_P * ratio
    owner_P = (first_P + ratio - 1) // t  # the rank holding the window's last row
    cap = max(1, (t + ratio - 1) // ratio)
    owner_first = torch.searchsorted(owner_P, torch.arange(size, device=dev))
    local_P = torch.arange(p, device=dev) - owner_first[owner_P]
    if p and int(local_P.max()) >= cap:
        raise ValueError(f"compressor pool capacity {cap} exceeded (ratio {ratio}, {t} rows)")
    mine = (owner_P == rank).nonzero().flatten()
    own_win_C = torch.full((cap,), -1, dtype=torch.long, device=dev)
    own_row_C = torch.zeros(cap, dtype=torch.long, device=dev)
    own_win_C[: mine.numel()] = win_P[mine]
    own_row_C[: mine.numel()] = first_P[mine] - layout.global_start + boundary_rows(ratio, overlap)
    # Per query: own sample s, offset u; windows g < (u + 1) // r of s are complete and visible.
    row_T = torch.arange(t, device=dev)
    u_T = row_T - layout.seq_start_T
    seg_T = torch.searchsorted(cu, row_T + layout.global_start, right=True) - 1
    lo_T = wbase_N[seg_T]
    return WindowPlan(
        ratio=ratio,
        capacity=cap,
        slot_P=owner_P * cap + local_P,
        own_win_C=own_win_C,
        own_row_C=own_row_C,
        lo_T=lo_T,
        hi_T=lo_T + (u_T + 1) // ratio,
        end_T=lo_T + nwin_N[seg_T],
    )


class Compressor(nn.Module):
    """hidden [T, Dh] -> compact pool [P, D] of the whole pack (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        dim: int,
        *,
        ratio: int,
        overlap: bool,
        eps: float = 1e-6,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        coff = 2 if overlap else 1
        self.wkv = nn.Linear(hidden_size, coff * dim, bias=False)
        self.wgate = nn.Linear(hidden_size, coff * dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim))
        self.norm = RMSNorm(dim, eps)
        for lin in (self.wkv, self.wgate):
            nn.init.normal_(lin.weight, std=init_std)
        self.init_weights(init_std)
        self._pool = kernels.resolve("compressor_pool")

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """The position bias starts at 0, so a fresh gate weighs window rows by content only."""
        del std
        nn.init.zeros_(self.ape)

    def _window_rows(self, plan: WindowPlan, kv_BX, gate_BX):
        """Gathered kv and gate logits [C, M, D] of every local slot, overlap already applied."""
        r, d = self.ratio, self.dim
        rows_CR = plan.own_row_C[:, None] + torch.arange(r, device=kv_BX.device)
        kv_CRX, gate_CRX = kv_BX[rows_CR], gate_BX[rows_CR] + self.ape
        if not self.overlap:
            return kv_CRX, gate_CRX
        prev_CR = (rows_CR - r).clamp(min=0)
        has_prev = (plan.own_win_C > 0)[:, None, None]
        kv_prev = torch.where(has_prev, kv_BX[prev_CR][..., :d], 0.0)
        gate_prev = torch.where(has_prev, (gate_BX[prev_CR] + self.ape)[..., :d], float("-inf"))
        kv_CMD = torch.cat((kv_prev, kv_CRX[..., d:]), dim=1)
        return kv_CMD, torch.cat((gate_prev, gate_CRX[..., d:]), dim=1)

    def forward(
        self,
        x_TD: torch.Tensor,
        *,
        layout: RowLayout,
        rope: RotaryEmbedding,
        plan: WindowPlan | None = None,
    ) -> torch.Tensor:
        """Compact pool [P, dim] (all windows of the pack, window order) on every rank."""
        layout = require_layout(layout, "Compressor")
        if plan is None:
            plan = build_window_plan(layout, self.ratio, overlap=self.overlap)
        b = boundary_rows(self.ratio, self.overlap)
        x_BD = torch.cat((layout.comm.left_rows(x_TD, b), x_TD), dim=0)
        kv_BX, gate_BX = self.wkv(x_BD), self.wgate(x_BD)
        kv_CMD, gate_CMD = self._window_rows(plan, kv_BX, gate_BX)
        pooled_CD = self.norm(self._pool(kv_CMD, gate_CMD))
        used_C = plan.own_win_C >= 0
        pooled_CD = rope(pooled_CD, plan.own_win_C.clamp(min=0) * self.ratio)
        # Unused slots: a real (dummy) pooled row times 0 keeps every parameter in the graph.
        pooled_CD = pooled_CD * used_C[:, None].to(pooled_CD.dtype)
        pool_GD = layout.comm.gather_rows(pooled_CD)
        return pool_GD.index_select(0, plan.slot_P)
