"""LoRA adapters on DeepSeek-V4's release modules; the base stays frozen.

Legend: T = rows, r = adapter rank, G = output groups, E = routed experts of the rank (E' = E per
expert, 1 shared), F = expert ffn, s = alpha / r.

A target gains s * B A x beside its frozen weight W: y = W x + s B A dropout(x). A starts
uniform in +-1/sqrt(in) (PEFT's kaiming-uniform with a = sqrt(5)), B at zero, so a fresh model
computes exactly the base model's numbers (adding zeros changes no bit). Targets use the
release's names inside a layer (`attn.wq_a`, `ffn.shared_experts.w1`, `ffn.experts.w2`, ...):
- nn.Linear weights (wq_a, wq_b, wkv, wo_b, the attention compressor's wkv / wgate, the shared
  expert's w2) become `LoRALinear`: the same `weight` Parameter, plus `lora_A` [k, r, in] and
  `lora_B` [k, out_k, r] for k adapted output spans (the shared expert's fused gate_up holds
  w1 rows [0, F) and w3 rows [F, 2F): one span each);
- wo_a [G, O, H*D/G] gets one adapter per group (`GroupedLoRA`, batched like wo_a itself);
- the routed experts' w1 / w3 / w2 get `ExpertAdapters`, per expert ([E, ...], drawn per global
  expert index so an expert shard is rows of the whole) or one shared by the rank's experts,
  run by the grouped-experts kernel (kernels/grouped_experts.py: grouped GEMMs).
Every adapter draws from a generator of (seed, its parameter name), experts from (seed, name,
global expert index): a pipeline stage or expert shard gets the same adapters as one process.
"""

from __future__ import annotations

import torch
from torch import nn

from primus_v4.kernels.grouped_experts import ExpertLoRA
from primus_v4.models.common.lora import (
    LoRALinear,
    LoraSpec,
    _Adapter,
    _uniform,
    base_kw,
    base_value,
)
from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.block import Block

EXPERT_TARGETS = {"experts.w1": "gate", "experts.w3": "up", "experts.w2": "down"}


class GroupedLoRA(_Adapter):
    """One adapter per output group of wo_a [G, O, I]: s B_g A_g o_g, batched over groups."""

    def __init__(self, attn: Attention, spec: LoraSpec) -> None:
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


def _linear_targets(block: Block) -> dict[str, tuple[nn.Module, str]]:
    """Release name -> (owner module, attribute) of the block's nn.Linear targets."""
    attn, moe = block.attn, block.moe
    out: dict[str, tuple[nn.Module, str]] = {n: (attn, n) for n in ("wq_a", "wq_b", "wkv", "wo_b")}
    if attn.compressor is not None:
        out["compressor.wkv"] = (attn.compressor, "wkv")
        out["compressor.wgate"] = (attn.compressor, "wgate")
    if moe.shared is not None:
        out["shared_experts.w1"] = (moe.shared, "gate_up")
        out["shared_experts.w3"] = (moe.shared, "gate_up")
        out["shared_experts.w2"] = (moe.shared, "down")
    return out


def _adapt_linears(block: Block, spec: LoraSpec) -> list[nn.Module]:
    table, grouped = _linear_targets(block), {}
    for target in spec.targets:
        if target in table:  # absent ones (a compressor of a dense layer) are skipped
            owner, attr = table[target]
            spans = _linear_spans(target, getattr(owner, attr))
            grouped.setdefault((id(owner), attr), (owner, attr, []))[2].extend(spans)
    made = []
    for owner, attr, spans in grouped.values():
        adapted = LoRALinear(getattr(owner, attr), spec, sorted(spans))
        setattr(owner, attr, adapted)
        made.append(adapted)
    return made


def apply_lora(model: nn.Module, spec: LoraSpec, *, seed: int) -> int:
    """Freeze every parameter of `model` (a whole model or a rank's stage and expert shard,
    materialized) and add `spec`'s adapters to each layer and MTP block it holds. Returns the
    adapter parameters added on this rank."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        _adapt_linears(block, spec)
        attn: Attention = block.attn
        if "wo_a" in spec.targets:
            attn.wo_a_lora = GroupedLoRA(attn, spec)
        kinds = [EXPERT_TARGETS[t] for t in spec.targets if t in EXPERT_TARGETS]
        if kinds:
            block.moe.expert_lora = ExpertAdapters(block.moe, spec, sorted(kinds))
    model.adapters_only = True  # checkpoints hold the adapters (and buffers), not the base
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
            w = module.base_weight().float().clone()
            for (lo, n), a, b in zip(module.spans, module.lora_A, module.lora_B, strict=True):
                w[lo : lo + n] += module.scale * (b.float() @ a.float())
            out[f"{prefix}weight"] = w
        elif isinstance(module, Attention) and module.wo_a_lora is not None:
            ad = module.wo_a_lora
            delta = torch.bmm(ad.lora_B.float(), ad.lora_A.float()) * ad.scale
            out[f"{prefix}wo_a"] = base_value(module, "wo_a").float() + delta
        elif isinstance(module, nn.Module) and getattr(module, "expert_lora", None) is not None:
            ad = module.expert_lora
            gu = base_value(module, "w_gate_up").float().clone()
            down = base_value(module, "w_down").float().clone()
            e, two_f, _ = gu.shape
            f = two_f // 2
            for kind in ad.kinds:
                a, b = getattr(ad, f"{kind}_A").float(), getattr(ad, f"{kind}_B").float()
                delta = (torch.bmm(b, a) * ad.scale).expand(e, -1, -1)  # shared: E' = 1
                if kind == "gate":
                    gu[:, :f] += delta
                elif kind == "up":
                    gu[:, f:] += delta
                else:
                    down += delta
            if {"gate", "up"} & set(ad.kinds):
                out[f"{prefix}w_gate_up"] = gu
            if "down" in ad.kinds:
                out[f"{prefix}w_down"] = down
    return out
