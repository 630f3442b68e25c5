"""A DeepSeek-V4.1 LoRA run's adapters in Hugging Face PEFT's file format, on the release's
module names (transformers has no DeepSeek-V4.1 class, so there are no transformers names).

Legend: r = rank, G = output groups of wo_a, O = o_lora rank, I = its input per group,
E = routed experts (E' = those with their own adapter: E, or 1 when shared), F = expert ffn,
D = hidden.

The directory holds `adapter_config.json` and `adapter_model.safetensors` with A [r, in] /
B [out, r] under `base_model.model.layers.N.<release module>.lora_{A,B}.weight`, the module
names of the release's own inference model (`inference/model.py`, whose tensors are named
`layers.N.<module>.weight` with no `model.` prefix):
  ours (in a layer)                 release module (in layers.N)        PEFT
  attn.wq_a / wq_b / wkv / wo_b     attn.wq_a / wq_b / wkv / wo_b       target_modules
  attn.compressor.wkv / wgate       attn.compressor.wkv / wgate         target_modules
  moe.shared.gate_up (w1 | w3 rows) ffn.shared_experts.w1 | w3          target_modules
  moe.shared.down                   ffn.shared_experts.w2               target_modules
  moe.expert_lora.{gate,up,down}    ffn.experts.{e}.w1 / w3 / w2        target_modules, one per
                                                                        expert (E' < E: repeated)
  engram.wkv                        engram.wkv                          target_modules
  attn.wo_a_lora [G, ...]           attn.wo_a.weight [G O, I]           target_parameters
  vision.blocks.N.attn.wqkv / wo, vision.blocks.N.mlp.w1 / w2, aligner.w1 / w2 (the image
  encoder's, outside `layers.N`): keyed by those names   target_modules attn.wqkv, attn.wo,
                                                         mlp.w1, mlp.w2, aligner.w1, aligner.w2
- wo_a: the release's wo_a is one [G O, I] weight applied per group, so a module LoRA would mix
  the groups; as for DeepSeek-V4 (export/peft.py) the G per-group adapters are one parameter
  adapter of rank G r: A = cat_g A_g [G r, I], B = blockdiag_g B_g [G O, G r], with
  rank_pattern / alpha_pattern G r / G alpha keeping the scale alpha / r.
- target_modules are the module names inside a layer (PEFT matches a module whose name ends
  with one), every layer alike; a target absent from a layer (a compressor of a reuse layer, an
  Engram of a layer without one) matches nothing there.
`to_ours` reads such tensors back into our adapter names (shared routed adapters: the copy of
the first expert of each group), which is how `primus-v4` applies a PEFT directory to a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from primus_v4.models.common.peft_format import lora_config, rank_patterns

KEY_PREFIX = "base_model.model."  # PeftModel > the release's Transformer (no `model.`)
LINEARS = {  # our LoRALinear in a layer -> (release target, release module), in row order
    "attn.wq_a": (("wq_a", "attn.wq_a"),),
    "attn.wq_b": (("wq_b", "attn.wq_b"),),
    "attn.wkv": (("wkv", "attn.wkv"),),
    "attn.wo_b": (("wo_b", "attn.wo_b"),),
    "attn.compressor.wkv": (("compressor.wkv", "attn.compressor.wkv"),),
    "attn.compressor.wgate": (("compressor.wgate", "attn.compressor.wgate"),),
    "moe.shared.gate_up": (
        ("shared_experts.w1", "ffn.shared_experts.w1"),
        ("shared_experts.w3", "ffn.shared_experts.w3"),
    ),
    "moe.shared.down": (("shared_experts.w2", "ffn.shared_experts.w2"),),
    "engram.wkv": (("engram.wkv", "engram.wkv"),),
}
MODULES = {t: m for spans in LINEARS.values() for t, m in spans}  # release target -> module
WO_A, WO_A_PARAM = "attn.wo_a_lora", "attn.wo_a.weight"
EXPERTS = "moe.expert_lora"
EXPERT_KINDS = {"gate": "w1", "up": "w3", "down": "w2"}  # ours -> the release's projection
# adapters on the image encoder (`model.lora.targets` vision.* / aligner.*): our modules carry
# the release's names (`vision.blocks.N.attn.wqkv`, `aligner.w1`, ...), keyed as they are
VISION_MODULES = {"vision.wqkv": "attn.wqkv", "vision.wo": "attn.wo", "vision.w1": "mlp.w1",
                  "vision.w2": "mlp.w2", "aligner.w1": "aligner.w1",
                  "aligner.w2": "aligner.w2"}  # fmt: skip
VISION_PARTS = ("vision.", "aligner.")
ROUTER = "ffn.gate"
ROUTER_PARTS = {"moe.router.weight": "weight", "moe.router.bias": "bias"}


def _weights(module: str) -> tuple[str, str]:
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def block_tensors(
    own: Mapping[str, torch.Tensor], targets: list[str], experts: int
) -> dict[str, torch.Tensor]:
    """One layer's adapters (`own`: our names inside the layer, `attn.wq_a.lora_A`, ...) as
    PEFT's tensors keyed by the release's names inside `layers.N`."""
    out: dict[str, torch.Tensor] = {}
    for module in sorted({n.rpartition(".")[0] for n in own}):
        a, b = own.get(f"{module}.lora_A"), own.get(f"{module}.lora_B")
        if module in LINEARS:
            spans = [m for t, m in LINEARS[module] if t in targets]
            if len(spans) != a.shape[0]:
                raise ValueError(f"{module}: {a.shape[0]} adapted spans, targets name {spans}")
            for i, name in enumerate(spans):
                out |= dict(zip(_weights(name), (a[i], b[i]), strict=True))
        elif module == WO_A:
            stem = WO_A_PARAM.removesuffix(".weight")
            out |= dict(zip(_weights(stem), (a.flatten(0, 1), torch.block_diag(*b)), strict=True))
        elif module == EXPERTS:
            for kind, proj in EXPERT_KINDS.items():
                if f"{module}.{kind}_A" not in own:
                    continue
                ea, eb = own[f"{module}.{kind}_A"], own[f"{module}.{kind}_B"]
                if experts % ea.shape[0]:
                    raise ValueError(f"{ea.shape[0]} routed-expert adapters for {experts} experts")
                per = experts // ea.shape[0]
                for e in range(experts):
                    pair = (ea[e // per], eb[e // per])
                    out |= dict(zip(_weights(f"ffn.experts.{e}.{proj}"), pair, strict=True))
        else:
            raise ValueError(f"adapter module {module!r} has no DeepSeek-V4.1 release module")
    return out


def vision_tensors(own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image encoder's adapters (our names: `vision.blocks.N.attn.wqkv.lora_A`, ...; one
    span each, [1, r, in] / [1, out, r]) as PEFT's tensors, keyed by the same module names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in own.items():
        module, _, attr = name.rpartition(".")
        if not module.startswith(VISION_PARTS) or attr not in ("lora_A", "lora_B"):
            raise ValueError(f"adapter {name!r} is not on the image encoder's linears")
        out[f"{module}.{attr}.weight"] = t[0]
    return out


def router_tensors(own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's router (our names inside the layer) as modules_to_save tensors."""
    return {f"{ROUTER}.{rel}": own[ours] for ours, rel in ROUTER_PARTS.items() if ours in own}


