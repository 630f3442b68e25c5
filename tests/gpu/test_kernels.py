"""Every dispatched backend of every kernel-seam op, on the device, against the torch reference
computed in float32 on CPU: outputs and input gradients, in bfloat16 and float32. A backend that
cannot run here, or refuses a case (dtype, shape), is skipped with the registry's reason."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CASES, compare, relative_error, runnable_backends

from primus_v4 import kernels
from primus_v4.errors import ConfigError
from primus_v4.kernels import BACKENDS

pytestmark = pytest.mark.gpu

# bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4%); after the softmax and matmul
# reductions of these small cases the error stays near 1% of the output's scale: 2e-2 is 2x
# margin. Gradients chain two bf16 products, hence 3e-2.
BF16_TOL = {"out": 2e-2, "grad": 3e-2, "topk_scores": 2e-2}
# float32 on the device differs from CPU only by reduction order (~1e-6 relative); 1e-4 also
# absorbs a backend that accumulates in a different but still float32 order.
FP32_TOL = {"out": 1e-4, "grad": 1e-4, "topk_scores": 1e-4}


def _tolerance(name: str, table: dict[str, float]) -> float:
    return table["grad"] if name.startswith("grad") else table[name]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(CASES))
def test_backend_matches_reference(op, backend, dtype, device, arch):
    if backend not in runnable_backends(op):
        pytest.skip(f"{backend} cannot run {op} on {arch} (see `primus-v4 inspect kernels`)")
    try:
        errors = compare(op, backend, device, dtype)
    except ConfigError as exc:  # the backend refuses this call: bf16-only kernels, shapes
        pytest.skip(str(exc))
    table = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    too_big = {k: v for k, v in errors.items() if not v <= _tolerance(k, table)}
    assert not too_big, f"{op}/{backend} on {arch} in {dtype}: errors {errors} over {table}"


def test_arch_is_detected(arch):
    # The supported AMD targets, or an NVIDIA part (sm_XY) where the torch kernels also run.
    assert arch in ("gfx942", "gfx950") or arch.startswith(("sm_", "gfx")), arch


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_at_the_mla_shape(backend, device, arch):
    """The Flash head shape (512 channels, 32 of its 64 heads), a window of 128 and top-k 64,
    bf16, on every backend that runs it: primus_turbo's sparse MLA takes only this shape."""
    if backend not in runnable_backends("sparse_attention"):
        pytest.skip(f"{backend} cannot run sparse_attention on {arch}")
    g = torch.Generator().manual_seed(0)
    t, h, d, w, k = 256, 32, 512, 128, 64
    rows = torch.arange(t)
    lo, hi = (rows - (w - 1)).clamp(min=0)[:, None], (rows + 1)[:, None]
    idx = torch.stack([t + torch.randperm(t, generator=g)[:k] for _ in range(t)])
    idx[::5, -7:] = -1
    q, kv, sink = (
        torch.randn(t, h, d, generator=g),
        torch.randn(2 * t, d, generator=g),
        torch.randn(h, generator=g),
    )
    kw = {"lo_TR": lo, "hi_TR": hi, "idx_TK": idx, "scale": d**-0.5}
    cot = torch.randn(t, h, d, generator=g)
    results = []
    for name, dev, dtype in (
        (backend, device, torch.bfloat16),
        ("torch", torch.device("cpu"), torch.float32),
    ):
        ins = [x.to(dev, dtype).requires_grad_(True) for x in (q, kv, sink)]
        kw_dev = {n: v.to(dev) if isinstance(v, torch.Tensor) else v for n, v in kw.items()}
        try:
            out = kernels.resolve("sparse_attention", name)(*ins, **kw_dev)
        except ConfigError as exc:
            pytest.skip(str(exc))
        out.backward(cot.to(dev, out.dtype))
        results.append([x.detach().float().cpu() for x in (out, *(i.grad for i in ins))])
    errors = [relative_error(a, b) for a, b in zip(*results, strict=True)]
    # bf16 inputs and outputs over 192 candidates: as the small cases' bound (BF16_TOL)
    assert max(errors[:1]) <= BF16_TOL["out"] and max(errors[1:]) <= BF16_TOL["grad"], errors
