"""Exports of a DeepSeek-V4.1 LoRA model (the golden tiny release as its base):
- merged: the adapters merged into the release's decoded base (export/lora.py's merge, float32)
  and written by the V4.1 release writer beside its release; every written weight is the bf16
  rounding of W + (alpha / r) B A (the release's own weights elsewhere), the directory loads
  back as the model with those weights, and the unrounded merge has the adapter model's logits;
- PEFT: the adapters in PEFT's file format on the release's module names (models/deepseek_v41/
  peft.py, written by export/peft.py's writer): names, shapes, the config's target_modules /
  rank / alpha, and read back by `peft.to_ours` the same adapters, so the same logits bit for
  bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dsv41_model import CHECKPOINT, documents, golden, pack
from safetensors.torch import load_file

from primus_v4.config.schema import LORA_ENGRAM_TARGETS, LORA_TARGETS, LoraConfig
from primus_v4.export.lora import _release_base, merge_adapters
from primus_v4.export.peft import CONFIG_FILE, WEIGHTS_FILE, write_peft
from primus_v4.models import spec_of
from primus_v4.models.common.lora import LoraSpec, merged_weights
from primus_v4.models.deepseek_v41 import peft
from primus_v4.models.deepseek_v41.lora import apply_lora
from primus_v4.models.deepseek_v41.release.load import load_pretrained

REL = 1e-5  # the same weights, float32: summation order only


def _load(path: Path) -> torch.nn.Module:
    return load_pretrained(path, progress=False, token_map=golden()["token_map"]).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids, pos, psp = pack(documents()[:2])
    with torch.no_grad():
        return model(ids, pos, packed_seq_params=psp).logits


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _trained(section: LoraConfig) -> torch.nn.Module:
    model = _load(CHECKPOINT)
    apply_lora(model, LoraSpec.of(section), seed=1)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _section(experts: str) -> LoraConfig:
    targets = list(LORA_TARGETS + LORA_ENGRAM_TARGETS)
    return LoraConfig(rank=4, alpha=8.0, targets=targets, expert_adapters=experts)


@pytest.fixture(scope="module", params=["per_expert", "shared"])
def trained(request) -> tuple[LoraConfig, torch.nn.Module]:
    section = _section(request.param)
    return section, _trained(section)


@pytest.fixture(scope="module")
def per_expert() -> tuple[LoraConfig, torch.nn.Module]:
    section = _section("per_expert")
    return section, _trained(section)


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_merged_export_loads_back_as_the_merged_model(per_expert, tmp_path: Path) -> None:
    section, model = per_expert
    cfg = model.cfg
    table = spec_of(cfg).release.names.name_table(cfg)
    with _release_base(cfg, str(CHECKPOINT)) as read:
        state = read(list(table))
    merged = merge_adapters(state, _adapters(model), section)
    want = merged_weights(model)  # the model's own merge, float32
    assert sorted(merged) == sorted(want)
    assert all(torch.allclose(state[n], want[n], rtol=0, atol=1e-6) for n in want)
    out = tmp_path / "merged"
    spec_of(cfg).release.write_state(cfg, [state], out, dtype="bfloat16", carry_from=CHECKPOINT)
    back = _load(out)
    written = back.state_dict()
    for name in merged:
        assert torch.equal(written[name], state[name].bfloat16().float()), name
    reference = _load(CHECKPOINT)  # where nothing is adapted the release's own weights
    original = reference.state_dict()
    assert all(torch.equal(written[n], original[n]) for n in original if n not in merged)
    reference.load_state_dict({n: state[n].bfloat16().float() for n in merged}, strict=False)
    assert _rel(_logits(back), _logits(reference)) < REL
    # the merge unrounded is the adapter model (bf16 rounding itself moves some top-k choices of
    # this tiny random model, so the rounded export is compared weight by weight above)
    reference.load_state_dict({n: state[n] for n in merged}, strict=False)
    assert _rel(_logits(reference), _logits(model)) < REL


def test_peft_file_round_trips_on_release_names(trained, tmp_path: Path) -> None:
    section, model = trained
    cfg = model.cfg
    adapters = _adapters(model)

    def layers():
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}."
            own = {n.removeprefix(prefix): t for n, t in adapters.items() if n.startswith(prefix)}
            yield i, peft.block_tensors(own, section.targets, cfg.num_moe_experts)

    config = peft.adapter_config(section, cfg, str(CHECKPOINT), routers=False)
    out = tmp_path / "peft"
    summary = write_peft(out, layers(), config, prefix=peft.KEY_PREFIX)
    written = json.loads((out / CONFIG_FILE).read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8.0
    assert written["target_parameters"] == ["attn.wo_a.weight"]
    assert written["rank_pattern"] == {"attn.wo_a.weight": cfg.o_groups * 4}
    assert written["alpha_pattern"] == {"attn.wo_a.weight": cfg.o_groups * 8.0}
    experts = [f"ffn.experts.{e}.w{k}" for e in range(cfg.num_moe_experts) for k in (1, 2, 3)]
    assert written["target_modules"] == sorted([
        "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.compressor.wkv",
        "attn.compressor.wgate", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
        "ffn.shared_experts.w3", "engram.wkv", *experts,
    ])  # fmt: skip
    tensors = load_file(out / WEIGHTS_FILE)
    assert summary.tensors == len(tensors)
    d, q, f = cfg.hidden_size, cfg.q_lora_rank, cfg.moe_ffn_hidden_size
    g, o = cfg.o_groups, cfg.o_lora_rank
    i = cfg.num_attention_heads * cfg.kv_channels // g
    base = "base_model.model.layers.4."  # a ratio-2 kv source with Engram
    shapes = {
        "attn.wq_a.lora_A.weight": (4, d), "attn.wq_a.lora_B.weight": (q, 4),
        "attn.wo_a.lora_A.weight": (g * 4, i), "attn.wo_a.lora_B.weight": (g * o, g * 4),
        "attn.compressor.wgate.lora_A.weight": (4, d),
        "ffn.shared_experts.w3.lora_B.weight": (f, 4),
        "ffn.experts.7.w2.lora_A.weight": (4, f), "ffn.experts.7.w2.lora_B.weight": (d, 4),
        "engram.wkv.lora_B.weight": (d * (cfg.hc_mult + 1), 4),
    }  # fmt: skip
    for name, shape in shapes.items():
        assert tuple(tensors[base + name].shape) == shape, name
    assert not [k for k in tensors if k.startswith("base_model.model.layers.7.attn.compressor")]
    fresh = _load(CHECKPOINT)
    apply_lora(fresh, LoraSpec.of(section), seed=99)  # other adapters until the file's load
    fresh.load_state_dict(peft.to_ours(tensors, fresh), strict=False)
    assert torch.equal(_logits(fresh), _logits(model))
    with pytest.raises(ValueError, match="PEFT tensors with no adapter of this model"):
        peft.to_ours({**tensors, f"{base}attn.wq_x.lora_A.weight": tensors[base + "attn.wq_a."
                                                                            "lora_A.weight"]},
                     fresh)  # fmt: skip
