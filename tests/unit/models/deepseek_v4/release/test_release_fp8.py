"""FP8 + FP4 checkpoints end to end: an fp8 export stores the release's layout, reloads within
the stated quantization bounds, and a quantized checkpoint loads and runs.

Stated error of an fp8 export (checkpoint_formats/fp8_fp4.py), per element w of a tensor:
  fp8 kind (e4m3, 128x128 ue8m0 blocks)   |w' - w| <= 2^-4 |w| + 2^-10 scale, scale <= amax/224
  fp4 kind (e2m1, ue8m0 per 32 inputs)     |w' - w| <= |w| / 4 + scale / 4,   scale <= amax/3
  bf16 kind                                 bf16 rounding: |w' - w| <= 2^-8 |w|
  fp32 / int64 kinds                        exact
(3 mantissa bits round to within 2^-4 relative; 1 mantissa bit to within 1/4 on [1, 6] x scale;
below the smallest normal the grid step is absolute: 2^-9 x scale for e4m3, 0.5 x scale e2m1.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp_reference import decode_e2m1, decode_e4m3, decode_e8m0
from release_checkpoint import random_release_tensors, release_config, write_checkpoint

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.checkpoint_formats.fp8_fp4 import fp4_error_bound, fp8_error_bound
from primus_v4.checkpoint_formats.sharded import CheckpointReader
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter


@pytest.fixture(scope="module", params=["a"])
def exported(request, tmp_path_factory: pytest.TempPathFactory) -> dict:
    config = release_config(request.param)
    tensors = random_release_tensors(config, seed=5)
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    src = write_checkpoint(root / "src", config, tensors)
    model = load_pretrained(src, dtype=torch.float32, progress=False)
    save_pretrained(model, root / "fp8", dtype="fp8", progress=False)
    cfg = adapter.config_from_release(config)
    kinds = {n: r.kind for n, r in adapter.release_tensors(cfg).items()}
    return {"config": config, "tensors": tensors, "out": root / "fp8", "kinds": kinds}


def test_fp8_export_stores_the_release_layout(exported: dict) -> None:
    written = json.loads((exported["out"] / "config.json").read_text())
    assert written["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
    }  # fmt: skip
    stored = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8, "bf16": torch.bfloat16,
              "fp32": torch.float32, "int64": torch.int64}  # fmt: skip
    with CheckpointReader(exported["out"]) as reader:
        assert set(reader.names()) == set(exported["tensors"])
        for name, kind in exported["kinds"].items():
            assert reader.dtype(name) == stored[kind], name
            if kind in ("fp8", "fp4"):
                assert name.removesuffix(".weight") + ".scale" in reader.stored_names(), name


def test_fp8_export_reloads_within_the_stated_bounds(exported: dict) -> None:
    with CheckpointReader(exported["out"]) as reader:
        for name, w in exported["tensors"].items():
            kind = exported["kinds"][name]
            back = reader.read(name, torch.float32 if kind != "int64" else None)
            if kind == "fp8":
                bound = fp8_error_bound(w)
            elif kind == "fp4":
                bound = fp4_error_bound(w)
            elif kind == "bf16":
                bound = w.abs() * 2.0**-8
            else:
                assert torch.equal(back, w), name
                continue
            assert bool(((back - w).abs() <= bound).all()), name


def _independent_dequant(directory: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of an FP8/FP4 release decoded by the test's own bit-level decoders."""
    from safetensors import safe_open

    raw: dict[str, torch.Tensor] = {}
    for shard in directory.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    e4m3 = torch.tensor([decode_e4m3(b) for b in range(256)], dtype=torch.float64)
    e2m1 = torch.tensor([decode_e2m1(c) for c in range(16)], dtype=torch.float64)
    e8m0 = torch.tensor([decode_e8m0(b) for b in range(256)], dtype=torch.float64)
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            out[name] = t.float() if t.is_floating_point() else t
            continue
        s = e8m0[scale.view(torch.uint8).long()]
        if t.dtype == torch.float8_e4m3fn:
            n, k = t.shape
            s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            out[name] = (e4m3[t.view(torch.uint8).long()] * s).float()
        else:
            u = t.view(torch.uint8).long()
            v = torch.stack([e2m1[u & 15], e2m1[u >> 4]], dim=-1).flatten(1)  # low nibble first
            out[name] = (v * s.repeat_interleave(32, 1)).float()
    return out


@torch.no_grad()
def test_quantized_checkpoint_loads_and_runs(exported: dict, tmp_path: Path) -> None:
    """Ours from the FP8/FP4 files == ours from their independently dequantized values (same
    weights bit for bit, so the same logits). The distance to the unquantized model's logits is
    not asserted: on random tiny weights the bounded weight error flips discrete choices (router
    top-k, indexer top-k), so it is not small; the per-tensor bounds above are the contract."""
    quantized = load_pretrained(exported["out"], dtype=torch.float32,
                                                progress=False).eval()  # fmt: skip
    plain = write_checkpoint(tmp_path / "deq", exported["config"],
                             _independent_dequant(exported["out"]))  # fmt: skip
    reference = load_pretrained(plain, dtype=torch.float32, progress=False).eval()
    ids = torch.randint(2, exported["config"]["vocab_size"], (1, 200),
                        generator=torch.Generator().manual_seed(3))  # fmt: skip
    got = quantized(ids).logits
    assert torch.isfinite(got).all()
    assert torch.equal(got, reference(ids).logits)


def test_fp8_export_of_a_geometry_fp4_cannot_hold_names_the_tensor(tmp_path: Path) -> None:
    config = release_config("b")  # hidden 48: w1 has 48 inputs, FP4 needs multiples of 32
    src = write_checkpoint(tmp_path / "src", config, random_release_tensors(config, seed=1))
    model = load_pretrained(src, dtype=torch.float32, progress=False)
    named = r"'layers\.0\.ffn\.experts\.0\.w1\.weight' \[\d+, 48\]: FP4 needs"
    with pytest.raises(ValueError, match=named):
        save_pretrained(model, tmp_path / "out", dtype="fp8", progress=False)
    assert not (tmp_path / "out").exists()
