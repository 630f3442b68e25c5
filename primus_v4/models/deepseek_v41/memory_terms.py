"""DeepSeek-V4.1's memory terms (the memory plan asks them through `ModelSpec.memory`): each
layer's role, what its layer parts save for backward, and what a stage holds besides the
layers' saved sets (shared caches, the indexer's chunked scores).

Legend as in models/common/activations.py; P = compressed keys of the whole pack (S / ratio).
"""

from __future__ import annotations

from typing import Any

from primus_v4.kernels.saved_sets import attention_beyond_reference
from primus_v4.models.common.activations import layer_parts


def layer_role(cfg: Any, layer: int) -> str:
    """A DeepSeek-V4.1 layer's role in the memory plan: its cache ratio, whether it owns the
    cache (kv source), picks its own top-k (reindex), picks candidates, reads Engram."""
    ratio = cfg.compress_ratios[layer]
    role = "window" if ratio == 0 else f"ratio{ratio}"
    if ratio and layer in cfg.kv_source_layer_ids:
        role += " source"
    elif ratio and layer in cfg.index_source_layer_ids:
        role += " reindex"
    elif ratio:
        role += " reuse"
    if layer == cfg.candidate_source_layer_id:
        role += " +cand"
    if layer in cfg.engram_layer_ids:
        role += " +engram"
    return role


def pool_rows(cfg: Any, layer: int, seq: int) -> int:
    """Compressed positions of a full pack that layer `layer` attends to (its cache's)."""
    ratio = cfg.compress_ratios[layer]
    return seq // ratio if ratio else 0


def layer_parts_of(cfg: Any, layer: int, *, rows: int, seq: int, b: int,
                    attention_backend: str = "torch") -> dict[str, float]:  # fmt: skip
    """Saved bytes of DeepSeek-V4.1 decoder layer `layer` for `rows` rows of a `seq`-row pack.

    The MoE and mHC parts are DeepSeek-V4's (the same modules). Attention: no per-head q norm
    (the RoPE'd q is the core's input), a key buffer of window rows + the shared cache's P
    positions per layer (every layer concatenates the pool it reads into its own buffer: the
    cross-layer sharing costs each reusing layer its P rows), the selection's pool indices
    (int64 [T, K]) per compressed layer. A kv source adds its compressor (ratio 2: a float32
    copy of the input rows and of the pair's kv / gate rows, and float32 copies of its two
    weights; ratio 1: the gathered rows) and the pool's norm and RoPE. The index keys, the
    indexer and the candidates run without autograd. Engram (its layers): the gathered rows
    (wkv's input [T, C x E]), the row ids, and its float32 gate arithmetic on the 4 streams."""
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.q_lora_rank
    g, o, kk, r = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult, cfg.qk_pos_emb_head_dim
    w, ratio = cfg.attn_sliding_window, cfg.compress_ratios[layer]
    p = pool_rows(cfg, layer, seq)
    v4 = layer_parts(cfg, "dense", rows=rows, seq=seq, b=b, attention_backend=attention_backend)
    parts = {name: v4[name] for name in ("mhc", "router", "experts", "shared_experts")}
    # Norm inputs + rstd (attention's, the MoE's), their outputs (wq_a's and the router's input).
    parts["layernorm"] = rows * (4 * d * b + 8)
    # q_norm input + rstd, kv_norm input + rstd, window ranges, wo_b's input, kv RoPE.
    att = q * b + 4 + hd * b + 4 + 16 + g * o * b + 2 * r * b
    att += 8 * cfg.index_topk if ratio else 0  # the selection as key-buffer rows, int64
    parts["attention"] = rows * att + (rows + w - 1 + p) * hd * b  # + the key buffer
    parts["mla_up_proj"] = rows * (h * hd * b + q * b + r * b)  # RoPE'd q, wq_b's input
    parts["core_attn"] = rows * (h * hd * b + 4 * h + r * b)  # output groups, LSE, inverse RoPE
    parts["core_attn"] += attention_beyond_reference(
        attention_backend, rows=rows, keys=rows + w - 1 + p, heads=h, head_dim=hd,
        candidates=w + min(cfg.index_topk, p), b=b,
    )  # fmt: skip
    if layer in cfg.kv_source_layer_ids:
        pooled = rows // ratio  # this rank's rows' positions
        comp = pooled * (hd * b + 4 + r * b)  # the pool's norm input + rstd, its RoPE
        if ratio == 1:
            comp += pooled * d * b  # the gathered rows (wkv's input)
        else:
            comp += rows * d * 4 + 2 * d * hd * 4  # float32 input rows and weights
            comp += pooled * ratio * (2 * hd * 4 + 8)  # float32 kv / gate pairs, row ids
        parts["compressor"] = comp
    if layer in cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        e = cfg.engram_head_dim
        per_row = cols * e * b + 8 * cols  # wkv's input (the gathered rows), the row ids
        per_row += 3 * kk * d * 4 + d * 4 + (11 * kk + 1) * 4  # float32 streams, key, value, gates
        parts["engram"] = rows * per_row + 3 * kk * d * 4  # + float32 gate weights
    return parts


