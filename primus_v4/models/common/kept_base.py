"""A frozen base weight kept as the release stores it (FP8 / FP4 code bytes + ue8m0 scale
bytes), decoded when it is used: the machinery every model family's kept base shares. Which
weights a family keeps, and how its name table lays them out, is the family's
(`models/<family>/release/kept_base.py`).

Legend: G = output groups, T = rows, I / O = a grouped weight's inputs / outputs, N x K = a
linear's rows x inputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import (
    FP4_1X32,
    FP8_128X128,
    QuantFormat,
    dequantize_fp4,
    dequantize_fp8,
)

# DeepSeek-V4's block shapes; a family whose release stores others passes its own `formats`
V4_FORMATS: dict[str, QuantFormat] = {"fp8": FP8_128X128, "fp4": FP4_1X32}


def _decode(
    fmt: QuantFormat, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """One stored 2-D weight (uint8 codes, uint8 ue8m0 scales) as `dtype` [N, K]."""
    if fmt.kind == "fp8":
        return dequantize_fp8(q.view(torch.float8_e4m3fn), scale, dtype, fmt=fmt)
    return dequantize_fp4(q, scale, dtype, fmt=fmt)


class ReleaseWeight(nn.Module):
    """One of our base tensors (`ours`, e.g. `layers.3.moe.w_gate_up`) as the release stores
    it. `entry` is the family's name-table entry (`ours`, `op`, `release`: the release tensors
    with `kind` and `shape`); `formats` the release's block shape per kind (V4: FP8 128 x 128,
    FP4 1 x 32; b x b below). Layout of the `q` / `scale` byte buffers by table op:
      copy, wo_a  FP8 [N, K] / [ceil(N/b), ceil(K/b)], the release tensor itself
      cat0        FP8 [2, F, D] / [2, ceil(F/b), ceil(D/b)]: w1 then w3
      gate_up     FP4 [E, 2, F, D/2] / [E, 2, F, D/32]: expert e's w1 then w3
      down        FP4 [E, D, F/2] / [E, D, F/32]
    `self()` decodes the whole tensor, in our shape and `dtype`."""

    def __init__(
        self,
        entry: Any,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        formats: dict[str, QuantFormat] = V4_FORMATS,
    ) -> None:
        super().__init__()
        kinds = {r.kind for r in entry.release}
        if len(kinds) != 1 or not kinds <= {"fp8", "fp4"}:
            raise ValueError(f"{entry.ours}: the release stores it as {sorted(kinds)}, not FP8/FP4")
        self.ours, self.op, self.kind = entry.ours, entry.op, kinds.pop()
        self.shape, self.dtype, self.fmt = tuple(shape), dtype, formats[self.kind]
        n, k = entry.release[0].shape
        codes, scales = ((n, k) if self.kind == "fp8" else (n, k // 2)), self.fmt.scale_shape(n, k)
        lead = {"copy": (), "wo_a": (), "cat0": (2,), "gate_up": (shape[0], 2),
                "down": (shape[0],)}[self.op]  # fmt: skip
        kw = {"dtype": torch.uint8, "device": device}
        self.register_buffer("q", torch.empty(*lead, *codes, **kw), persistent=False)
        self.register_buffer("scale", torch.empty(*lead, *scales, **kw), persistent=False)

    def extra_repr(self) -> str:
        return f"{self.ours}: {self.kind} {list(self.shape)} -> {self.dtype}"

    def stored_parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(codes, scales) views, one per release tensor, in `TableEntry.release_names` order."""
        if self.op in ("copy", "wo_a"):
            return [(self.q, self.scale)]
        if self.op == "cat0":
            return [(self.q[i], self.scale[i]) for i in range(2)]
        if self.op == "gate_up":
            return [(self.q[e, j], self.scale[e, j]) for e in range(self.shape[0]) for j in (0, 1)]
        return [(self.q[e], self.scale[e]) for e in range(self.shape[0])]

    @torch.no_grad()
    def forward(self) -> torch.Tensor:
        if self.op == "cat0":
            return torch.cat([_decode(self.fmt, q, s, self.dtype) for q, s in self.stored_parts()])
        if self.op in ("copy", "wo_a"):
            return _decode(self.fmt, self.q, self.scale, self.dtype).view(self.shape)
        rows = self.q.shape[-2] * math.prod(self.q.shape[:-2])  # FP4 scales are per row
        q, scale = self.q.reshape(rows, -1), self.scale.reshape(rows, -1)
        return _decode(self.fmt, q, scale, self.dtype).view(self.shape)

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel()


class _FrozenLinear(torch.autograd.Function):
    """x W^T with W decoded here and again in backward (input gradient only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, source: ReleaseWeight) -> torch.Tensor:  # type: ignore[override]
        ctx.source = source
        return F.linear(x, source())

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g.matmul(ctx.source()), None


class _FrozenGrouped(torch.autograd.Function):
    """Per group g: x_g W_g^T (wo_a [G, O, I]), W decoded here and again in backward."""

    @staticmethod
    def forward(ctx, x_GTI: torch.Tensor, source: ReleaseWeight) -> torch.Tensor:  # type: ignore[override]
        ctx.source = source
        return torch.bmm(x_GTI, source().transpose(1, 2))

    @staticmethod
    def backward(ctx, g_GTO: torch.Tensor):  # type: ignore[override]
        return torch.bmm(g_GTO, ctx.source()), None


def frozen_linear(x: torch.Tensor, source: ReleaseWeight) -> torch.Tensor:
    return _FrozenLinear.apply(x, source)


def frozen_grouped(x_GTI: torch.Tensor, source: ReleaseWeight) -> torch.Tensor:
    return _FrozenGrouped.apply(x_GTI, source)


class ReleaseLinear(nn.Module):
    """A bias-free nn.Linear whose weight stays as released (`source`), decoded per use."""

    def __init__(self, source: ReleaseWeight) -> None:
        super().__init__()
        self.source = source
        self.out_features, self.in_features = source.shape

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.source)

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight (a new tensor; for code that reads `.weight`)."""
        return self.source()


EXPERT_TAGS = ("expert_parallel", "expert_group")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def install(model: nn.Module, name: str, param: torch.Tensor, source: ReleaseWeight) -> None:
    """Put `source` where parameter `name` of `model` was: an nn.Linear's weight becomes a
    `ReleaseLinear`; any other (a grouped wo_a, the routed experts' w_gate_up / w_down) leaves
    its attribute for `<attr>_release`. The expert-parallel tags travel with it."""
    for tag in EXPERT_TAGS:
        if hasattr(param, tag):
            setattr(source, tag, getattr(param, tag))
    owner, attr = _owner(model, name)
    if isinstance(owner, nn.Linear) and attr == "weight":
        parent, child = _owner(model, name.rpartition(".")[0])
        setattr(parent, child, ReleaseLinear(source))
    else:
        delattr(owner, attr)
        setattr(owner, f"{attr}_release", source)


def release_weights(model: nn.Module) -> Iterator[ReleaseWeight]:
    yield from (m for m in model.modules() if isinstance(m, ReleaseWeight))
