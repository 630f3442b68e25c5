"""The release's activation fake-quantization (`activation_fake_quant`, off by default): the
roundings the release's inference applies and gradients straight through. The golden model is
random and tiny: its manifest measures the release's fully quantized path at a relative
Frobenius error of ~0.8 against the float32 logits, so on it the knob can only be checked to be
off by default and to act when on, not for a value."""

from __future__ import annotations

import pytest
import torch
from dsv41_model import CHECKPOINT, documents, golden

from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v41 import fake_quant
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.release.load import read_config


def test_fp8_and_fp4_blocks_round_like_the_release() -> None:
    # one block of 32 with max 448 * 2^-3: scale 2^-3, e4m3 codes times it come back as they are
    exact = torch.tensor([56.0, -0.125, 3.25, 0.0] * 8)
    assert torch.equal(fake_quant.fp8_window(exact), exact)
    x = torch.tensor([5.9, 0.7, 0.75, 1.75, 3.5, -2.6, 0.2, 0.26] * 4)  # max 5.9: scale 1
    want = torch.tensor([6.0, 0.5, 1.0, 2.0, 4.0, -3.0, 0.0, 0.5] * 4)  # ties to the even code
    assert torch.equal(fake_quant.fp4_index(x), want)
    y = torch.tensor([3.0] + [0.1] * 15)  # e4m3 scale 3/6 = 0.5: codes 6, 0.0 (0.2 < 0.25)
    assert torch.equal(fake_quant.fp4_kv(y), torch.tensor([3.0] + [0.0] * 15))
    g = torch.randn(64, requires_grad=True)
    fake_quant.fp4_index(g).sum().backward()
    assert torch.equal(g.grad, torch.ones(64))  # straight through


def test_the_knob_needs_blocks_of_32() -> None:
    cfg = read_config(CHECKPOINT)
    values = {f: getattr(cfg, f) for f in ("num_layers", "hidden_size", "num_attention_heads")}
    with pytest.raises(ConfigError, match="multiples of 32"):
        DeepseekV41Config(**values, num_query_groups=1, kv_channels=48, qk_pos_emb_head_dim=8,
                          o_groups=2, num_moe_experts=4, moe_ffn_hidden_size=8,
                          compress_ratios=[0] * cfg.num_layers, kv_source_layer_ids=[],
                          index_source_layer_ids=[], activation_fake_quant=True)  # fmt: skip


def test_fake_quant_is_off_by_default_and_acts_when_on(golden_model) -> None:
    assert DeepseekV41Config.__dataclass_fields__["activation_fake_quant"].default is False
    ids = documents()[1]
    logits = {}
    for on in (False, True):
        for layer in golden_model.layers:
            layer.attn.fake_quant = on
        with torch.no_grad():
            logits[on] = golden_model(ids[None]).logits[0]
    for layer in golden_model.layers:
        layer.attn.fake_quant = False
    ref = golden()["doc1.logits"]
    off = float((logits[False] - ref).abs().max() / ref.abs().max())
    moved = float((logits[True] - ref).abs().max() / ref.abs().max())
    print(f"doc1: fake-quant off {off:.1e}, on {moved:.1e} of the max logit")
    assert off <= 1e-5 and read_config(CHECKPOINT).activation_fake_quant is False
    assert moved > 1e-3 and bool(logits[True].isfinite().all())
