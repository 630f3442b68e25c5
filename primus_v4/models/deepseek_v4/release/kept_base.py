"""The frozen base of a LoRA run kept as the release stores it (`model.lora.base: release`).

Legend: E = routed experts of the rank, F = expert ffn, D = hidden, N x K = a linear's rows x
inputs.

A LoRA run never updates its base; it only multiplies with it. `keep_release_base` replaces each
base weight the release stores FP8 or FP4 by a `ReleaseWeight`: the stored code bytes and their
ue8m0 scale bytes (uint8 buffers, not parameters: checkpoints, optimizers and casts skip them),
about 1.02 bytes per value for FP8 (128x128 blocks) and 0.53 for FP4 (one scale per 32 inputs)
instead of bf16's 2. Flash's base is ~160 GB this way, ~580 GB as bf16.

Each weight is decoded when it is used and dropped after:
- linears (`ReleaseLinear`: the attention, indexer-query, shared-expert and MTP projections)
  and the grouped wo_a: the forward decodes and multiplies; the backward decodes again for the
  input gradient (the base has no weight gradient), so no decoded weight outlives its op;
- the routed experts: the grouped-experts op runs inside a non-reentrant checkpoint whose
  forward decodes the rank's expert weights, so the backward recomputes them (and the experts'
  activations) instead of keeping them: one extra expert forward per step, one layer's decoded
  experts alive at a time.
Decoding is `checkpoint_formats.fp8_fp4`'s, which the release loader uses too: the same bits as
`load_pretrained` in the model's dtype, and with fresh adapters (B = 0) the same logits.

The decode-per-use machinery is `models/common/kept_base.py`. The buffers are filled from the
release by `release/load.py`'s `load_rank_weights` (one stored
tensor at a time, read undecoded).
"""

from __future__ import annotations

import torch
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import quantize_fp4, quantize_fp8
from primus_v4.models.common.kept_base import V4_FORMATS, ReleaseWeight, install
from primus_v4.models.common.quant_aware import QuantAware, release_rounding_of
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter


@torch.no_grad()
def _quantize_into(source: ReleaseWeight, entry: adapter.TableEntry, value: torch.Tensor) -> None:
    """Store `value` (our tensor) as the release would: each release part quantized."""
    quantize = quantize_fp8 if source.kind == "fp8" else quantize_fp4
    parts = adapter.split_release(entry, value.detach().float().cpu())
    for part, (codes, scales) in zip(parts, source.stored_parts(), strict=True):
        q, s = quantize(part.contiguous())
        codes.copy_(q.view(torch.uint8))
        scales.copy_(s.view(torch.uint8))


def keep_release_base(model: nn.Module, cfg: DeepseekV4Config, *, dtype: torch.dtype) -> int:
    """Replace every parameter of `model` (a whole model, a pipeline stage or an expert shard)
    that the release stores FP8 / FP4 by its `ReleaseWeight`: on the meta device unfilled (the
    loader reads the release's bytes into it), materialized with the parameter's values quantized
    as the release's writer quantizes them (a random-init base). Returns how many."""
    table = adapter.name_table(cfg)
    replaced = 0
    for name, param in list(model.named_parameters()):
        entry = table.get(name)
        if entry is None or not {r.kind for r in entry.release} <= {"fp8", "fp4"}:
            continue
        source = ReleaseWeight(entry, shape=tuple(param.shape), dtype=dtype, device=param.device)
        if not param.is_meta:
            _quantize_into(source, entry, param)
        install(model, name, param, source)
        replaced += 1
    return replaced


def release_rounding(model: nn.Module, cfg: DeepseekV4Config) -> QuantAware:
    """Every parameter of `model` the release stores FP8 / FP4 (as `keep_release_base` keeps),
    each with its release rounding: each release part quantized as the release's writer
    quantizes it and decoded as the loader decodes it (models/common/quant_aware.py)."""
    table = adapter.name_table(cfg)
    entries = {n: e for n, e in table.items()
               if e.release and {r.kind for r in e.release} <= {"fp8", "fp4"}}  # fmt: skip
    bf16 = frozenset(n for n, e in table.items()
                     if e.release and {r.kind for r in e.release} == {"bf16"})  # fmt: skip

    def join(entry: adapter.TableEntry, parts: list[torch.Tensor]) -> torch.Tensor:
        return adapter.join_release(entry, parts, rows=len(parts) // 2)  # gate_up: 2 per expert

    return release_rounding_of(model, entries, split=adapter.split_release, join=join,
                               format_of=lambda e: V4_FORMATS[e.release[0].kind],
                               bf16=bf16)  # fmt: skip
