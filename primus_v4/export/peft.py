"""A LoRA run's adapters in Hugging Face PEFT's format, on transformers' module names.

Legend: r = rank, s = alpha / r, G = output groups of wo_a, O = o_lora rank, I = its input per
group, E = routed experts (E' = those with their own adapter: E, or fewer when shared), F = expert
ffn, D = hidden.

`PeftModel.from_pretrained(DeepseekV4ForCausalLM..., out)` loads the two files written here,
`adapter_config.json` and `adapter_model.safetensors` with A [r, in] / B [out, r] under
    base_model.model.model.layers.N.<transformers' module>.lora_{A,B}.weight
and computes our trained model's numbers: every adapter is exact, none is approximated.
  ours (in a layer)                 transformers (in model.layers.N)    PEFT
  attn.wq_a / wq_b / wkv / wo_b     self_attn.q_a_proj / q_b_proj /     target_modules
                                    kv_proj / o_b_proj
  attn.compressor.wkv / wgate       self_attn.compressor.kv_proj /      target_modules
                                    gate_proj
  moe.shared.gate_up (w1 | w3 rows) mlp.shared_experts.gate_proj |     target_modules (one per
                                    up_proj                             output span)
  moe.shared.down (w2)              mlp.shared_experts.down_proj        target_modules
  attn.wo_a_lora [G, ...]           self_attn.o_a_proj.weight [G O, I]  target_parameters
  moe.expert_lora.{gate,up,down}    mlp.experts.gate_up_proj [E, 2F, D] target_parameters
                                    / down_proj [E, D, F]
- wo_a: transformers' o_a_proj is an nn.Linear whose forward is grouped, so a module LoRA would
  mix the groups; PEFT's parameter LoRA adds s B A to the weight instead. The G per-group
  adapters are one adapter of rank G r: A = cat_g A_g [G r, I], B = blockdiag_g B_g [G O, G r]
  (B A is B_g A_g on group g's rows, zero elsewhere); rank_pattern / alpha_pattern (G r, G alpha)
  keep the scale s.
- Routed experts: PEFT's parameter LoRA on a 3-D [E, out, in] weight holds one adapter per
  expert as lora_A [E r, in] (row e r + j = expert e's A row j) and lora_B [out, r E] (column
  j E + e = expert e's B column j). Gate and up adapters of the fused gate_up are one of rank 2r:
  A_e = cat(A_gate, A_up), B_e = blockdiag(B_gate, B_up) (pattern 2r / 2 alpha); one of them
  alone is rank r with B zero on the other half's rows. Adapters shared
  by experts (E' < E) are repeated for each expert they serve. When both gate_up_proj and
  down_proj are adapted PEFT nests the wrappers: `experts.base_layer.lora_*` is gate_up_proj,
  `experts.lora_*` down_proj. PEFT reads these weights as [E, out, in] since 0.19.1 (0.19.0
  read them transposed, huggingface/peft#3165); 0.20 is the first that also loads with
  transformers 5.24 (0.19.1 fails in its key conversion).
- MTP blocks: transformers' model has none, so their adapters are left out (and counted).
- Routers: a run with `model.router_bias_update_rate` > 0 moved the routers' gate.bias, which
  no adapter holds; each layer's router then travels whole as PEFT's modules_to_save `mlp.gate`
  (its base weight, the run's bias / hash table), so the export is the trained model.

Serving: vLLM's DeepseekV4ForCausalLM (vllm/model_executor/models/deepseek_v4.py) implements
SupportsPP but not SupportsLoRA, so vLLM serves no adapter on DeepSeek-V4: serve the merged export
(`--format release`). Where vLLM does serve MoE LoRA it reads routed experts in one of two layouts
(vllm/lora/model_manager.py, chosen by the model's `is_3d_moe_weight`): per-expert keys
`mlp.experts.{i}.gate_proj|up_proj|down_proj.lora_{A,B}.weight` (False, SupportsLoRA's default;
its DeepseekV2/V3ForCausalLM), or PEFT's 3-D layout written here, `experts.base_layer.lora_*` =
gate_up_proj and `experts.lora_*` = down_proj (True: Qwen3.5-MoE, gpt-oss;
`_stack_moe_lora_weights`). PEFT 0.21 does not load per-expert `gate_proj`-named keys onto
transformers' fused expert weights (they are reported missing and stay at their init); it does
rebuild the 3-D weights from per-expert keys named as the release names its experts
(`experts.{i}.w1|w3|w2`, through transformers' deepseek_v4 key conversion), with the same config.
The 3-D layout is what PEFT itself saves, so it is the one written.
PEFT 0.21 warns about rank_pattern / alpha_pattern keys that match no targeted module (its check
looks at target_modules only), so the keys of target_parameters also name a targeted module,
behind a key of the global rank for that module (`rank_patterns`): no warning, same ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from primus_v4.durable import new_file_mode, partial_path
from primus_v4.errors import CheckpointError
from primus_v4.models.common.peft_format import lora_config, rank_patterns

CONFIG_FILE = "adapter_config.json"
CARD_FILE = "README.md"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model.model."  # PeftModel > DeepseekV4ForCausalLM > DeepseekV4Model

HF_MODULES = {  # release target -> transformers' module inside `model.layers.N`
    "wq_a": "self_attn.q_a_proj",
    "wq_b": "self_attn.q_b_proj",
    "wkv": "self_attn.kv_proj",
    "wo_b": "self_attn.o_b_proj",
    "compressor.wkv": "self_attn.compressor.kv_proj",
    "compressor.wgate": "self_attn.compressor.gate_proj",
    "shared_experts.w1": "mlp.shared_experts.gate_proj",
    "shared_experts.w3": "mlp.shared_experts.up_proj",
    "shared_experts.w2": "mlp.shared_experts.down_proj",
}
LINEARS = {  # our LoRALinear inside a block -> the release targets of its spans, in row order
    "attn.wq_a": ("wq_a",),
    "attn.wq_b": ("wq_b",),
    "attn.wkv": ("wkv",),
    "attn.wo_b": ("wo_b",),
    "attn.compressor.wkv": ("compressor.wkv",),
    "attn.compressor.wgate": ("compressor.wgate",),
    "moe.shared.gate_up": ("shared_experts.w1", "shared_experts.w3"),
    "moe.shared.down": ("shared_experts.w2",),
}
WO_A, WO_A_PARAM = "attn.wo_a_lora", "self_attn.o_a_proj.weight"
ROUTER = "mlp.gate"
ROUTER_PARTS = {  # ours inside a block -> transformers' router tensor
    "moe.router.weight": "weight",
    "moe.router.bias": "e_score_correction_bias",
    "moe.router.tid2eid": "tid2eid",
}
EXPERTS, GATE_UP, DOWN = "moe.expert_lora", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
GATE_UP_KINDS = {"experts.w1": "gate", "experts.w3": "up"}


def _linear(module: str, own: Mapping[str, torch.Tensor], targets: list[str]) -> dict:
    a, b = own[f"{module}.lora_A"], own[f"{module}.lora_B"]  # [k, r, in], [k, out_k, r]
    spans = [t for t in LINEARS[module] if t in targets]
    if len(spans) != a.shape[0]:
        raise CheckpointError(
            f"{module}: {a.shape[0]} adapted output spans, but model.lora.targets names {spans}"
        )
    out = {}
    for i, target in enumerate(spans):
        out[f"{HF_MODULES[target]}.lora_A.weight"] = a[i]
        out[f"{HF_MODULES[target]}.lora_B.weight"] = b[i]
    return out


def _grouped(own: Mapping[str, torch.Tensor]) -> dict:
    a, b = own[f"{WO_A}.lora_A"], own[f"{WO_A}.lora_B"]  # [G, r, I], [G, O, r]
    stem = WO_A_PARAM.removesuffix(".weight")
    return {f"{stem}.lora_A.weight": a.flatten(0, 1), f"{stem}.lora_B.weight": torch.block_diag(*b)}


def _per_expert(t: torch.Tensor, experts: int) -> torch.Tensor:
    """[E', ...] -> [E, ...]: adapter i serves experts [i E / E', (i + 1) E / E')."""
    if experts % t.shape[0]:
        raise CheckpointError(f"{t.shape[0]} routed-expert adapters for {experts} experts")
    return t.repeat_interleave(experts // t.shape[0], dim=0)


def _flat(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert A [E, r, in] / B [E, out, r] -> PEFT's lora_A [E r, in] / lora_B [out, r E]."""
    return a.flatten(0, 1), b.permute(1, 2, 0).flatten(1, 2)


def _experts(own: Mapping[str, torch.Tensor], experts: int) -> dict:
    def pair(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = own[f"{EXPERTS}.{kind}_A"], own[f"{EXPERTS}.{kind}_B"]
        return _per_expert(a, experts), _per_expert(b, experts)

    kinds = [k for k in ("gate", "up") if f"{EXPERTS}.{k}_A" in own]
    has_down = f"{EXPERTS}.down_A" in own
    out = {}
    if kinds:
        pairs = [pair(k) for k in kinds]
        r, f = pairs[0][0].shape[1], pairs[0][1].shape[1]
        a = torch.cat([p[0] for p in pairs], dim=1)  # [E, n r, D]
        b = pairs[0][1].new_zeros(experts, 2 * f, len(kinds) * r)  # [E, 2F, n r]
        for i, (kind, (_, bk)) in enumerate(zip(kinds, pairs, strict=True)):
            row = 0 if kind == "gate" else f  # gate rows [0, F), up rows [F, 2F)
            b[:, row : row + f, i * r : (i + 1) * r] = bk
        stem = "mlp.experts.base_layer" if has_down else "mlp.experts"  # nested: gate_up inside
        a, b = _flat(a, b)
        out |= {f"{stem}.lora_A.weight": a, f"{stem}.lora_B.weight": b}
    if has_down:
        a, b = _flat(*pair("down"))
        out |= {"mlp.experts.lora_A.weight": a, "mlp.experts.lora_B.weight": b}
    return out


def block_tensors(
    own: Mapping[str, torch.Tensor], targets: list[str], experts: int
) -> dict[str, torch.Tensor]:
    """One decoder layer's adapters (`own`: our names inside the block, `attn.wq_a.lora_A`, ...)
    as PEFT's tensors, keyed by transformers' names inside `model.layers.N`."""
    out: dict[str, torch.Tensor] = {}
    for module in sorted({n.rpartition(".")[0] for n in own}):
        if module in LINEARS:
            out |= _linear(module, own, targets)
        elif module == WO_A:
            out |= _grouped(own)
        elif module == EXPERTS:
            out |= _experts(own, experts)
        else:
            raise CheckpointError(f"adapter module {module!r} has no transformers counterpart")
    return out


def router_tensors(own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's router (`own`: our names inside the block) as PEFT's modules_to_save tensors."""
    return {f"{ROUTER}.{hf}": own[ours] for ours, hf in ROUTER_PARTS.items() if ours in own}


def adapter_config(lora: Any, cfg: Any, base_model: str | None, routers: bool) -> dict:
    """adapter_config.json of a run's `model.lora` section on model config `cfg` (see the module
    docstring); `routers`: the routers travel as modules_to_save."""
    r, alpha, o_groups = lora.rank, lora.alpha, cfg.o_groups
    modules = sorted(HF_MODULES[t] for t in lora.targets if t in HF_MODULES)
    params, wider = [], {}
    if "wo_a" in lora.targets:
        params.append(WO_A_PARAM)
        wider[WO_A_PARAM] = o_groups
    n = sum(t in lora.targets for t in GATE_UP_KINDS)
    if n:
        params.append(GATE_UP)
        if n > 1:
            wider[GATE_UP] = n
    if "experts.w2" in lora.targets:
        params.append(DOWN)
    rank_pattern, alpha_pattern = rank_patterns(
        wider, r, alpha, anchor=modules[0] if modules else None
    )
    return lora_config(
        rank=r, alpha=alpha, dropout=lora.dropout, base_model=base_model,
        target_modules=modules, target_parameters=params,
        modules_to_save=[ROUTER] if routers else None,
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
    )  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class PeftSummary:
    """What `write_peft` wrote; `left_out`: adapter tensors with no transformers module (MTP)."""

    directory: Path
    tensors: int
    total_bytes: int
    left_out: int


def write_peft(
    out: str | os.PathLike,
    layers: Iterable[tuple[int | None, dict[str, torch.Tensor]]],
    config: dict,
    *,
    dtype: torch.dtype | None = None,
    extra_files: Iterable[str | os.PathLike] = (),
    left_out: int = 0,
    prefix: str = KEY_PREFIX,
    card: str | None = None,
) -> PeftSummary:
    """Write (layer index, `block_tensors`) pieces as a PEFT adapter directory at `out`
    (LoRA tensors cast to `dtype` when given; keys `<prefix>layers.N.<name>`, or `<prefix><name>`
    for a piece of index None, outside the layers; `card`, when
    given, as its README.md), atomically: a temp directory renamed into place when complete,
    removed on any failure."""
    tensors: dict[str, torch.Tensor] = {}
    for index, piece in layers:
        for name, t in piece.items():
            to = dtype if dtype is not None and ".lora_" in name else t.dtype  # routers as held
            # own storage each (safetensors refuses views of one tensor), contiguous
            cast = t.detach().to(to, memory_format=torch.contiguous_format, copy=True)
            where = "" if index is None else f"layers.{index}."
            tensors[f"{prefix}{where}{name}"] = cast
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(out)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        # safetensors writes through a private temp file (0600): give it a new file's mode
        os.chmod(tmp / WEIGHTS_FILE, new_file_mode())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if card is not None:
            (tmp / CARD_FILE).write_text(card)
        for path in extra_files:
            shutil.copyfile(path, tmp / Path(path).name)
        if out.exists():
            out.rmdir()  # the command allows an empty --out
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return PeftSummary(directory=out, tensors=len(tensors), total_bytes=total, left_out=left_out)
