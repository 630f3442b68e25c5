"""What autograd saves for backward, per layer part, counted from the model code; and the forward
FLOPs each recompute choice repeats.

Legend: T = rows on the rank, S = pack rows (T x cp), D = hidden, H x hd = heads x head dim,
Q = q-LoRA rank, G x O = output groups x o-LoRA rank, K = mHC streams, E = experts, k = top-k,
F / Fs = routed / shared expert width, W = window, r = RoPE channels, b = activation bytes (2 in
bf16, 4 in float32), P = compressed keys of the whole pack (S / ratio).

Each term below is a tensor the code saves (each storage once), in the part that saves it first;
`benchmarks/bench_activation_width.py` measures them at Flash width with saved-tensor hooks and
prints them next to these numbers. The parts are the recompute modules of
`models/common/recompute.py` plus what no module drops (`attention`, `compressor`, `mhc`,
`router`, `experts`), so a recompute choice removes exactly its parts. float32 runs take the
plain autograd expressions: each RMS norm with a scale also keeps its normalized input, and the
SwiGLU its clamped gate, SiLU and clamped up (bf16 runs save only the inputs, see norm.py and
kernels/grouped_experts.py).
"""

from __future__ import annotations

import math
from typing import Any

from primus_v4.kernels.saved_sets import attention_beyond_reference

# Parts each recompute module drops; `full` keeps only the layer's input streams.
DROPS = {
    "layernorm": ("layernorm",),
    "mla_up_proj": ("mla_up_proj",),
    "core_attn": ("core_attn",),
    "shared_experts": ("shared_experts",),
    "moe": ("router", "experts", "shared_experts"),
}


def _mhc_small(k: int) -> int:
    """float32 mHC coefficients per mixer and row: 1 / rms, the (2 + K) K logits, pre and post
    gates, the Sinkhorn input and output, the write-back weights."""
    return 4 + 4 * (2 + k) * k + 8 * k + 3 * 4 * k * k + 8 * k


def _swiglu(width: int, b: int) -> int:
    """Per routed copy: bf16 saves gate/up (2F) and the output (F, the down projection's input);
    float32 autograd also keeps the clamped gate, its SiLU and the clamped up."""
    return (2 * width + width) * b if b != 4 else (2 * width + 4 * width) * b


def pool_rows(cfg: Any, kind: str, seq: int) -> int:
    """Compressed keys of a full pack (one sample filling the row: the most)."""
    ratio = {"csa": 4, "hca": 128}.get(kind)
    return seq // ratio if ratio else 0


def layer_parts(cfg: Any, kind: str, *, rows: int, seq: int, b: int, hashed: bool = False,
                attention_backend: str = "torch") -> dict[str, float]:  # fmt: skip
    """Saved bytes of one decoder layer (or an MTP depth's layer) of `kind` for `rows` rows, its
    sparse attention run by `attention_backend` (what a kernel saves beyond the reference is
    part of `core_attn`: recomputing that part drops it too)."""
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.q_lora_rank
    g, o, kk, r = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult, cfg.qk_pos_emb_head_dim
    e, k, f = cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size
    fs = cfg.moe_shared_expert_intermediate_size or 0
    w = cfg.attn_sliding_window
    x32 = 4 if b == 4 else 0  # float32: a scaled RMS norm also saves x * rstd
    p = pool_rows(cfg, kind, seq)
    parts: dict[str, float] = {}
    # Collapse outputs (the norms' inputs) and norm outputs (attention's and the MoE's input).
    parts["layernorm"] = rows * 2 * (2 * d * b + 4 + d * x32)
    # Two stream tensors (before attention, before the MoE), the two sub-block outputs.
    parts["mhc"] = rows * 2 * (kk * d * b + d * b + _mhc_small(kk))
    att = (q * b + 4 + q * x32) + q * b  # q_norm input + rstd, its output (wq_b's input)
    att += hd * b + 4 + hd * x32  # kv_norm input + rstd
    att += 2 * 8 * (2 if kind == "hca" else 1)  # key ranges [lo, hi) per row, int64
    att += 8 * cfg.index_topk if kind == "csa" else 0  # the indexer's picks, int64
    att += g * o * b + r * b  # wo_b's input; kv RoPE cos / sin
    parts["attention"] = rows * att + (rows + w - 1 + p) * hd * b  # + the key buffer
    parts["mla_up_proj"] = rows * (2 * h * hd * b + 4 * h + r * b)  # q pre- and post-RoPE
    parts["core_attn"] = rows * (h * hd * b + 4 * h + r * b)  # output groups, row log-sum-exp
    candidates = w + (min(cfg.index_topk, p) if kind == "csa" else p)
    parts["core_attn"] += attention_beyond_reference(
        attention_backend,
        rows=rows,
        keys=rows + w - 1 + p,
        heads=h,
        head_dim=hd,
        candidates=candidates,
        b=b,
    )
    if kind in ("csa", "hca"):
        ratio, m = (4, 2) if kind == "csa" else (128, 1)
        slots = math.ceil(rows / ratio)
        comp = (rows + m * ratio) * d * b  # hidden rows with the left boundary (a copy)
        comp += slots * ratio * (2 * m * hd * b + 8 * m)  # window kv / gate gathers, row ids
        comp += slots * (hd * b + 4 + hd * x32 + r * b)  # pooled rows: norm input, RoPE
        parts["compressor"] = comp
    parts["router"] = rows * (5 * 4 * e + 12 * k + 12 + (8 if hashed else 0))
    parts["experts"] = rows * (k * (2 * d * b + _swiglu(f, b) + 20) + 8)
    parts["shared_experts"] = rows * _swiglu(fs, b)  # its input is the norm output
    return parts


