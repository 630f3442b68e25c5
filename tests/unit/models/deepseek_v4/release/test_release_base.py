"""The base kept as released (`model.lora.base: release`, release_base.py): every FP8 / FP4
weight of a release stays as its stored bytes and decodes to exactly what the loader decodes;
with fresh adapters (B = 0) the logits are the base model's bit for bit; with trained adapters
the logits and the adapters' gradients are the decoded-base model's; no decoded weight is kept
by autograd between the forward and the backward; a release stored unquantized is refused."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from release_checkpoint import random_release_tensors, release_config, write_checkpoint

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.checkpoint_formats.fp8_fp4 import dequantize_fp4, dequantize_fp4_elementwise
from primus_v4.config.schema import LORA_TARGETS
from primus_v4.errors import CheckpointFormatError
from primus_v4.models.common.kept_base import ReleaseWeight, release_weights
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter

ALL = LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS)


@pytest.fixture(scope="module", params=["a", "c"])
def release(request, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An FP8 / FP4 release of a random tiny model (and its unquantized source)."""
    config = release_config(request.param)
    root = tmp_path_factory.mktemp(f"release_base_{request.param}")
    src = write_checkpoint(root / "src", config, random_release_tensors(config, seed=11))
    save_pretrained(load_pretrained(src, dtype=torch.float32, progress=False), root / "fp8",
                    dtype="fp8", progress=False)  # fmt: skip
    return {"config": config, "dir": root / "fp8", "src": src}


def _pair(directory: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    decoded = load_pretrained(directory, dtype=dtype, progress=False)
    kept = load_pretrained(directory, dtype=dtype, progress=False, keep_release=True)
    return decoded.eval(), kept.eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@torch.no_grad()
def test_kept_weights_decode_to_the_loaders_bits(release: dict, dtype: torch.dtype) -> None:
    decoded, kept = _pair(release["dir"], dtype)
    cfg = adapter.config_from_release(release["config"])
    quantized = {n for n, e in adapter.name_table(cfg).items()
                 if {r.kind for r in e.release} <= {"fp8", "fp4"}}  # fmt: skip
    weights = {w.ours: w for w in release_weights(kept)}
    assert weights.keys() == quantized and {w.kind for w in weights.values()} == {"fp8", "fp4"}
    reference = decoded.state_dict()
    for name, w in weights.items():
        got = w()
        assert got.dtype == dtype and torch.equal(got, reference[name]), name
    own = kept.state_dict()  # everything else is the loader's, and no base bytes in it
    assert own.keys() == reference.keys() - quantized
    assert all(torch.equal(own[n], reference[n]) for n in own)
    stored = sum(w.nbytes() for w in weights.values())
    as_dtype = sum(reference[n].numel() * dtype.itemsize for n in quantized)
    assert stored < as_dtype * (0.53 if dtype == torch.bfloat16 else 0.27)


def test_fp4_device_decode_equals_the_table_decode() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (48, 48), dtype=torch.uint8, generator=g).view(torch.int8)
    scales = torch.randint(100, 150, (48, 96 // 32), dtype=torch.uint8, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        want = dequantize_fp4(codes, scales.view(torch.float8_e8m0fnu), dtype)
        got = dequantize_fp4_elementwise(codes, scales, dtype)
        assert torch.equal(got, want)


def _ids(config: dict, n: int = 96) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    return torch.randint(2, config["vocab_size"], (1, n), generator=gen)


@torch.no_grad()
def test_fresh_adapters_keep_the_base_logits_bit_for_bit(release: dict) -> None:
    decoded, kept = _pair(release["dir"], torch.bfloat16)
    ids = _ids(release["config"])
    want = decoded(ids).logits
    apply_lora(kept, ALL, seed=1)
    assert torch.equal(kept(ids).logits, want)


def _trained_pair(release: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Both models with the same nonzero adapters on every target (float32)."""
    decoded, kept = _pair(release["dir"], torch.float32)
    for model in (decoded, kept):
        apply_lora(model, ALL, seed=1)
        gen = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if p.requires_grad and name.endswith("B"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return decoded.train(), kept.train()


def test_trained_adapters_same_logits_and_gradients(release: dict) -> None:
    decoded, kept = _trained_pair(release)
    ids = _ids(release["config"])
    grads = []
    for model in (decoded, kept):
        out = model(ids).logits
        out.float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        grads[-1]["logits"] = out.detach()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    # (the logits leave MTP out; a compressor window no row completes gets no gradient)
    main = [n for n in grads[0] if not n.startswith("mtp.")]
    moved = [n for n in main if grads[0][n] is not None and float(grads[0][n].abs().max()) > 0]
    assert len(moved) > 0.9 * len(main)
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_no_decoded_weight_lives_until_the_backward(release: dict, monkeypatch) -> None:
    """No tensor autograd saves in the forward is (a view of) a weight a ReleaseWeight decoded:
    each save is checked against the decodes alive at that moment (the experts' decodes run
    inside a checkpoint, whose saves are recomputed), and the backward decodes again."""
    _, kept = _trained_pair(release)
    decoded: list[weakref.ref] = []
    original = ReleaseWeight.forward

    def recording(self: ReleaseWeight) -> torch.Tensor:
        out = original(self)
        decoded.append(weakref.ref(out))
        return out

    monkeypatch.setattr(ReleaseWeight, "forward", recording)
    hits: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        live = {w().untyped_storage().data_ptr() for w in decoded if w() is not None}
        if t.untyped_storage().data_ptr() in live:
            hits.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kept(_ids(release["config"])).logits
    in_forward = len(decoded)
    assert in_forward >= len(list(release_weights(kept)))
    assert hits == []
    assert all(w() is None for w in decoded)
    out.float().square().mean().backward()
    assert len(decoded) > in_forward  # decoded again for the input gradients


def test_an_unquantized_release_is_refused_naming_the_tensor(release: dict) -> None:
    with pytest.raises(CheckpointFormatError, match=r"'layers\.0\.attn\.wq_a\.weight' is stored "
                       r"as fp32, not FP8 / FP4"):  # fmt: skip
        load_pretrained(release["src"], dtype=torch.float32, progress=False, keep_release=True)