def adapter_config(lora: Any, cfg: Any, base_model: str | None, routers: bool) -> dict:
    """adapter_config.json of a run's `model.lora` section on model config `cfg`."""
    r, alpha = lora.rank, lora.alpha
    modules = [MODULES[t] for t in lora.targets if t in MODULES]
    modules += [VISION_MODULES[t] for t in lora.targets if t in VISION_MODULES]
    modules += [f"ffn.experts.{e}.{EXPERT_KINDS[k]}" for e in range(cfg.num_moe_experts)
                for t, k in (("experts.w1", "gate"), ("experts.w3", "up"),
                             ("experts.w2", "down")) if t in lora.targets]  # fmt: skip
    wo_a = "wo_a" in lora.targets
    modules = sorted(modules)
    rank_pattern, alpha_pattern = rank_patterns(
        {WO_A_PARAM: cfg.o_groups} if wo_a else {}, r, alpha, anchor=modules[0] if modules else None
    )
    return lora_config(
        rank=r, alpha=alpha, dropout=lora.dropout, base_model=base_model,
        target_modules=modules, target_parameters=[WO_A_PARAM] if wo_a else [],
        modules_to_save=[ROUTER] if routers else None,
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
    )  # fmt: skip


def to_ours(tensors: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT tensors (full keys) -> {our adapter parameter name: tensor} for `model`, a V4.1
    model with the same adapters added (its adapter shapes say per-expert or shared). Every
    tensor is used and every adapter of `model` is filled, or it raises naming them."""
    own = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return tensors[key]

    for name, param in own.items():
        if name.startswith(VISION_PARTS):  # the image encoder's: keyed by our own name
            out[name] = take(f"{KEY_PREFIX}{name}.weight")[None]
        layer, _, rest = name.removeprefix("layers.").partition(".")
        base = f"{KEY_PREFIX}layers.{layer}."
        module, _, attr = rest.rpartition(".")
        if module in LINEARS:
            which = 0 if attr == "lora_A" else 1
            spans = [m for _, m in LINEARS[module] if f"{base}{_weights(m)[which]}" in tensors]
            out[name] = torch.stack([take(f"{base}{_weights(m)[which]}") for m in spans])
        elif module == WO_A:
            g = param.shape[0]
            if attr == "lora_A":
                out[name] = take(f"{base}attn.wo_a.lora_A.weight").unflatten(0, (g, -1))
            else:
                full, (o, r) = take(f"{base}attn.wo_a.lora_B.weight"), param.shape[1:]
                out[name] = torch.stack([full[i * o:(i + 1) * o, i * r:(i + 1) * r]
                                         for i in range(g)])  # fmt: skip
        elif module == EXPERTS:
            kind, ab = attr.split("_")
            experts = model.cfg.num_moe_experts
            per = experts // param.shape[0]
            keys = [f"{base}ffn.experts.{e}.{EXPERT_KINDS[kind]}.lora_{ab}.weight"
                    for e in range(experts)]  # fmt: skip
            for k in keys:
                used.add(k)
            out[name] = torch.stack([tensors[keys[i * per]] for i in range(param.shape[0])])
        if name not in out or tuple(out[name].shape) != tuple(param.shape):
            got = None if name not in out else list(out[name].shape)
            raise ValueError(
                f"{name}: the PEFT file gives {got}, the model has {list(param.shape)}"
            )
    stray = sorted(k for k in tensors if ".lora_" in k and k not in used)
    if stray:
        raise ValueError(f"PEFT tensors with no adapter of this model: {stray[:8]}")
    return out
