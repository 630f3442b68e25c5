"""The kernel seam's `release_round` op (quantization-aware training): its torch reference and our
Triton kernel each equal the release writer's quantizer followed by the loader's decoder
(checkpoint_formats/fp8_fp4.py) bit for bit, -0.0 included, on every release block shape (FP8 128 x
128 of DeepSeek-V4, FP8 32 x 32 of V4.1, FP4 one scale per 32 inputs, FP8 per 32 of an Engram row)
and the edges: blocks hanging over the weight's edges, all-zero blocks, blocks at the FP8 / FP4
limit, rounding ties, subnormal values and scales, huge values. In Triton's interpreter on CPU (the
root conftest sets TRITON_INTERPRET=1 without an accelerator), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (the test extra installs it: a missing triton fails, never skips)

from primus_v4 import kernels
from primus_v4.checkpoint_formats.fp8_fp4 import QuantFormat, dequantize, quantize

FORMATS = {
    "fp8-128x128": ("fp8", 128, 128),
    "fp8-32x32": ("fp8", 32, 32),
    "fp4-1x32": ("fp4", 1, 32),
    "fp8-1x32": ("fp8", 1, 32),
}


def _writer(x: torch.Tensor, *, kind: str, block_rows: int, block_cols: int) -> torch.Tensor:
    """What the release writer stores, as the loader decodes it (float32)."""
    fmt = QuantFormat(name="t", kind=kind, block_rows=block_rows, block_cols=block_cols)
    q, scale = quantize(x.float(), fmt=fmt)
    return dequantize(q, scale, torch.float32, fmt=fmt)


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _edges(kind: str, n: int, k: int) -> torch.Tensor:
    """[n, k] float32 with the edge cases in its first rows (per 32-column block)."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, k)[None, :]
    limit = 448.0 if kind == "fp8" else 6.0
    x[0, :32] = 0.0  # an all-zero block (row blocks of 1 x 32)
    x[1, :32] = limit * 2.0**-4  # at the limit
    x[1, 0] = -limit * 2.0**-4
    x[2, :32] = torch.randn(32, generator=gen) * 1e-41  # float32 subnormals: subnormal scales
    x[3, :32] = 3e37 * torch.randn(32, generator=gen)  # huge: scale 2^120 and up
    # ties: with amax = limit the scale is 1, so these sit exactly between two codes
    ties = (
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
        if kind == "fp4"
        else [0.0009765625, 0.0029296875, 1.0625, 1.1875, 17.0, 19.0, 416.0, 432.0]
    )
    x[4, :32] = torch.tensor(ties).repeat(32 // len(ties) + 1)[:32]
    x[4, 31] = limit
    x[5, :32] = -x[4, :32]
    x[6, :32] = -1e-45  # rounds to -0.0
    x[6, 0] = 1.0
    return x


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(256, 256), (200, 96), (33, 64)])
def test_each_backend_is_the_release_writer_bit_for_bit(backend, fmt, shape, device) -> None:
    kind, br, bc = FORMATS[fmt]
    x = _edges(kind, *shape)
    blocks = {"kind": kind, "block_rows": br, "block_cols": bc}
    want = _writer(x, **blocks)
    got = kernels.resolve("release_round", backend)(x.to(device), **blocks).cpu()
    assert got.dtype == torch.float32 and got.shape == x.shape
    differ = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert not len(differ), f"{len(differ)} values differ, first at {differ[0].tolist()}"
    assert torch.signbit(got[6, 1]) and got[6, 1] == 0  # -0.0 kept as the code keeps it
    assert not got[0, :32].any()


def test_bf16_input_and_non_finite_blocks(device) -> None:
    x = torch.randn(64, 64).to(torch.bfloat16)
    blocks = {"kind": "fp8", "block_rows": 32, "block_cols": 32}
    want = _writer(x, **blocks)
    for backend in ("torch", "triton"):
        op = kernels.resolve("release_round", backend)
        assert torch.equal(op(x.to(device), **blocks).cpu(), want)
    x[5, 7] = float("nan")
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="NaN or inf"):
            kernels.resolve("release_round", backend)(x.to(device), **blocks)


def test_auto_takes_the_reference_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("auto picks the Triton kernel where a GPU is")
    assert kernels.choose("release_round").order == ("torch",)
    assert "triton" in kernels.choose("release_round", "triton").order


def test_a_models_release_rounding_is_the_same_through_either_backend(monkeypatch) -> None:
    """Quantization-aware training's rounding of one layer's weights of the tiny V4.1 release
    (FP8 32 x 32, FP4 experts in our [E, 2F, D] / [E, D, F] layouts, grouped wo_a) with the op
    resolved to the Triton kernel equals the one through the reference."""
    from pathlib import Path

    from primus_v4 import load_pretrained
    from primus_v4.models import spec_of

    release = Path(__file__).resolve().parents[3] / "tests/fixtures/dsv41_dspark_golden/checkpoint"
    model = load_pretrained(release, dtype=torch.float32, progress=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # off the release's grid
    rounded = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PRIMUS_V4_KERNEL_BACKEND", f"release_round={backend}")
        quant = spec_of(model).release.release_rounding(model, model.cfg)
        quant.weights = [w for w in quant.weights if w.name.startswith("layers.1.")]  # time
        with quant.applied():
            rounded[backend] = {w.name: w.param.detach().clone() for w in quant.weights}
    assert {"layers.1.moe.w_gate_up", "layers.1.attn.wo_a"} <= set(rounded["torch"])
    for name, want in rounded["torch"].items():
        assert torch.equal(rounded["triton"][name].view(torch.int32), want.view(torch.int32)), name
