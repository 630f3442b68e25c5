"""Every dispatched backend of every kernel-seam op, on the device, against the torch reference
computed in float32 on CPU: outputs and input gradients, in bfloat16 and float32."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CASES, compare, runnable_backends

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
        pytest.skip(f"{backend} cannot run {op} on {arch} (see the kernel registry's log)")
    if dtype == torch.float32 and backend != "torch":
        # Fused backends are bf16 kernels; their float32 path, if any, is the torch one.
        pytest.skip(f"{backend} is compared in bf16 only")
    errors = compare(op, backend, device, dtype)
    table = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    too_big = {k: v for k, v in errors.items() if not v <= _tolerance(k, table)}
    assert not too_big, f"{op}/{backend} on {arch} in {dtype}: errors {errors} over {table}"


def test_arch_is_detected(arch):
    # The supported AMD targets, or an NVIDIA part (sm_XY) where the torch kernels also run.
    assert arch in ("gfx942", "gfx950") or arch.startswith(("sm_", "gfx")), arch
