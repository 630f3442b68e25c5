"""What each backend of an op saves for backward beyond the torch reference: the memory plan's
per-backend term (models/common/activations.py), known by construction of each autograd function.

Legend: T = query rows, H x D = heads x head dim, N = key-buffer rows, W = a query's candidates
(window + visible pool + top-k), b = bytes of the activation dtype.

sparse_attention, per layer:
- torch (the reference): q, kv and the ranges / indices it is handed (the caller's tensors,
  already counted with the layer) and the float32 row log-sum-exp [T, H]: nothing beyond.
- triton: the same, plus its output [T, H, D] (the backward's delta = do . out).
- primus_turbo: `SparseMLAFunc` saves q, kv, o, lse, topk_indices, sink as it is called: the
  adapter's padded copies q [T, H, 576] and kv [N, 576], o [T, H, 512], and the candidates as
  int32 [T, W] padded to a multiple of 64 (kernels/turbo.py).
grouped_experts: every backend saves the expert-sorted rows, the [M, 2F] gate/up product and the
[M, F] SwiGLU output (the reference per expert, grouped_mm and primus_turbo per call): the same
bytes, so nothing beyond.
"""

from __future__ import annotations

import math

from primus_v4.errors import ConfigError
from primus_v4.kernels.registry import (
    AUTO_ORDER,
    BACKENDS,
    ENV_VAR,
    TRITON_MAX_HEAD_DIM,
    choose,
    has_gpu,
    requested,
)
from primus_v4.kernels.turbo import INDEX_MULTIPLE, MLA_QK_DIM, MLA_V_DIM

ATTENTION = "sparse_attention"


def attention_beyond_reference(
    backend: str, *, rows: int, keys: int, heads: int, head_dim: int, candidates: int, b: int
) -> float:
    """Bytes `backend`'s sparse attention saves for one layer's call beyond the reference."""
    if backend == "torch":
        return 0.0
    if backend == "triton":
        return float(rows * heads * head_dim * b)
    if backend == "primus_turbo":
        width = max(INDEX_MULTIPLE, math.ceil(candidates / INDEX_MULTIPLE) * INDEX_MULTIPLE)
        q_and_o = rows * heads * (MLA_QK_DIM + MLA_V_DIM) * b
        return float(q_and_o + rows * 4 * width + keys * MLA_QK_DIM * b)
    raise ValueError(f"unknown kernel backend {backend!r}; known: {BACKENDS}")


def _takes(backend: str, *, heads: int, head_dim: int, b: int) -> bool:
    """Whether `backend` takes a layer's calls of this shape and dtype (the refusals of
    kernels/turbo.py and kernels/triton_sparse_attention.py that depend on neither data nor
    device)."""
    if backend == "primus_turbo":
        return b == 2 and head_dim == MLA_V_DIM and heads % 32 == 0
    if backend == "triton":
        return head_dim <= TRITON_MAX_HEAD_DIM
    return backend == "torch"


def _largest(names: tuple[str, ...], **shape: int) -> str:
    """Of the backends in `names` that take the shape, the one that saves the most (the order
    holds at every shape: turbo's padded q and o exceed Triton's o, which exceeds nothing)."""
    rank = {"torch": 0, "triton": 1, "primus_turbo": 2}
    return max((n for n in names if _takes(n, **shape)), key=rank.__getitem__, default="torch")


def planned_attention_backend(
    *, for_accelerator: bool, heads: int, head_dim: int, b: int
) -> tuple[str, str]:
    """(backend, why) the memory plan counts for sparse attention of `heads` x `head_dim` in
    `b`-byte activations. An explicit backend (`PRIMUS_V4_KERNEL_BACKEND`) is planned as asked,
    without probing this machine (a dry run plans for another). Under auto, which may fall back
    per call, the plan counts the largest saved set among the backends auto may run on this
    shape: on this machine's accelerator the ones its probes accept; planning for an
    accelerator from elsewhere (a dry run's --device-memory) every one of auto's GPU order,
    since the probes there (the image's primus_turbo, triton) cannot run here."""
    shape = {"heads": heads, "head_dim": head_dim, "b": b}
    wanted, source = requested(ATTENTION)
    if wanted not in ("auto", *BACKENDS) or wanted == "grouped_mm":
        raise ConfigError(
            f"{source} asks for kernel backend {wanted!r} for op {ATTENTION!r}; use one of "
            "auto, torch, triton, primus_turbo"
        )
    if wanted != "auto":
        return wanted, f"{source} asks for it"
    if has_gpu():
        order = choose(ATTENTION).order
        return _largest(order, **shape), f"the largest saved set auto may run here ({order})"
    if for_accelerator:
        name = _largest(AUTO_ORDER, **shape)
        hint = f"; {ENV_VAR}={ATTENTION}=triton plans Triton's" if name == "primus_turbo" else ""
        return name, f"the largest saved set auto may run on a GPU{hint}"
    return "torch", "auto runs the torch reference on CPU"
