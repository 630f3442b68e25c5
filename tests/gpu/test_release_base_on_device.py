"""The LoRA base kept as released, on the device: each weight decodes there (FP8 by torch's cast,
FP4 by the elementwise nibble path) to the CPU loader's bits, and fresh adapters leave the
decoded-base model's logits unchanged."""

from __future__ import annotations

import pytest
import torch
from cpu_helpers import load

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.config.schema import LORA_TARGETS
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory: pytest.TempPathFactory):
    ckpt = load("unit/models/release_checkpoint.py")
    config = ckpt.release_config("a")
    root = tmp_path_factory.mktemp("release_base_device")
    src = ckpt.write_checkpoint(root / "src", config, ckpt.random_release_tensors(config, seed=11))
    save_pretrained(load_pretrained(src, dtype=torch.float32, progress=False), root / "fp8",
                    dtype="fp8", progress=False)  # fmt: skip
    return root / "fp8", config


@torch.no_grad()
def test_device_decode_equals_the_cpu_loader(device, fp8_release) -> None:
    directory, config = fp8_release
    cpu = load_pretrained(directory, dtype=torch.bfloat16, progress=False).state_dict()
    kept = load_pretrained(directory, dtype=torch.bfloat16, progress=False, keep_release=True,
                           device=device)  # fmt: skip
    weights = list(release_weights(kept))
    assert {w.kind for w in weights} == {"fp8", "fp4"}
    for w in weights:
        got = w()
        assert got.device.type == device.type and torch.equal(got.cpu(), cpu[w.ours]), w.ours
    decoded = load_pretrained(directory, dtype=torch.bfloat16, progress=False, device=device)
    ids = torch.randint(2, config["vocab_size"], (1, 64), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))  # fmt: skip
    want = decoded(ids).logits
    apply_lora(kept, LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS), seed=1)
    assert torch.equal(kept(ids).logits, want)
