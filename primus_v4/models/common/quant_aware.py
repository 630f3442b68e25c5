"""Quantization-aware training in the release's own formats (`train.quant_aware: release`): the
forward and backward of a step use every weight the release stores FP8 / FP4 as the release
would store it, with a straight-through gradient into the full-precision weight.

How: for the step's forwards and backwards (and an evaluation), each such parameter's data is
swapped for its release rounding (`rounding(w)`: the release writer's quantization of each of
its release parts, `checkpoint_formats.fp8_fp4.quantize`, decoded back by the loader's
`dequantize`; models/<family>/release/kept_base.py builds it on the family's name table and
block shapes), then swapped back before the optimizer step. The gradient autograd computes is
the plain backward evaluated at the quantized weights, and it lands on the parameter (and its
fp32 master) unchanged: the straight-through estimator. The weights themselves keep full
precision. A weight the release stores bf16 is used rounded to bf16 when the run holds it wider
(float32 on a CPU; a bf16 run holds it so already); float32 ones are used as they are.

Cost: one quantize + dequantize of each such weight per step (on the CPU, where the writer
quantizes), and the rounded copy held beside the weight for the step (one model-dtype copy of
the quantized weights, transient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Rounding = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RoundedWeight:
    name: str
    param: nn.Parameter
    rounding: Rounding


class QuantAware:
    """The rank's weights the release stores quantized, each with its release rounding."""

    def __init__(self, weights: list[RoundedWeight]) -> None:
        self.weights = weights

    def __len__(self) -> int:
        return len(self.weights)

    def numel(self) -> int:
        return sum(w.param.numel() for w in self.weights)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Within: every weight holds its release rounding (gradients flow to it unchanged);
        after: the full-precision values again, untouched."""
        kept: list[torch.Tensor] = []
        try:
            with torch.no_grad():
                for w in self.weights:
                    kept.append(w.param.data)
                    w.param.data = w.rounding(w.param.data).to(w.param.dtype)
            yield
        finally:
            for w, data in zip(self.weights, kept, strict=False):
                w.param.data = data


def release_rounding_of(
    model: nn.Module,
    entries: Mapping[str, Any],
    source_of: Callable[[Any, tuple[int, ...]], nn.Module],
    quantize_into: Callable[[nn.Module, Any, torch.Tensor], None],
    bf16: frozenset[str] = frozenset(),
) -> QuantAware:
    """The trainable parameters of `model` named in `entries` (their name-table entries: the
    ones the release stores FP8 / FP4), each rounded as a family's kept base stores it:
    `quantize_into(source_of(entry, shape), entry, value)`, then that `ReleaseWeight` decoded;
    and those named in `bf16` (stored bf16 by the release) rounded to bf16 when they are held
    wider (a float32 run)."""
    out = []
    for name, param in model.named_parameters():
        if name in bf16 and param.requires_grad and param.dtype != torch.bfloat16:
            out.append(RoundedWeight(name, param, _to_bf16))
            continue
        entry = entries.get(name)
        if entry is None or not param.requires_grad:
            continue

        def rounding(value: torch.Tensor, entry: Any = entry) -> torch.Tensor:
            source = source_of(entry, tuple(value.shape))
            quantize_into(source, entry, value)
            return source().to(value.device)

        out.append(RoundedWeight(name, param, rounding))
    return QuantAware(out)


def _to_bf16(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.bfloat16).to(value.dtype)
