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

The buffers are filled from the release by `pretrained.load.load_rank_weights` (one stored
tensor at a time, read undecoded).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import (
    FP4_BLOCK,
    FP8_BLOCK,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
)
from primus_v4.models.deepseek_v4 import state_dict_adapter as adapter
from primus_v4.models.deepseek_v4.config import DeepseekV4Config

EXPERT_TAGS = ("expert_parallel", "expert_group")


def _decode(kind: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One stored 2-D weight (uint8 codes, uint8 ue8m0 scales) as `dtype` [N, K]."""
    if kind == "fp8":
        return dequantize_fp8(q.view(torch.float8_e4m3fn), scale, dtype)
    return dequantize_fp4(q, scale, dtype)


class ReleaseWeight(nn.Module):
    """One of our base tensors (`ours`, e.g. `layers.3.moe.w_gate_up`) as the release stores
    it. Layout of the `q` / `scale` byte buffers by table op (state_dict_adapter):
      copy, wo_a  FP8 [N, K] / [ceil(N/128), ceil(K/128)], the release tensor itself
      cat0        FP8 [2, F, D] / [2, ceil(F/128), ceil(D/128)]: w1 then w3
      gate_up     FP4 [E, 2, F, D/2] / [E, 2, F, D/32]: expert e's w1 then w3
      down        FP4 [E, D, F/2] / [E, D, F/32]
    `self()` decodes the whole tensor, in our shape and `dtype`."""

    def __init__(
        self,
        entry: adapter.TableEntry,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        kinds = {r.kind for r in entry.release}
        if len(kinds) != 1 or not kinds <= {"fp8", "fp4"}:
            raise ValueError(f"{entry.ours}: the release stores it as {sorted(kinds)}, not FP8/FP4")
        self.ours, self.op, self.kind = entry.ours, entry.op, kinds.pop()
        self.shape, self.dtype = tuple(shape), dtype
        n, k = entry.release[0].shape
        if self.kind == "fp8":
            codes, scales = (n, k), (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
        else:
            codes, scales = (n, k // 2), (n, k // FP4_BLOCK)
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
            return torch.cat([_decode(self.kind, q, s, self.dtype) for q, s in self.stored_parts()])
        if self.op in ("copy", "wo_a"):
            return _decode(self.kind, self.q, self.scale, self.dtype).view(self.shape)
        rows = self.q.shape[-2] * math.prod(self.q.shape[:-2])  # FP4 scales are per row
        q, scale = self.q.reshape(rows, -1), self.scale.reshape(rows, -1)
        return _decode(self.kind, q, scale, self.dtype).view(self.shape)

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


def release_weights(model: nn.Module) -> Iterator[ReleaseWeight]:
    yield from (m for m in model.modules() if isinstance(m, ReleaseWeight))


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


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
        for tag in EXPERT_TAGS:
            if hasattr(param, tag):
                setattr(source, tag, getattr(param, tag))
        if not param.is_meta:
            _quantize_into(source, entry, param)
        owner, attr = _owner(model, name)
        if isinstance(owner, nn.Linear) and attr == "weight":
            parent, child = _owner(model, name.rpartition(".")[0])
            setattr(parent, child, ReleaseLinear(source))
        else:  # Attention.wo_a, MoE.w_gate_up / w_down
            delattr(owner, attr)
            setattr(owner, f"{attr}_release", source)
        replaced += 1
    return replaced
