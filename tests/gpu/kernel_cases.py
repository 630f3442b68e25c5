"""One small, seeded input case per op of the kernel seam, and the harness that runs an op's
backend on a device/dtype and compares it with the torch reference in float32 on CPU.

Every registered op must have a case here (tests/gpu/test_kernel_coverage.py checks it on CPU),
so a new op cannot ship without its device-vs-reference test.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

import primus_v4.kernels as kernels
from primus_v4.errors import ConfigError

Inputs = tuple[tuple, dict]


@dataclass(frozen=True)
class Case:
    build: Callable[[torch.Generator], Inputs]
    """Float32 CPU inputs (args, kwargs) from a seeded generator."""
    grad_args: tuple[int, ...]
    """Positions in args of the tensors the op differentiates (empty: no autograd)."""
    compare: str = "close"
    """`close`: outputs and grads within tolerance; `topk`: same selected scores (see below)."""


def _sparse_attention(g: torch.Generator) -> Inputs:
    t, h, d, k = 64, 4, 32, 4
    n = t + 16  # window rows + 16 pooled rows appended after them
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    sink = torch.randn(h, generator=g)
    rows = torch.arange(t)
    lo = (rows - 15).clamp(min=0)[:, None]  # sliding window of 16 rows incl. itself
    hi = (rows + 1)[:, None]
    idx = torch.randint(t, n, (t, k), generator=g)
    idx[::3, -1] = -1  # some queries have fewer explicit keys
    kwargs = {"lo_TR": lo, "hi_TR": hi, "idx_TK": idx, "scale": d**-0.5}
    return (q, kv, sink), kwargs


def indexer_scores(q_THD, w_TH, k_PD, scale) -> torch.Tensor:
    """score[t, j] = scale * sum_h w[t, h] * relu(q[t, h] . k[j]), float32 (the op's definition)."""
    s = torch.einsum("thd,pd->thp", q_THD.float(), k_PD.float()).relu()
    return torch.einsum("thp,th->tp", s, w_TH.float()) * scale


def _indexer_topk(g: torch.Generator) -> Inputs:
    t, h, d, p = 64, 4, 16, 40
    q = torch.randn(t, h, d, generator=g)
    w = torch.rand(h, t, generator=g).T.contiguous()
    keys = torch.randn(p, d, generator=g)
    lo = torch.zeros(t, dtype=torch.long)
    hi = (torch.arange(t) * p // t).clamp(min=0)  # early queries see few keys (-1 padding)
    kwargs = {"lo_T": lo, "hi_T": hi, "topk": 8, "chunk": 8, "scale": d**-0.5}
    return (q, w, keys), kwargs


def _compressor_pool(g: torch.Generator) -> Inputs:
    p, m, d = 16, 8, 32
    kv = torch.randn(p, m, d, generator=g)
    gate = torch.randn(p, m, d, generator=g)
    gate[0, : m // 2] = float("-inf")  # a sample's first overlap window lacks its predecessor
    return (kv, gate), {}


def _grouped_experts(g: torch.Generator) -> Inputs:
    d, f = 32, 16
    counts = [10, 0, 20, 18]  # an expert with no rows must work too
    x = torch.randn(sum(counts), d, generator=g)
    # std 0.5 puts some gate/up activations past the clamp limit, so the clamp is exercised.
    w_gate_up = 0.5 * torch.randn(len(counts), 2 * f, d, generator=g)
    w_down = 0.2 * torch.randn(len(counts), d, f, generator=g)
    return (x, counts, w_gate_up, w_down), {"limit": 10.0}


def _release_round(g: torch.Generator) -> Inputs:
    # bf16-exact values: the bf16 and float32 runs round the same inputs, so any error is real;
    # 96 x 160 leaves partial 32 x 32 blocks on both edges
    x = (torch.randn(96, 160, generator=g) * torch.logspace(-2, 2, 160)).bfloat16().float()
    return (x,), {"kind": "fp8", "block_rows": 32, "block_cols": 32}


CASES: dict[str, Case] = {
    "sparse_attention": Case(_sparse_attention, grad_args=(0, 1, 2)),
    "indexer_topk": Case(_indexer_topk, grad_args=(), compare="topk"),
    "compressor_pool": Case(_compressor_pool, grad_args=(0, 1)),
    "grouped_experts": Case(_grouped_experts, grad_args=(0, 2, 3)),
    "release_round": Case(_release_round, grad_args=()),
}


def registered_ops() -> list[str]:
    """Every op of the seam: import each kernels module first, since modules register on import."""
    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")
    return kernels.available_ops()


def runnable_backends(op: str) -> list[str]:
    """Backends that can run `op` here (the registry says why the others cannot)."""
    registered_ops()
    names = []
    for backend in kernels.BACKENDS:
        try:
            kernels.resolve(op, backend)
        except ConfigError:
            continue
        names.append(backend)
    return names


def _to(x, device: torch.device, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(device=device, dtype=dtype)
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return x


def run_case(op: str, backend: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Output and input grads (float32, CPU) of `backend`'s `op` on seeded inputs."""
    registered_ops()  # ops living outside kernels/__init__ register on import
    case = CASES[op]
    args, kwargs = case.build(torch.Generator().manual_seed(seed))
    args = tuple(_to(a, device, dtype) for a in args)
    kwargs = {k: _to(v, device, dtype) for k, v in kwargs.items()}
    for i in case.grad_args:
        args[i].requires_grad_(True)
    out = kernels.resolve(op, backend)(*args, **kwargs)
    grads: list[torch.Tensor] = []
    if case.grad_args:
        # A fixed random cotangent weighs every output element (a plain sum hides sign errors).
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
        out.backward(cot.to(device=device, dtype=out.dtype))
        grads = [args[i].grad.float().cpu() for i in case.grad_args]
    inputs = tuple(a.detach().float().cpu() if isinstance(a, torch.Tensor) else a for a in args)
    return out.detach().cpu(), grads, inputs, kwargs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: one number per tensor, scale-free."""
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    scale = want[finite].abs().max().clamp(min=1e-6) if finite.any() else torch.tensor(1.0)
    return float(((got - want)[finite]).abs().max() / scale) if finite.any() else 0.0


def compare(op: str, backend: str, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Errors of `backend` on (device, dtype) vs the float32 CPU torch reference, by tensor name."""
    out, grads, inputs, kwargs = run_case(op, backend, device, dtype)
    ref_out, ref_grads, _, _ = run_case(op, "torch", torch.device("cpu"), torch.float32)
    if CASES[op].compare == "topk":
        return {"topk_scores": _topk_error(out, ref_out, inputs, kwargs)}
    errors = {"out": relative_error(out, ref_out)}
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        errors[f"grad{CASES[op].grad_args[i]}"] = relative_error(g, r)
    return errors


def _topk_error(idx, ref_idx, inputs, kwargs) -> float:
    """Indices may differ between near-tied keys under bf16, so compare what matters: the
    float32 scores of the selected keys (sorted) and which slots are empty (-1) must agree."""
    if not torch.equal(idx < 0, ref_idx < 0):
        return float("inf")
    q, w, keys = inputs
    scores = indexer_scores(q, w, keys, kwargs["scale"])
    picked = scores.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, 0.0)
    ref_picked = scores.gather(1, ref_idx.clamp(min=0)).masked_fill(ref_idx < 0, 0.0)
    got = picked.sort(dim=1, descending=True).values
    want = ref_picked.sort(dim=1, descending=True).values
    return relative_error(got, want)
