"""The frozen base of a DeepSeek-V4.1 LoRA run kept as the release stores it
(`model.lora.base: release`): DeepSeek-V4's machinery (`models/common/kept_base.py`) on V4.1's
name table and block shapes.

Kept: every weight the release stores FP8 (32 x 32 e8m0 blocks: attention wq_a / wq_b / wkv /
wo_a / wo_b, indexer wq_b, shared experts, Engram wkv) or FP4 (routed experts, e8m0 per 32
inputs), decoded one weight at a time in the forward and again in the backward. The Engram
tables (FP8 rows) are indexed, not multiplied, and stay decoded in the model's dtype; bf16 and
fp32 tensors are as stored. With fresh adapters the logits are the decoded base's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import quantize
from primus_v4.models.common.kept_base import ReleaseWeight, install
from primus_v4.models.common.quant_aware import QuantAware, release_rounding_of
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release.tensors import FORMATS

KEPT = ("fp8", "fp4")


@dataclass(frozen=True, kw_only=True)
class _Part:
    kind: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class _Stored:
    """A name-table entry as `ReleaseWeight` reads one: ours, op, the release parts."""

    ours: str
    op: str
    release: tuple[_Part, ...]


def stored_entry(entry: adapter.Entry) -> _Stored:
    parts = tuple(_Part(kind=entry.kind, shape=s) for s in entry.shapes)
    return _Stored(ours=entry.ours, op=entry.op, release=parts)


@torch.no_grad()
def _quantize_into(source: ReleaseWeight, entry: adapter.Entry, value: torch.Tensor) -> None:
    """Store `value` (our tensor) as the release's writer would: each release part quantized."""
    parts = adapter.split(entry, value.detach().float().cpu())
    for part, (codes, scales) in zip(parts, source.stored_parts(), strict=True):
        q, s = quantize(part.contiguous(), fmt=FORMATS[entry.kind])
        codes.copy_(q.view(torch.uint8))
        scales.copy_(s.view(torch.uint8))


def keep_release_base(model: nn.Module, cfg: DeepseekV41Config, *, dtype: torch.dtype) -> int:
    """Replace every parameter of `model` (a whole model or an expert shard) that the release
    stores FP8 / FP4 by its `ReleaseWeight`: on the meta device unfilled (the loader reads the
    release's bytes into it), materialized with its values quantized as the release's writer
    quantizes them (a random-init base). Returns how many."""
    table = adapter.name_table(cfg)
    replaced = 0
    for name, param in list(model.named_parameters()):
        entry = table.get(name)
        if entry is None or entry.kind not in KEPT:
            continue
        source = ReleaseWeight(stored_entry(entry), shape=tuple(param.shape), dtype=dtype,
                               device=param.device, formats=FORMATS)  # fmt: skip
        if not param.is_meta:
            _quantize_into(source, entry, param)
        install(model, name, param, source)
        replaced += 1
    return replaced


def release_rounding(model: nn.Module, cfg: DeepseekV41Config) -> QuantAware:
    """Every parameter of `model` the release stores FP8 / FP4 (as `keep_release_base` keeps),
    each with its release rounding: each release part quantized as the release's writer
    quantizes it and decoded as the loader decodes it (models/common/quant_aware.py)."""
    table = adapter.name_table(cfg)
    entries = {n: e for n, e in table.items() if e.kind in KEPT}
    bf16 = frozenset(n for n, e in table.items() if e.kind == "bf16")
    return release_rounding_of(model, entries, split=adapter.split, join=adapter.join,
                               format_of=lambda e: FORMATS[e.kind], bf16=bf16)  # fmt: skip
