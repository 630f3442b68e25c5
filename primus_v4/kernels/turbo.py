"""primus-turbo backends (AMD-AGI/Primus-Turbo, shipped in the rocm/primus image): the grouped
GEMM for `grouped_experts` and the DeepSeek-V4 sparse MLA for `sparse_attention`.

Legend: T = query rows, H = heads, D = head dim, N = key-buffer rows, R = key ranges per query,
K = explicit indices per query, W = candidates per query after conversion, M = expert rows.

Written against primus_turbo's public ops (read from the repository, not guessed):
- `primus_turbo.pytorch.ops.grouped_gemm(a, b, group_lens, group_offs=None, trans_b=False,
  num_cu=None, ...)`: a [M, K] rows sorted by group, b [G, N, K] with trans_b=True (our
  [E, out, in] weights as they are), group_lens [G] int64; bf16 / fp16. Autograd is its own.
  `grouped_gemm_fp8(a, b, group_lens, ..., trans_b=True, config=Float8QuantConfig(...))` is the
  FP8 option (`PRIMUS_V4_TURBO_FP8` = tensorwise | rowwise | blockwise; unset = bf16), which
  quantizes both operands per call and so is not the reference's numbers.
- `primus_turbo.pytorch.ops.attention.sparse_mla_func(q, kv, topk_indices, attn_sink=None,
  kv_lora_rank=512, scale=None)`: q [T, H, 576], kv [N, 576] (K = V = the first kv_lora_rank
  channels), topk_indices [T, W] int32 (-1 = none), attn_sink [H] float32 (value 0 in the
  softmax, as ours); its kernels take bf16, 576 channels, H % 32 == 0 and W % 32 == 0. Our
  op is the same softmax once (a) the key ranges become explicit indices (`ranges_to_indices`,
  plain torch) and (b) our 512 channels go first and 64 zero channels follow: the zeros add
  nothing to q . k and the value is kv[:, :512], exactly ours. Cost of the adapter: the padded
  q and kv copies (+12.5%) and ranges materialized as [T, W] int32.
Not wired: `csa_attention` / `hca_attention` (branch dev/yaoc/dpskv4-attn, in no release) take
padded [B, H, S, D] batches whose sliding window runs over the whole row, so a packed row would
attend across samples; HCA's pool visibility is a dense [S, P] additive mask.

Every probe checks the installed version and the function's signature before auto may pick it;
nothing here imports primus_turbo until a probe or a call needs it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from primus_v4.environment import TURBO_FP8_ENV
from primus_v4.kernels.grouped_experts import OP_NAME as GROUPED_EXPERTS
from primus_v4.kernels.grouped_experts import clamped_swiglu
from primus_v4.kernels.registry import has_gpu, register, turbo_importable

FP8_ENV = TURBO_FP8_ENV
GROUPED_GEMM = ("primus_turbo.pytorch.ops", "grouped_gemm", (0, 3, 0))
GROUPED_GEMM_ARGS = ("a", "b", "group_lens", "group_offs", "trans_b")
# sparse_mla_func came after v0.4.0 (a setuptools-scm build of that tree reports 0.4.1.devN).
SPARSE_MLA = ("primus_turbo.pytorch.ops.attention", "sparse_mla_func", (0, 4, 1))
SPARSE_MLA_ARGS = ("q", "kv", "topk_indices", "attn_sink", "kv_lora_rank", "scale")
MLA_QK_DIM, MLA_V_DIM = 576, 512  # 512 latent + 64 rope channels; values are the first 512
INDEX_MULTIPLE = 64  # the interface pads top-k to a multiple of 64 (its kernels need 32)


def installed_version() -> tuple[int, ...] | None:
    """(major, minor, patch) of the installed primus-turbo distribution, None if unknown."""
    for dist in ("primus-turbo", "primus_turbo"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        parts = re.findall(r"\d+", text)[:3]
        return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))
    return None


@functools.cache
def _lookup(module: str, name: str) -> tuple[Callable | None, str | None]:
    try:
        return getattr(importlib.import_module(module), name), None
    except (ImportError, AttributeError, RuntimeError, OSError) as exc:
        return None, f"{module}.{name} is not importable ({type(exc).__name__}: {exc})"


def _probe(target: tuple[str, str, tuple[int, ...]], args: tuple[str, ...]) -> str | None:
    """None when primus_turbo's `module.name` exists here with the arguments we call it with."""
    reason = turbo_importable()
    if reason is not None:
        return reason
    if not has_gpu() or torch.version.hip is None:
        return "primus_turbo's kernels run on ROCm GPUs only"
    module, name, minimum = target
    version = installed_version()
    if version is not None and version < minimum:
        need = ".".join(map(str, minimum))
        return f"primus-turbo {'.'.join(map(str, version))} is older than {need} ({name})"
    fn, reason = _lookup(module, name)
    if fn is None:
        return reason
    params = inspect.signature(fn).parameters
    missing = [a for a in args if a not in params]
    if missing:
        return f"{module}.{name} has no argument(s) {missing}: not the API this adapter targets"
    return None


