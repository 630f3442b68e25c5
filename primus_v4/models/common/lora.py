"""LoRA pieces every model family reuses: the spec, the adapter kinds, `apply_lora` and the
merged weights. Which modules of a layer a family adapts, by release name, is the family's
(`models/<family>/lora.py`: its layer classes and a `linear_targets(layer)` table).

Legend: T = rows, r = adapter rank, k = adapted output spans, G = output groups, E = routed
experts of the rank (E' = E per expert, 1 shared), F = expert ffn, s = alpha / r.

A target gains s * B A x beside its frozen weight W: y = W x + s B A dropout(x). A starts
uniform in +-1/sqrt(in) (PEFT's kaiming-uniform with a = sqrt(5)), B at zero, so a fresh model
computes exactly the base model's numbers (adding zeros changes no bit).
- nn.Linear weights become `LoRALinear`: the same `weight` Parameter (or the weight kept as
  released), plus `lora_A` [k, r, in] and `lora_B` [k, out_k, r] for k adapted output spans (a
  shared expert's fused gate_up holds w1 rows [0, F) and w3 rows [F, 2F): one span each);
- an attention's grouped wo_a [G, O, H*D/G] gets one adapter per group (`GroupedLoRA`, batched
  like wo_a itself; the attention adds `wo_a_lora`'s output);
- the routed experts' w1 / w3 / w2 get `ExpertAdapters`, per expert ([E, ...], drawn per global
  expert index so an expert shard is rows of the whole) or one shared by the rank's experts,
  run by the grouped-experts kernel (kernels/grouped_experts.py: grouped GEMMs).
Every adapter draws from a generator of (seed, its parameter name), experts from (seed, name,
global expert index): a pipeline stage or expert shard gets the same adapters as one process.

Quantization-aware (`train.quant_aware: release`, models/common/quant_aware.py): while a module's
`release_rounding` is set, it uses its merged weight as the merged export stores it,
rounding(W + s B A) with the sum made as export/lora.py makes it (float32, B A of every span in
one bmm, added to W's rows), the gradient straight through into B and A.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.kernels.grouped_experts import ExpertLoRA
from primus_v4.models.common.kept_base import ReleaseLinear, frozen_linear
from primus_v4.models.common.quant_aware import Rounding, straight_through
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

    @classmethod
    def of(cls, section: Any) -> LoraSpec:
        """The spec of a run config's `model.lora` section."""
        return cls(
            rank=section.rank,
            alpha=section.alpha,
            dropout=section.dropout,
            targets=tuple(section.targets),
            expert_adapters=section.expert_adapters,
        )


def _uniform(shape: tuple[int, ...], fan_in: int, seed: int, name: str) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, f"lora/{name}"))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


class _Adapter(nn.Module):
    """Shared by the adapter kinds: scale, dropout, and the zero-B / uniform-A init."""

    adapter_params: frozenset[str] = frozenset({"lora_A", "lora_B"})
    beside_base = True  # the base weights are its owner's attributes
    release_rounding: dict[str, Rounding] | None = None  # set while quantization-aware

    def __init__(self, spec: LoraSpec) -> None:
        super().__init__()
        self.rank, self.scale = spec.rank, spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()