def shared_bytes(cfg: Any, *, rows: int, seq: int) -> dict[str, float]:
    """What one pack's forward hands from layer to layer besides the streams (DeepSeek-V4.1's
    SharedCache): the latest kv source's RoPE'd pool [P, D] and index keys [P, I], the
    selection [T, K] int64 and the candidate blocks [T, B] int64. A pipeline stage that starts
    after a source receives them with the streams, and holds them per micro-batch in flight."""
    ratios = [x for x in cfg.compress_ratios if x]
    if not ratios:
        return {}
    p = seq // min(ratios)
    out = {
        "pool KV + index keys [P, D + I]": p * (cfg.kv_channels * 2 + cfg.index_head_dim * 2),
        "selection [T, K] int64": rows * cfg.index_topk * 8,
    }
    if cfg.candidate_source_layer_id >= 0:
        out["candidate blocks [T, B] int64"] = rows * cfg.candidate_topk_blocks * 8
    return out


def index_scores(cfg: Any, *, seq: int, score_elems: int = 1 << 22) -> float:
    """The indexer's transient, chunked by query rows (`score_elems`, the indexer's
    SCORE_ELEMS, float32 scores [C, H, P] per chunk, with the chunk's [C, P] sums, mask and
    candidate blocks)."""
    ratios = [x for x in cfg.compress_ratios if x]
    if not ratios:
        return 0.0
    p = seq // min(ratios)
    chunk = max(1, score_elems // (cfg.index_n_heads * p))
    return 4.0 * chunk * cfg.index_n_heads * p + 3 * 4.0 * chunk * p


def stage_rows(
    cfg: Any, layers: list[int], *, seq: int, t: int, held: int
) -> list[tuple[str, float]]:
    """DeepSeek-V4.1's backward-phase terms of a stage outside its layers' saved sets: the shared
    caches it receives from an earlier kv / index source (a stage cut inside a sharing run: the
    pool, index keys, selection and candidates travel with the streams, one set per micro-batch
    in flight), the forward's own shared cache (its selection and candidates live until the
    forward ends), and the indexer's scores, chunked by query rows."""
    if not layers:
        return []
    first = layers[0]
    shared = shared_bytes(cfg, rows=t, seq=seq)
    if not shared:
        return []
    out = []
    if cfg.compress_ratios[first] and first not in cfg.kv_source_layer_ids:
        out.append((f"shared caches received from the stage before (x {held} micro-batch)",
                    held * sum(shared.values())))  # fmt: skip
    out.append(("this forward's shared cache (pool, keys, selection, candidates)",
                sum(shared.values())))  # fmt: skip
    out.append(("indexer scores, chunked by query rows", index_scores(cfg, seq=seq)))
    return out


def image_encoder_bytes(release: Any, *, b: int, train: str = "frozen") -> Any:
    """The image encoder's `ImageEncoderTerms` for a run whose `model.vision.train` is `train`,
    None without a vision tower. The largest image fills `max_image_tokens`: one LLM cell per
    3 x 3 ViT patches, so at most (max_image_tokens - 2) x 9 patches.
    - A frozen tower encodes it without gradient, holding one block's activations (4 x width +
      2 x ffn values per patch, with the fused qkv and w1) and each head's patches^2 float32
      attention scores (the math kernel's worst case).
    - A trained aligner saves per image token its 3 x 3 cell's input (9 x width) and its two
      outputs (2 x the language model's width).
    - A trained tower saves per block and patch: both norms' inputs and outputs, q, k, v and
      their rotations, the attention output (9 x width) and w1's halves, silu and product
      (4 x ffn); 9 patches per image token; and each block's attention probabilities of the
      largest image."""
    import json
    from pathlib import Path

    import torch

    from primus_v4.data.images import ImageGrid
    from primus_v4.models.deepseek_v41.vision import ImageEncoder, VisionSizes
    from primus_v4.models.model_spec import ImageEncoderTerms

    if release is None or not (Path(release) / "config.json").is_file():
        return None
    config = json.loads((Path(release) / "config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    sizes = VisionSizes.of(config)
    with torch.device("meta"):
        encoder = ImageEncoder(sizes)
    tower = sum(p.numel() for p in encoder.vision.parameters())
    rest = sum(p.numel() for p in encoder.parameters()) - tower
    grid = ImageGrid.of(config)
    r2 = grid.downsample_ratio**2
    patches = (grid.max_image_tokens - 2) * r2
    scores = sizes.heads * patches * patches * 4
    no_grad = float(patches * (4 * sizes.width + 2 * sizes.ffn) * b + scores)  # a frozen tower
    if train == "frozen":
        return ImageEncoderTerms(frozen_params=tower + rest, transient=no_grad,
                                 saved_per_token=0.0, saved_scores=0.0)  # fmt: skip
    aligner = (r2 * sizes.width + 2 * sizes.text_width) * b
    if train == "aligner":
        return ImageEncoderTerms(frozen_params=tower, transient=no_grad,
                                 saved_per_token=float(aligner), saved_scores=0.0)  # fmt: skip
    block = (9 * sizes.width + 4 * sizes.ffn) * b
    return ImageEncoderTerms(frozen_params=0, transient=0.0,
                             saved_per_token=float(aligner + r2 * sizes.layers * block),
                             saved_scores=float(sizes.layers * scores))  # fmt: skip
