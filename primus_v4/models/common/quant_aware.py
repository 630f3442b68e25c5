"""Quantization-aware training in the release's own formats (`train.quant_aware: release`): the
forward and backward of a step use every weight the release stores FP8 / FP4 as the release
would store it, with a straight-through gradient into the full-precision weight.

How: for the step's forwards and backwards (and an evaluation), each such parameter's data is
swapped for its release rounding (`rounding(w)`: each of its release parts through the kernel seam's
`release_round` op (kernels/release_round.py): the release writer's quantizer,
`checkpoint_formats.fp8_fp4.quantize`, then the loader's `dequantize`, bit for bit, computed on the
weight's device by its torch reference or Triton kernel; models/<family>/release/kept_base.py names
the parts and block shapes from the family's name table), then swapped back before the optimizer
step. The gradient autograd computes is the plain backward evaluated at the quantized weights, and
it lands on the parameter (and its fp32 master) unchanged: the straight-through estimator. The
weights themselves keep full precision. A weight the release stores bf16 is used rounded to bf16
when the run holds it wider (float32 on a CPU; a bf16 run holds it so already); float32 ones are
used as they are.

LoRA (`model.lora.base: release`): the base is frozen and already as released, so what the
release would store is the merged weight. Each adapted module (models/common/lora.py) is given
its weight's rounding for the step, and its forward uses `rounding(W + s B A)` (the sum made as
the merged export makes it, float32) with the straight-through gradient into B and A: the merged
FP8 / FP4 export is the model that trained.

Cost: one quantize + dequantize of each such weight per step (on the weight's device), and the
rounded copy held beside the weight for the step (one model-dtype copy of
the quantized weights, transient). Under LoRA, each adapted weight's merged float32 sum and its
rounding live while its op runs (the routed experts inside the recomputed checkpoint, so the
backward makes them again), each adapted linear's and wo_a's served weight is saved for its
backward (model dtype), and the op's weight gradient, [out, in], is formed transiently to reach B
and A. The memory plan counts each of these (memory/plan.py, `_QuantBytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import QuantFormat
from primus_v4.kernels.registry import resolve
from primus_v4.kernels.release_round import OP_NAME

Rounding = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RoundedWeight:
    name: str
    param: nn.Parameter
    rounding: Rounding


class _StraightThrough(torch.autograd.Function):
    """rounding(w) forward, the gradient unchanged backward."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, rounding: Rounding) -> torch.Tensor:  # type: ignore[override]
        with torch.no_grad():
            return rounding(w.detach()).to(w.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


def straight_through(w: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """`rounding(w)`, bit for bit, whose gradient reaches `w` unchanged."""
    return _StraightThrough.apply(w, rounding)


@dataclass(frozen=True)
class RoundedMerge:
    """An adapted module (`LoRALinear`, `GroupedLoRA`, `ExpertAdapters`) and the release
    rounding of each base weight it adapts, by its attribute name (`weight`, `wo_a`,
    `w_gate_up`, `w_down`)."""

    name: str
    module: nn.Module
    rounding: dict[str, Rounding]


class QuantAware:
    """The rank's weights the release stores quantized, each with its release rounding; under
    LoRA, the adapted modules whose merged weights are used rounded."""

    def __init__(self, weights: list[RoundedWeight], merged: list[RoundedMerge] = ()) -> None:
        self.weights = weights
        self.merged = list(merged)

    def __len__(self) -> int:
        return len(self.weights) + sum(len(m.rounding) for m in self.merged)

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
            for m in self.merged:
                m.module.release_rounding = m.rounding
            yield
        finally:
            for w, data in zip(self.weights, kept, strict=False):
                w.param.data = data
            for m in self.merged:
                m.module.release_rounding = None


def release_rounding_of(
    model: nn.Module,
    entries: Mapping[str, Any],
    *,
    split: Callable[[Any, torch.Tensor], list[torch.Tensor]],
    join: Callable[[Any, list[torch.Tensor]], torch.Tensor],
    format_of: Callable[[Any], QuantFormat],
    bf16: frozenset[str] = frozenset(),
) -> QuantAware:
    """The parameters of `model` named in `entries` (their name-table entries: the ones the
    release stores FP8 / FP4), each rounded as the release stores it: `split` into its release
    tensors (2-D views), each put through the `release_round` op in its `format_of(entry)`
    blocks, `join`ed back into our layout (rows whose blocks are one row long go through the op
    as one tensor); those named in `bf16` (stored bf16 by the release) rounded to bf16 when they
    are held wider (a float32 run); frozen ones too (a LoRA base as the run holds it is the
    release's). Under LoRA, each adapted module with the rounding of the weights it adapts
    (their merge is float32: bf16-stored ones are rounded to bf16; float32-stored ones are left
    as they are)."""
    op = resolve(OP_NAME)

    def quantized(entry: Any) -> Rounding:
        fmt = format_of(entry)
        blocks = {"kind": fmt.kind, "block_rows": fmt.block_rows, "block_cols": fmt.block_cols}

        def rounding(value: torch.Tensor) -> torch.Tensor:
            value = value.detach()
            parts = split(entry, value)
            if fmt.block_rows == 1 and all(p.shape[-1] == value.shape[-1] for p in parts):
                return op(value.reshape(-1, value.shape[-1]), **blocks).view(value.shape)
            return join(entry, [op(p, **blocks) for p in parts])

        return rounding

    out = []
    for name, param in model.named_parameters():
        if name in bf16 and param.dtype != torch.bfloat16:
            out.append(RoundedWeight(name, param, _to_bf16))
        elif name in entries:
            out.append(RoundedWeight(name, param, quantized(entries[name])))
    merged = []
    for name, module in model.named_modules():
        bases = getattr(module, "adapted_bases", None)
        if bases is None:
            continue
        owner = name.rpartition(".")[0] if getattr(module, "beside_base", False) else name
        rounding = {}
        for attr in bases():
            base = f"{owner}.{attr}" if owner else attr
            if base in entries:
                rounding[attr] = quantized(entries[base])
            elif base in bf16:
                rounding[attr] = _to_bf16
        if rounding:
            merged.append(RoundedMerge(name, module, rounding))
    return QuantAware(out, merged)


def _to_bf16(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.bfloat16).to(value.dtype)
