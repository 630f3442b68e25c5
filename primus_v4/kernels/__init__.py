"""Kernel seam: one dispatch per hot op (torch reference always; primus_turbo when it can run).

Ops registered here: `sparse_attention` (sliding-window / top-k / pool attention with a sink,
driven by key ranges and indices), `indexer_topk` (lightning-indexer scores + exact chunked
top-k), `compressor_pool` (softmax-gated window pooling). Other modules register their own ops
(e.g. grouped experts) with `register`. No primus_turbo kernel matches these index-driven
signatures yet, so auto selects torch and logs why.
"""

from primus_v4.kernels.compressor_pool import compressor_pool_torch
from primus_v4.kernels.indexer_topk import indexer_topk_torch
from primus_v4.kernels.registry import BACKENDS, available_ops, register, resolve
from primus_v4.kernels.sparse_attention import sparse_attention_torch

register("sparse_attention", "torch", sparse_attention_torch)
register("indexer_topk", "torch", indexer_topk_torch)
register("compressor_pool", "torch", compressor_pool_torch)

__all__ = ["BACKENDS", "available_ops", "register", "resolve"]
