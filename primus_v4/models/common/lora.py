"""LoRA pieces every model family reuses: the spec, the adapter base (scale, dropout, zero-B /
uniform-A init drawn per parameter name), `LoRALinear` over a plain or kept-as-released linear,
and the base-tensor accessors. Which modules a family adapts is the family's
(`models/<family>/lora.py`).

Legend: T = rows, r = adapter rank, k = adapted output spans, s = alpha / r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.models.common.kept_base import ReleaseLinear, frozen_linear
from primus_v4.models.common.seeds import param_seed


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """What `apply_lora` adds: rank, alpha (scale alpha / rank), input dropout, the targets by
    release name, and per-expert or shared routed-expert adapters."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    expert_adapters: str = "per_expert"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _uniform(shape: tuple[int, ...], fan_in: int, seed: int, name: str) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, f"lora/{name}"))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


class _Adapter(nn.Module):
    """Shared by the adapter kinds: scale, dropout, and the zero-B / uniform-A init."""

    adapter_params: frozenset[str] = frozenset({"lora_A", "lora_B"})

    def __init__(self, spec: LoraSpec) -> None:
        super().__init__()
        self.rank, self.scale = spec.rank, spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()


class LoRALinear(nn.Linear):
    """nn.Linear (no bias) whose frozen `weight` gains s B_k A_k x on output spans k."""

    adapter_params = frozenset({"lora_A", "lora_B"})

    def __init__(
        self, base: nn.Linear | ReleaseLinear, spec: LoraSpec, spans: list[tuple[int, int]]
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.source = None  # the base as released (models/common/kept_base.py), instead of `weight`
        if isinstance(base, ReleaseLinear):
            self.register_parameter("weight", None)
            self.source = base.source
            kw = {"device": base.source.q.device, "dtype": base.source.dtype}
        else:
            assert base.bias is None, "release linears have no bias"
            self.weight = base.weight
            kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.register_parameter("bias", None)
        self.spans = spans  # (first output row, rows), all of one size
        size = spans[0][1]
        assert all(n == size for _, n in spans)
        self.lora_A = nn.Parameter(torch.empty(len(spans), spec.rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(len(spans), size, spec.rank, **kw))
        self.rank, self.scale = spec.rank, spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()

    def init_adapters(self, seed: int, name: str) -> None:
        with torch.no_grad():
            a = _uniform(tuple(self.lora_A.shape), self.in_features, seed, f"{name}.lora_A")
            self.lora_A.copy_(a)
            self.lora_B.zero_()

    def base_weight(self) -> torch.Tensor:
        return self.weight if self.source is None else self.source()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.source is None else frozen_linear(x, self.source)
        x2 = self.dropout(x).reshape(-1, self.in_features)
        z = torch.einsum("ti,kri->ktr", x2, self.lora_A)
        d = torch.bmm(z, self.lora_B.transpose(1, 2)) * self.scale  # [k, T, size]
        if len(self.spans) == 1 and self.spans[0] == (0, self.out_features):
            return y + d[0].view_as(y)
        pieces, at = [], 0
        for (lo, n), dk in sorted(zip(self.spans, d, strict=True), key=lambda p: p[0][0]):
            if lo > at:
                pieces.append(dk.new_zeros(dk.shape[0], lo - at))
            pieces.append(dk)
            at = lo + n
        if at < self.out_features:
            pieces.append(d.new_zeros(d.shape[1], self.out_features - at))
        return y + torch.cat(pieces, dim=1).view_as(y)


def base_kw(owner: nn.Module, name: str) -> dict:
    """Device and dtype of `owner`'s base tensor `name` (a parameter or kept as released)."""
    released = getattr(owner, f"{name}_release", None)
    if released is not None:
        return {"device": released.q.device, "dtype": released.dtype}
    t = getattr(owner, name)
    return {"device": t.device, "dtype": t.dtype}


def base_value(owner: nn.Module, name: str) -> torch.Tensor:
    """`owner`'s base tensor `name`, decoded when kept as released."""
    released = getattr(owner, f"{name}_release", None)
    return released() if released is not None else getattr(owner, name)
