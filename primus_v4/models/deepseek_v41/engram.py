"""Engram: an n-gram hash memory written into the 4 mHC streams before a few layers.

Legend: T = rows, K = hc_mult streams, D = hidden, C = hash columns ((max_n - 1) x heads),
E = table row width, L = Engram layers, M = max n-gram size.

Hashing (the release's inference/engram.py): token ids go through the token map (ids whose texts
normalize alike share one compressed id); at row t, the n-gram of size n is the compressed ids of
rows t, t-1, ..., t-n+1, each multiplied by a per-(layer, look-back) odd constant and XORed;
bucket = value mod a prime distinct per (layer, n, head), plus that head's table offset.
Look-back never crosses a sample start: rows before it read the pad id's compressed id, exactly
as before position 0 of a document run alone (packing-invariant by construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from primus_v4.models.deepseek_v41.config import DeepseekV41Config

GATE_FLOOR = 1e-6  # |dot| floor under the signed square root (the release's clamp)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_prime(start: int, seen: set[int]) -> int:
    """The smallest prime above `start` not handed out yet."""
    n = start + 1
    while not _is_prime(n) or n in seen:
        n += 1
    return n


@dataclass(frozen=True, kw_only=True)
class EngramHash:
    """The hash constants of every Engram layer (config-derived, never trained).

    primes: [L][M-1][heads] bucket moduli, drawn in order from `engram_vocab_size`, never reused.
    offsets: [L][C] first row of each (n, head) bucket range in its layer's table.
    multipliers: [L][M] odd int64 constants from numpy's default_rng(10007 x layer).
    """

    layer_ids: tuple[int, ...]
    max_n: int
    heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    pad_token_id: int

    @classmethod
    def from_config(cls, cfg: DeepseekV41Config) -> EngramHash:
        seen: set[int] = set()
        primes, offsets, mults = [], [], []
        bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
        for layer in cfg.engram_layer_ids:
            per_n = []
            for _ in range(cfg.engram_max_ngram_size - 1):
                sizes, cur = [], cfg.engram_vocab_size - 1
                for _ in range(cfg.engram_n_heads):
                    cur = _next_prime(cur, seen)
                    seen.add(cur)
                    sizes.append(cur)
                per_n.append(tuple(sizes))
            primes.append(tuple(per_n))
            flat = [p for sizes in per_n for p in sizes]
            offsets.append(tuple(int(v) for v in np.cumsum([0, *flat[:-1]])))
            rng = np.random.default_rng(10007 * layer)
            draws = rng.integers(0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
            mults.append(tuple(int(v) * 2 + 1 for v in draws))
        return cls(
            layer_ids=tuple(cfg.engram_layer_ids),
            max_n=cfg.engram_max_ngram_size,
            heads=cfg.engram_n_heads,
            primes=tuple(primes),
            offsets=tuple(offsets),
            multipliers=tuple(mults),
            pad_token_id=cfg.engram_pad_token_id,
        )

    def row_ids(
        self, token_ids_T: torch.Tensor, token_map: torch.Tensor, seq_start_T: torch.Tensor
    ) -> torch.Tensor:
        """[T, L, C] table rows (offsets included) of every row's n-grams, per Engram layer.

        seq_start_T: local index of each row's sample start; look-back stops there."""
        dev = token_ids_T.device
        ids = token_map.to(dev)[token_ids_T.long()]
        pad = token_map[self.pad_token_id].to(dev)
        rows_T = torch.arange(ids.shape[0], device=dev)
        start_T = seq_start_T.to(dev)
        shifted = []
        for back in range(self.max_n):
            src = rows_T - back
            ok = src >= start_T
            shifted.append(torch.where(ok, ids[src.clamp(min=0)], pad))
        tokens_TM = torch.stack(shifted, dim=-1)
        mult_LM = torch.tensor(self.multipliers, dtype=torch.int64, device=dev)
        prod_TLM = tokens_TM[:, None, :] * mult_LM  # < 2^63 by the multipliers' bound
        primes = torch.tensor(self.primes, dtype=torch.int64, device=dev)  # [L, M-1, heads]
        rolling, cols = prod_TLM[..., 0], []
        for i in range(1, self.max_n):
            rolling = torch.bitwise_xor(rolling, prod_TLM[..., i])
            cols.append(rolling[..., None] % primes[:, i - 1])
        offsets = torch.tensor(self.offsets, dtype=torch.int64, device=dev)
        return torch.cat(cols, dim=-1) + offsets


class Engram(nn.Module):
    """Table lookup -> `wkv` -> one key per stream + a shared value; a per-stream gate
    sigmoid(sign(d) sqrt(|d|)) of the normalized stream . key product writes the value in."""

    # the gate weights start at 1: a plain normalized stream . key product
    constant_params: ClassVar[dict[str, float]] = {"q_weight": 1.0, "k_weight": 1.0}

    def __init__(self, cfg: DeepseekV41Config, *, rows: int) -> None:
        super().__init__()
        k, d, e = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.k, self.d, self.eps = k, d, cfg.layernorm_epsilon
        self.table = nn.Parameter(torch.empty(rows, e))
        self.wkv = nn.Linear(cols * e, d * (k + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(k, d))
        self.k_weight = nn.Parameter(torch.ones(k, d))

    def table_rows(self, rows_TC: torch.Tensor) -> torch.Tensor:
        """[T, C, E] table rows: from `table`, or from where `engram_placement` put them."""
        placed = getattr(self, "placed", None)
        return self.table[rows_TC] if placed is None else placed(rows_TC)

    def forward(self, x_TKD: torch.Tensor, rows_TC: torch.Tensor, mask_T: torch.Tensor | None):
        """mask_T: False on rows that take no Engram write (padding)."""
        emb_TX = self.table_rows(rows_TC).flatten(1)
        key_TX, value_TD = self.wkv(emb_TX).split([self.k * self.d, self.d], dim=-1)
        key_TKD = key_TX.float().unflatten(-1, (self.k, self.d))
        h = x_TKD.float()
        weight_KD = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps)
        rstd = rstd * torch.rsqrt(key_TKD.square().mean(-1) + self.eps)
        dot_TK = (h * weight_KD * key_TKD).sum(-1) * rstd * self.d**-0.5
        gate_TK = torch.sigmoid(torch.copysign(dot_TK.abs().clamp_min(GATE_FLOOR).sqrt(), dot_TK))
        if mask_T is not None:
            gate_TK = gate_TK * mask_T.to(gate_TK.dtype)[:, None]
        return (h + gate_TK[..., None] * value_TD.float()[:, None, :]).to(x_TKD.dtype)
