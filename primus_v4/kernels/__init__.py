"""Kernel seam: one dispatch per hot op (docs/DESIGN.md section 10).

Ops: `sparse_attention` (sliding-window / top-k / pool attention with a sink, driven by key ranges
and indices: torch reference, our Triton kernels, primus-turbo's sparse MLA), `indexer_topk`
(lightning-indexer scores + exact top-k), `compressor_pool` (softmax-gated window pooling),
`grouped_experts` (clamped-SwiGLU experts over expert-sorted rows: reference, torch's grouped_mm,
primus-turbo's grouped GEMM), `release_round` (a weight as the release stores it, decoded:
quantization-aware training; reference and our Triton kernel). Backends needing a package import it
on first use, so importing this package never imports triton or primus_turbo.
"""

from primus_v4.kernels import grouped_experts, turbo
from primus_v4.kernels.compressor_pool import compressor_pool_torch
from primus_v4.kernels.indexer_topk import indexer_topk_torch
from primus_v4.kernels.registry import (
    AUTO_ORDER,
    BACKENDS,
    Choice,
    available_ops,
    choose,
    kernel_table,
    register,
    resolve,
    triton_probe,
)
from primus_v4.kernels.release_round import (
    release_round_torch,
    release_round_triton,
)
from primus_v4.kernels.release_round import triton_refuses as release_round_refuses
from primus_v4.kernels.sparse_attention import (
    sparse_attention_torch,
    sparse_attention_triton,
    triton_refuses,
)

register("sparse_attention", "torch", sparse_attention_torch)
register(
    "sparse_attention",
    "triton",
    sparse_attention_triton,
    probe=triton_probe,
    refuses=triton_refuses,
)
register("indexer_topk", "torch", indexer_topk_torch)
register("compressor_pool", "torch", compressor_pool_torch)
register("release_round", "torch", release_round_torch)
register("release_round", "triton", release_round_triton, probe=triton_probe,
         refuses=release_round_refuses)  # fmt: skip
turbo.register_all()

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "Choice",
    "available_ops",
    "choose",
    "grouped_experts",
    "kernel_table",
    "register",
    "resolve",
]
