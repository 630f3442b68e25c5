"""LoRA adapters on DeepSeek-V4.1 (models/deepseek_v41/lora.py) on the golden tiny model:
- fresh adapters (B = 0) on every target leave every logit bit for bit the base model's;
- trained (random) adapters equal the base model with merged weights W + (alpha / r) B A, every
  target, per-expert and shared routed adapters (float64: no top-k choice moves on rounding);
- only adapters get gradients, and the targets are the release's module names.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dsv41_model import documents, next_token_labels, pack

from primus_v4.config.schema import LORA_ENGRAM_TARGETS, LORA_TARGETS
from primus_v4.errors import ConfigError
from primus_v4.models.common.lora import LoraSpec, merged_weights
from primus_v4.models.deepseek_v4.lora import apply_lora as v4_apply_lora
from primus_v4.models.deepseek_v41.lora import apply_lora

ALL = LORA_TARGETS + LORA_ENGRAM_TARGETS
# float64, but mHC, Engram and the compressor score compute in float32: the merged and adapter
# paths differ by that rounding (measured <= 9.3e-7 of the largest logit)
REL = 1e-5


def _logits(model, docs) -> torch.Tensor:
    ids, pos, psp = pack(docs)
    with torch.no_grad():
        return model(ids, pos, packed_seq_params=psp).logits


def _pair(golden_model, targets, *, experts="per_expert", trained=True, dtype=torch.float32):
    base = copy.deepcopy(golden_model).to(dtype)
    model = copy.deepcopy(base)
    added = apply_lora(model, LoraSpec(rank=4, alpha=8.0, targets=targets,
                                       expert_adapters=experts), seed=3)  # fmt: skip
    assert added > 0
    if trained:
        # adapters drawn so that no top-k or routing choice of these documents sits within
        # rounding of a tie (seed 11 puts one at a near tie, the golden set's "fragile" kind)
        gen = torch.Generator().manual_seed(12)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05)
    return base, model


def test_fresh_adapters_leave_the_base_logits_bit_for_bit(golden_model) -> None:
    base, model = _pair(golden_model, ALL, trained=False)
    docs = documents()[:2]
    assert torch.equal(_logits(model, docs), _logits(base, docs))


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
@pytest.mark.parametrize("targets", [ALL, ("wo_a", "experts.w3", "engram.wkv")], ids=["all", "few"])
def test_adapters_equal_the_merged_weights(golden_model, experts, targets) -> None:
    base, model = _pair(golden_model, targets, experts=experts, dtype=torch.float64)
    merged = merged_weights(model)
    state = base.state_dict()
    assert set(merged) <= set(state)
    base.load_state_dict({**state, **merged})
    docs = documents()[:2]
    got, want = _logits(model, docs), _logits(base, docs)
    assert not torch.equal(got, _logits(copy.deepcopy(golden_model).double(), docs))
    assert float((got - want).abs().max() / want.abs().max()) < REL


def test_only_adapters_learn_on_the_named_release_modules(golden_model) -> None:
    _, model = _pair(golden_model, ALL, trained=False)
    docs = documents()[:2]
    ids, pos, psp = pack(docs)
    out = model(ids, pos, packed_seq_params=psp, labels=next_token_labels(docs))
    out.loss_sum.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert all(model.get_parameter(n).grad is not None for n in trainable)
    owners = {n.rsplit(".", 1)[0] for n in trainable if n.startswith("layers.4.")}
    assert owners == {
        "layers.4.attn.wq_a", "layers.4.attn.wq_b", "layers.4.attn.wkv", "layers.4.attn.wo_b",
        "layers.4.attn.wo_a_lora", "layers.4.attn.compressor.wkv",
        "layers.4.attn.compressor.wgate", "layers.4.moe.shared.gate_up",
        "layers.4.moe.shared.down", "layers.4.moe.expert_lora", "layers.4.engram.wkv",
    }  # fmt: skip
    # a ratio-1 kv source has no compressor gate; a reuse layer no compressor; no Engram on 2
    assert not any(n.startswith(("layers.6.attn.compressor.wgate", "layers.7.attn.compressor",
                                 "layers.2.engram")) for n in trainable)  # fmt: skip


def test_default_targets_leave_compressor_and_engram_frozen(golden_model) -> None:
    from primus_v4.config.schema import LoraConfig

    section = LoraConfig(rank=4)
    assert not {"compressor.wkv", "compressor.wgate", "engram.wkv"} & set(section.targets)
    _, model = _pair(golden_model, tuple(section.targets), trained=False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not [n for n in names if ".compressor." in n or ".engram." in n]


def test_deepseek_v4_refuses_the_engram_target() -> None:
    with pytest.raises(ConfigError, match=r"engram\.wkv: DeepSeek-V4 has no Engram"):
        v4_apply_lora(torch.nn.Linear(2, 2), LoraSpec(rank=2, alpha=2.0,
                                                      targets=("engram.wkv",)), seed=0)  # fmt: skip