class LoRALinear(nn.Linear):
    """nn.Linear whose frozen `weight` gains s B_k A_k x on output spans k (a frozen bias, as
    the image encoder's linears have, is kept)."""

    adapter_params = frozenset({"lora_A", "lora_B"})
    release_rounding: dict[str, Rounding] | None = None  # set while quantization-aware

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
            self.weight = base.weight
            kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.register_parameter("bias", getattr(base, "bias", None))
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

    def adapted_bases(self) -> tuple[str, ...]:
        return ("weight",)

    def merged_weight(self) -> torch.Tensor:
        """W + s B_k A_k on each span k, float32, as the merged export sums it (differentiable
        in the adapters)."""
        delta = torch.bmm(self.lora_B.float(), self.lora_A.float()) * self.scale
        w = self.base_weight().float()
        if len(self.spans) == 1 and self.spans[0] == (0, self.out_features):
            return w + delta[0]
        w = w.clone()
        for (lo, n), d in zip(self.spans, delta, strict=True):
            w[lo : lo + n] = w[lo : lo + n] + d
        return w

    def served_weight(self) -> torch.Tensor:
        """The merged weight rounded as the release stores it (float32), gradient straight
        through (quantization-aware)."""
        rounding = (self.release_rounding or {}).get("weight")
        w = self.merged_weight()
        return w if rounding is None else straight_through(w, rounding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.release_rounding is not None:
            return F.linear(x, self.served_weight().to(x.dtype), self.bias)
        y = F.linear(x, self.weight, self.bias) if self.source is None \
            else frozen_linear(x, self.source)  # fmt: skip
        return y + self._delta(x, self.lora_A, self.lora_B).view_as(y)

    def forward_float32(self, x32: torch.Tensor) -> torch.Tensor:
        """The same map computed in float32 whatever the weights' dtype (a float32 path such as
        the V4.1 compressor's pooling scores)."""
        bias = None if self.bias is None else self.bias.float()
        if self.release_rounding is not None:
            return F.linear(x32, self.served_weight(), bias)
        y = F.linear(x32, self.base_weight().float(), bias)
        return y + self._delta(x32, self.lora_A.float(), self.lora_B.float()).view_as(y)

    def _delta(self, x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> torch.Tensor:
        """s B_k A_k x on each span k, zero on the rows outside the spans: [T, out]."""
        x2 = self.dropout(x).reshape(-1, self.in_features)
        z = torch.einsum("ti,kri->ktr", x2, lora_A)
        d = torch.bmm(z, lora_B.transpose(1, 2)) * self.scale  # [k, T, size]
        if len(self.spans) == 1 and self.spans[0] == (0, self.out_features):
            return d[0]
        pieces, at = [], 0
        for (lo, n), dk in sorted(zip(self.spans, d, strict=True), key=lambda p: p[0][0]):
            if lo > at:
                pieces.append(dk.new_zeros(dk.shape[0], lo - at))
            pieces.append(dk)
            at = lo + n
        if at < self.out_features:
            pieces.append(d.new_zeros(d.shape[1], self.out_features - at))
        return torch.cat(pieces, dim=1)


def float32_linear(linear: nn.Module, x32: torch.Tensor) -> torch.Tensor:
    """`linear` (a plain, kept-as-released or adapted bias-free linear) applied in float32."""
    if isinstance(linear, LoRALinear):
        return linear.forward_float32(x32)
    return F.linear(x32, linear.weight.float())


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


EXPERT_TARGETS = {"experts.w1": "gate", "experts.w3": "up", "experts.w2": "down"}
LinearTargets = Callable[[nn.Module], dict[str, tuple[nn.Module, str]]]
"""layer -> {release name inside the layer: (owner module, attribute) of its nn.Linear}."""


class GroupedLoRA(_Adapter):
    """One adapter per output group of wo_a [G, O, I]: s B_g A_g o_g, batched over groups."""

    def __init__(self, attn: nn.Module, spec: LoraSpec) -> None:
        super().__init__(spec)
        base = attn.wo_a_release
        g, o, i = base.shape if base is not None else attn.wo_a.shape
        kw = base_kw(attn, "wo_a")
        self.lora_A = nn.Parameter(torch.empty(g, spec.rank, i, **kw))
        self.lora_B = nn.Parameter(torch.zeros(g, o, spec.rank, **kw))

    def init_adapters(self, seed: int, name: str) -> None:
        with torch.no_grad():
            fan_in = self.lora_A.shape[-1]
            self.lora_A.copy_(_uniform(tuple(self.lora_A.shape), fan_in, seed, f"{name}.lora_A"))
            self.lora_B.zero_()

    def forward(self, o_GTI: torch.Tensor) -> torch.Tensor:
        z = torch.bmm(self.dropout(o_GTI), self.lora_A.transpose(1, 2))
        return torch.bmm(z, self.lora_B.transpose(1, 2)) * self.scale

    def adapted_bases(self) -> tuple[str, ...]:
        return ("wo_a",)

    def merged(self, wo_a: torch.Tensor) -> torch.Tensor:
        """wo_a + s B_g A_g per group, float32 (differentiable in the adapters)."""
        return wo_a.float() + torch.bmm(self.lora_B.float(), self.lora_A.float()) * self.scale

    def served(self, wo_a: torch.Tensor) -> torch.Tensor:
        """The merged wo_a as the release stores it, gradient straight through."""
        rounding = (self.release_rounding or {}).get("wo_a")
        w = self.merged(wo_a)
        return w if rounding is None else straight_through(w, rounding)


class ExpertAdapters(_Adapter):
    """The routed experts' adapters: `{gate,up,down}_A` / `_B`, [E', r, in] / [E', out, r]."""

    def __init__(self, moe: nn.Module, spec: LoraSpec, kinds: list[str]) -> None:
        super().__init__(spec)
        base = moe.w_gate_up if moe.w_gate_up_release is None else moe.w_gate_up_release
        e, two_f, d = base.shape
        f, shared = two_f // 2, spec.expert_adapters == "shared"
        self.shared, self.kinds = shared, kinds
        self.adapter_params = frozenset(f"{k}_{m}" for k in kinds for m in "AB")
        self.expert_offset = getattr(moe, "expert_offset", 0)
        n = 1 if shared else e
        kw = base_kw(moe, "w_gate_up")
        dims = {"gate": (d, f), "up": (d, f), "down": (f, d)}
        for kind in kinds:
            fan_in, out = dims[kind]
            self.register_parameter(f"{kind}_A", nn.Parameter(torch.empty(n, spec.rank, fan_in,
                                                                          **kw)))  # fmt: skip
            self.register_parameter(f"{kind}_B", nn.Parameter(torch.zeros(n, out, spec.rank,
                                                                          **kw)))  # fmt: skip
            if not shared:  # sharded like the expert weights (gradients over expert-DP)
                for p in (getattr(self, f"{kind}_A"), getattr(self, f"{kind}_B")):
                    for tag in ("expert_parallel", "expert_group"):
                        if hasattr(base, tag):
                            setattr(p, tag, getattr(base, tag))

    def init_adapters(self, seed: int, name: str) -> None:
        with torch.no_grad():
            for kind in self.kinds:
                a, b = getattr(self, f"{kind}_A"), getattr(self, f"{kind}_B")
                for i in range(a.shape[0]):
                    which = "shared" if self.shared else str(self.expert_offset + i)
                    draw = _uniform(tuple(a.shape[1:]), a.shape[-1], seed,
                                    f"{name}.{kind}_A.{which}")  # fmt: skip
                    a[i].copy_(draw)
                b.zero_()

    def adapted_bases(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys("w_down" if k == "down" else "w_gate_up" for k in self.kinds))

    def merged(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"w_gate_up", "w_down"}: the rank's expert weights plus s B A of each adapted kind,
        float32, the adapted ones only (differentiable in the adapters)."""
        out: dict[str, torch.Tensor] = {}
        f = w_gate_up.shape[1] // 2
        for kind in self.kinds:
            a, b = getattr(self, f"{kind}_A").float(), getattr(self, f"{kind}_B").float()
            delta = torch.bmm(b, a) * self.scale  # [E' , out, in], E' = 1 when shared
            if kind == "down":
                out["w_down"] = w_down.float() + delta
                continue
            if "w_gate_up" not in out:
                out["w_gate_up"] = w_gate_up.float().clone()
            gu = out["w_gate_up"]
            rows = slice(0, f) if kind == "gate" else slice(f, 2 * f)
            gu[:, rows] = gu[:, rows] + delta
        return out

    def served(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> dict[str, torch.Tensor]:
        """Both expert weights as the experts use them quantization-aware: the adapted ones
        merged and rounded as the release stores them (straight through), the others as they
        are; in the base's dtype."""
        rounding = self.release_rounding or {}
        out = {"w_gate_up": w_gate_up, "w_down": w_down}
        for name, w in self.merged(w_gate_up, w_down).items():
            if name in rounding:
                w = straight_through(w, rounding[name])
            out[name] = w.to(out[name].dtype)
        return out

    def kernel_args(self) -> ExpertLoRA:
        pairs = {k: (getattr(self, f"{k}_A"), getattr(self, f"{k}_B")) for k in self.kinds}
        drop = None if isinstance(self.dropout, nn.Identity) else self.dropout
        return ExpertLoRA(**pairs, scale=self.scale, drop=drop)


def _linear_spans(target: str, linear: nn.Linear) -> list[tuple[int, int]]:
    """(first row, rows) of `target` in `linear`: the shared expert's gate_up holds w1 rows
    [0, F) then w3 rows [F, 2F); every other target is the whole weight."""
    half = linear.out_features // 2
    if target == "shared_experts.w1":
        return [(0, half)]
    if target == "shared_experts.w3":
        return [(half, half)]
    return [(0, linear.out_features)]


def _adapt_linears(layer: nn.Module, spec: LoraSpec, table: dict) -> None:
    grouped: dict = {}
    for target in spec.targets:
        if target in table:  # absent ones (a compressor of a dense layer) are skipped
            owner, attr = table[target]
            spans = _linear_spans(target, getattr(owner, attr))
            grouped.setdefault((id(owner), attr), (owner, attr, []))[2].extend(spans)
    for owner, attr, spans in grouped.values():
        setattr(owner, attr, LoRALinear(getattr(owner, attr), spec, sorted(spans)))


def apply_lora(
    model: nn.Module,
    spec: LoraSpec,
    *,
    seed: int,
    layers: tuple[type, ...],
    linear_targets: LinearTargets,
) -> int:
    """Freeze every parameter of `model` (a whole model or a rank's stage and expert shard,
    materialized) and add `spec`'s adapters to each of its `layers` (module classes with `attn`
    and `moe`, or of linears alone; `linear_targets` names their nn.Linear targets). Returns
    the adapter parameters added on this rank."""
    for p in model.parameters():
        p.requires_grad_(False)
    kinds = sorted(EXPERT_TARGETS[t] for t in spec.targets if t in EXPERT_TARGETS)
    for layer in [m for m in model.modules() if isinstance(m, layers)]:
        _adapt_linears(layer, spec, linear_targets(layer))
        if not hasattr(layer, "moe"):  # a layer of linears alone (an image encoder's block)
            continue
        if "wo_a" in spec.targets:
            layer.attn.wo_a_lora = GroupedLoRA(layer.attn, spec)
        if kinds:
            layer.moe.expert_lora = ExpertAdapters(layer.moe, spec, kinds)
    model.checkpoint_trainable_only = True  # checkpoints hold the adapters and buffers
    added = 0
    for name, module in model.named_modules():
        if isinstance(module, (LoRALinear, GroupedLoRA, ExpertAdapters)):
            module.init_adapters(seed, name)
            added += sum(p.numel() for p in module.parameters() if p.requires_grad)
    return added


def adapter_names(model: nn.Module) -> list[str]:
    """The names of `model`'s trainable (adapter) parameters."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{base parameter name: W + s B A} for every adapted weight of `model`, computed in float32
    and returned in float32 (the caller casts or quantizes): what a merged export writes."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, LoRALinear):
            out[f"{prefix}weight"] = module.merged_weight()
        elif getattr(module, "wo_a_lora", None) is not None:
            out[f"{prefix}wo_a"] = module.wo_a_lora.merged(base_value(module, "wo_a"))
        elif getattr(module, "expert_lora", None) is not None:
            bases = base_value(module, "w_gate_up"), base_value(module, "w_down")
            merged = module.expert_lora.merged(*bases)
            out |= {f"{prefix}{k}": v for k, v in merged.items()}
    return out