def _on_rocm(t: torch.Tensor) -> str | None:
    if t.device.type != "cuda" or torch.version.hip is None:
        return f"tensors on {t.device.type}; primus_turbo runs on ROCm devices"
    return None


# ---- grouped experts -------------------------------------------------------------------------


def _fp8_config() -> Any | None:
    mode = os.environ.get(FP8_ENV, "").strip().lower()
    if mode in ("", "0", "off", "bf16"):
        return None
    lp = importlib.import_module("primus_turbo.pytorch.core.low_precision")
    granularity = {"tensorwise": "TENSORWISE", "rowwise": "ROWWISE", "blockwise": "BLOCKWISE"}
    if mode not in granularity:
        raise ValueError(f"{FP8_ENV}={mode!r}: use tensorwise, rowwise, blockwise or unset")
    block = 128 if mode == "blockwise" else None  # the release's 128 x 128 blocks
    return lp.Float8QuantConfig(
        granularity=getattr(lp.ScalingGranularity, granularity[mode]), block_size=block
    )


def _gemm(a: torch.Tensor, b: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    config = _fp8_config()
    if config is None:
        fn, _ = _lookup(*GROUPED_GEMM[:2])
        assert fn is not None  # the probe found it
        return fn(a, b, lens, trans_b=True)
    fp8, reason = _lookup("primus_turbo.pytorch.ops", "grouped_gemm_fp8")
    if fp8 is None:
        raise RuntimeError(reason)
    return fp8(a, b, lens, trans_b=True, config=config)


def grouped_experts_turbo(
    x_MD: torch.Tensor,
    tokens_per_expert_E: list[int],
    w_gate_up_EF2D: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    limit: float,
    lora: Any = None,
) -> torch.Tensor:
    """The reference's contract through primus_turbo's grouped GEMM (trans_b: our weights are
    its [G, N, K]); LoRA calls are refused (`grouped_gemm_refuses`) and go elsewhere."""
    assert lora is None, "grouped_gemm_refuses turns LoRA calls away"
    lens_E = torch.tensor(tokens_per_expert_E, dtype=torch.int64, device=x_MD.device)
    h_MF2 = _gemm(x_MD, w_gate_up_EF2D, lens_E)
    return _gemm(clamped_swiglu(h_MF2, limit), w_down_EDF, lens_E)


def grouped_gemm_refuses(
    x_MD, tokens_per_expert_E, w_gate_up_EF2D, w_down_EDF, *, lora=None, **_
) -> str | None:
    del tokens_per_expert_E
    if lora is not None:
        return "LoRA adapters are not wired into primus_turbo's grouped GEMM"
    if x_MD.dtype not in (torch.bfloat16, torch.float16):
        return f"{x_MD.dtype}: primus_turbo's grouped GEMM takes bf16 / fp16"
    if not (w_gate_up_EF2D.dtype == w_down_EDF.dtype == x_MD.dtype):
        return "mixed dtypes"
    if not (w_gate_up_EF2D.is_contiguous() and w_down_EDF.is_contiguous()):
        return "expert weights are not contiguous [E, out, in]"
    return _on_rocm(x_MD)


# ---- sparse attention ------------------------------------------------------------------------


def ranges_to_indices(
    lo_TR: torch.Tensor,
    hi_TR: torch.Tensor,
    idx_TK: torch.Tensor | None,
    *,
    multiple: int = INDEX_MULTIPLE,
) -> torch.Tensor:
    """Our candidates as explicit key rows [T, W] int32, -1 padded (primus_turbo's top-k index
    format): each range r widens to its widest query's width (shorter ones padded with -1),
    then the explicit indices, then -1 up to a multiple of `multiple`. The set of valid rows of
    every query is exactly its candidates, so one softmax over them is our op."""
    t = lo_TR.shape[0]
    cols = []
    for r in range(lo_TR.shape[1]):
        lo, hi = lo_TR[:, r : r + 1].long(), hi_TR[:, r : r + 1].long()
        width = int((hi - lo).max().clamp(min=0)) if t else 0
        c = lo + torch.arange(width, device=lo.device)
        cols.append(torch.where(c < hi, c, -1))
    if idx_TK is not None:
        cols.append(torch.where(idx_TK >= 0, idx_TK.long(), -1))
    out = torch.cat(cols, 1) if cols else lo_TR.new_empty((t, 0), dtype=torch.long)
    width = max(multiple, -(-out.shape[1] // multiple) * multiple)  # at least one block
    out = F.pad(out, (0, width - out.shape[1]), value=-1)
    return out.to(torch.int32).contiguous()


def sparse_attention_turbo(
    q_THD: torch.Tensor,
    kv_ND: torch.Tensor,
    sink_H: torch.Tensor | None,
    *,
    lo_TR: torch.Tensor,
    hi_TR: torch.Tensor,
    idx_TK: torch.Tensor | None = None,
    scale: float,
) -> torch.Tensor:
    """Our sparse attention through primus_turbo's sparse MLA (see the module docstring)."""
    fn, reason = _lookup(*SPARSE_MLA[:2])
    if fn is None:
        raise RuntimeError(reason)
    pad = MLA_QK_DIM - q_THD.shape[-1]
    q = F.pad(q_THD, (0, pad)).contiguous()
    kv = F.pad(kv_ND, (0, pad)).contiguous()
    topk = ranges_to_indices(lo_TR, hi_TR, idx_TK)
    sink = sink_H.float() if sink_H is not None else None  # the interface takes float32 sinks
    return fn(q, kv, topk, sink, kv_lora_rank=q_THD.shape[-1], scale=scale)


def sparse_mla_refuses(q_THD, kv_ND, sink_H, **_) -> str | None:
    del sink_H
    t, h, d = q_THD.shape
    if q_THD.dtype != torch.bfloat16 or kv_ND.dtype != torch.bfloat16:
        return f"{q_THD.dtype}: primus_turbo's sparse MLA takes bf16"
    if d != MLA_V_DIM:
        return f"head dim {d}: its kernels take {MLA_V_DIM} value channels (+64 -> {MLA_QK_DIM})"
    if h % 32:
        return f"{h} heads: its kernels take a multiple of 32"
    if kv_ND.shape[0] < t:
        return f"key buffer of {kv_ND.shape[0]} rows < {t} queries (its forward asserts it)"
    return _on_rocm(q_THD)


def register_all() -> None:
    register(
        GROUPED_EXPERTS,
        "primus_turbo",
        grouped_experts_turbo,
        probe=lambda: _probe(GROUPED_GEMM, GROUPED_GEMM_ARGS),
        refuses=grouped_gemm_refuses,
    )
    register(
        "sparse_attention",
        "primus_turbo",
        sparse_attention_turbo,
        probe=lambda: _probe(SPARSE_MLA, SPARSE_MLA_ARGS),
        refuses=sparse_mla_refuses,
    )