def mtp_extra(cfg: Any, *, rows: int, b: int) -> dict[str, float]:
    """An MTP depth around its layer: the embedding-side norm and projection, the streams-side
    norm and projection, and the depth's own HyperHead + final norm."""
    d, kk = cfg.hidden_size, cfg.hc_mult
    x32 = 4 if b == 4 else 0
    return {
        # enorm output (e_proj's input), hnorm output (h_proj's input): dropped by layernorm.
        "layernorm": rows * (d * b + kk * d * b + (d + kk * d) * x32),
        # enorm input (the shifted embedding), hnorm rstd, head streams, final norm input.
        "mhc": rows * (d * b + 4 + 4 * kk + kk * d * b + 12 + 8 * kk + d * b + 4 + d * x32),
    }


def head_bytes(cfg: Any, *, rows: int, b: int) -> float:
    """The loss stage outside the layers: HyperHead input streams, final norm input, the ids."""
    d, kk = cfg.hidden_size, cfg.hc_mult
    x32 = 4 if b == 4 else 0
    return rows * (kk * d * b + 12 + 8 * kk + d * b + 4 + d * x32 + 16)


def kept(parts: dict[str, float], recompute: frozenset[str] | set[str]) -> float:
    """Bytes a layer still saves when `recompute` (selective module names) is on."""
    dropped = {p for m in recompute for p in DROPS[m]}
    return sum(v for name, v in parts.items() if name not in dropped)


def layer_flops(cfg: Any, kind: str, *, seq: int) -> dict[str, float]:
    """Forward FLOPs per token of one layer by part (2 per multiply-add): what each recompute
    choice runs again. Attention counts every candidate key of the most loaded row (a sample
    filling the pack: its whole window, top-k or visible pool)."""
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.q_lora_rank
    g, o, kk = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    e, k, f = cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size
    fs = cfg.moe_shared_expert_intermediate_size or 0
    pool = pool_rows(cfg, kind, seq)
    keys = cfg.attn_sliding_window + (min(cfg.index_topk, pool) if kind == "csa" else pool)
    out = {
        "mla_up_proj": 2.0 * q * h * hd,
        "core_attn": 4.0 * h * hd * keys,  # scores and weighted sum
        "attention": 2.0 * (d * q + d * hd + h * hd * o + g * o * d),
        "mhc": 2 * 2.0 * kk * d * (2 + kk) * kk,  # two mixers' coefficient projections
        "router": 2.0 * d * e,
        "experts": 2.0 * k * 3 * d * f,
        "shared_experts": 2.0 * 3 * d * fs,
        "layernorm": 0.0,  # elementwise only
    }
    if kind in ("csa", "hca"):
        m = 2 if kind == "csa" else 1
        out["compressor"] = 2.0 * 2 * d * m * hd
    if kind == "csa":  # the indexer: no backward, but a full recompute reruns it
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        out["indexer"] = 2.0 * (q * hi * di + d * hi + 2 * 2 * d * di + hi * di * pool)
    return out


def recompute_flops(flops: dict[str, float], recompute: frozenset[str] | set[str]) -> float:
    """Forward FLOPs per token a layer repeats under the selective `recompute` modules."""
    return sum(flops.get(p, 0.0) for m in recompute for p in DROPS[m])


def step_flops(flops: dict[str, float]) -> float:
    """Forward + backward FLOPs per token of a layer without recompute: backward is twice the
    forward for every part but the indexer, which has no backward."""
    return sum(v * (1 if name == "indexer" else 3) for name, v in flops.items())
