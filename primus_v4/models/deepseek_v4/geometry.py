"""DeepSeek-V4's model config without torch: its own fields and checks (`DeepseekV4Fields`,
which the megatron-core based `DeepseekV4Config` (config.py) inherits), and `DeepseekV4Geometry`,
the same fields plus the megatron-core fields the shipped presets set, with megatron-core's
defaults and the checks it makes of them. What builds no model reads the geometry
(`train --dry-run`: the preset, its overrides, the layer kinds, the parallel sizes) and imports
neither torch nor megatron-core.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from primus_v4.errors import ConfigError
from primus_v4.models.model_spec import GeometrySpec

# Shipped as package data (pyproject [tool.setuptools.package-data]): wheels carry them too.
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"  # models.PRESET_DIR
LAYER_KINDS = {0: "dense", 4: "csa", 128: "hca"}

# Upper bound of every size: about 16x the largest release (V4-Pro: 61 layers, hidden 7168,
# 128 heads, 384 experts, vocab 129280), so no real model meets one, while a typo or a hostile
# config.json (10**6 layers) fails here, before anything per layer, row or expert is allocated.
SIZE_BOUNDS = {
    "num_layers": 1024, "hidden_size": 1 << 17, "vocab_size": 1 << 22,
    "num_attention_heads": 2048, "kv_channels": 1 << 13, "q_lora_rank": 1 << 15,
    "o_groups": 256, "o_lora_rank": 1 << 15, "ffn_hidden_size": 1 << 19,
    "num_moe_experts": 1 << 13, "moe_router_topk": 1 << 13, "moe_ffn_hidden_size": 1 << 17,
    "moe_shared_expert_intermediate_size": 1 << 17, "qk_pos_emb_head_dim": 1 << 13,
    "index_n_heads": 1024, "index_head_dim": 1 << 13, "index_topk": 1 << 20,
    "index_topk_chunk": 1 << 20, "attn_sliding_window": 1 << 20, "hc_mult": 64,
    "hc_sinkhorn_iters": 1 << 12, "num_hash_layers": 1024, "mtp_num_layers": 64,
    "ce_chunk_size": 1 << 22, "original_max_position_embeddings": 1 << 26,
    # DeepSeek-V4.1 (Flash: Engram tables of ~384M rows x 256, 16M hash buckets, 8 heads;
    # candidate blocks 2048 x 8; DSpark 3 stages, block 5, 128 experts, Markov rank 256)
    "engram_num_embeddings": 1 << 33, "engram_vocab_size": 1 << 28, "engram_n_heads": 256,
    "engram_head_dim": 1 << 13, "engram_max_ngram_size": 64,
    "engram_compressed_vocab_size": 1 << 22, "candidate_topk_blocks": 1 << 20,
    "candidate_block_size": 1 << 12, "dspark_stages": 64, "dspark_block_size": 1024,
    "dspark_markov_rank": 1 << 13, "dspark_n_routed_experts": 1 << 13,
    "dspark_num_experts_per_tok": 1 << 13,
}  # fmt: skip


def check_sizes(
    values: Mapping[str, Any], *, source: str, names: Mapping[str, str] | None = None
) -> None:
    """Refuse a size above its bound (`SIZE_BOUNDS`), naming it as `names` maps our field
    names (a release's config.json keys), before any of them is used."""
    for field_name, bound in SIZE_BOUNDS.items():
        value = values.get(field_name)
        if isinstance(value, list):  # one size per layer (Engram tables): the largest
            value = max((v for v in value if isinstance(v, int)), default=None)
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            name = (names or {}).get(field_name, field_name)
            raise ConfigError(
                f"{source}: {name}={value} is above its bound {bound} (about 16x the largest "
                "DeepSeek-V4 release; a size this large is a typo or not this model)"
            )


@dataclass(kw_only=True)
class DeepseekV4Fields:
    """The DeepSeek-V4 fields (each documented where declared) and their checks, which also read
    the megatron-core fields (num_layers, heads, MoE sizes) a subclass declares."""

    family = "deepseek_v4"  # not a field: the model family (models/__init__.py) of this config

    vocab_size: int = 129280
    """Embedding rows and LM-head columns (the DeepSeek-V4 tokenizer has 129280 ids)."""
    q_lora_rank: int = 1024
    """Query low-rank bottleneck: hidden -> q_lora_rank -> RMSNorm -> heads x kv_channels."""
    o_groups: int = 8
    """Groups of the grouped low-rank output projection (heads split evenly across groups)."""
    o_lora_rank: int = 1024
    """Per-group rank of the output projection (groups x rank -> hidden)."""
    qk_pos_emb_head_dim: int = 64
    """RoPE applies to the last this-many channels of each query head and of the KV latent."""
    rotary_base: float = 10000.0
    """RoPE theta for dense (ratio 0) layers; no YaRN there."""
    compress_rope_theta: float = 160000.0
    """RoPE theta for compressed (CSA/HCA) layers and their compressors/indexer, with YaRN below
    (160000 in the Flash and Pro releases)."""
    rotary_scaling_factor: float = 16.0
    """YaRN interpolation factor for compressed layers (1.0 disables YaRN; 16 as released). No
    YaRN mscale: cos/sin keep unit magnitude and the softmax scale stays 1/sqrt(head_dim)."""
    original_max_position_embeddings: int = 65536
    """YaRN: context length the base frequencies were trained for."""
    beta_fast: float = 32.0
    """YaRN: high-frequency ramp boundary (rotations per original context)."""
    beta_slow: float = 1.0
    """YaRN: low-frequency ramp boundary (rotations per original context)."""
    compress_ratios: list[int] = field(default_factory=lambda: [0, 4, 128])
    """Per decoder layer: 0 = dense sliding window, 4 = CSA, 128 = HCA."""
    mtp_compress_ratio: int = 0
    """Attention kind of each MTP depth's layer (0 = dense, 4 = CSA, 128 = HCA)."""
    dspark: dict | None = None
    """A DSpark drafter carried with the backbone (DeepSeek-V4-Flash-0731: `mtp.0-2`, the
    `dspark_*` config.json keys): the release's own keys, kept to be written back on export; the
    drafter is not part of this model (no classic MTP block), its tensors travel unchanged."""
    attn_sliding_window: int = 128
    """A query sees itself and the previous window-1 rows of its own sample, in every layer."""
    attn_sink: bool = True
    """Learned per-head sink logit that joins every softmax."""
    index_topk: int = 512
    """CSA: compressed keys each query attends to, chosen by the lightning indexer."""
    index_n_heads: int = 64
    """Lightning indexer heads."""
    index_head_dim: int = 128
    """Lightning indexer head dim (also its compressor's output dim)."""
    index_topk_chunk: int = 512
    """Indexer scores are computed this many compressed keys at a time (running top-k)."""
    hc_mult: int = 4
    """mHC: number of residual streams."""
    hc_sinkhorn_iters: int = 20
    """mHC: Sinkhorn-Knopp iterations on the stream-mixing matrix."""
    hc_eps: float = 1e-6
    """mHC: epsilon added to the mixing weights."""
    num_hash_layers: int = 3
    """The first this-many decoder layers route experts by a fixed token-id hash table."""
    hash_seed: int = 0
    """Seed of the random-init token-id -> experts table (a loaded checkpoint's `tid2eid` wins)."""
    swiglu_limit: float = 10.0
    """Clamped SwiGLU: gate clamped above, up clamped to [-limit, limit]."""
    ce_chunk_size: int = 4096
    """Rows per chunk of the fused linear + cross-entropy (logits never materialized)."""
    lm_head_rows: str = "supervised"
    """Rows the LM head + CE run on: "supervised" (rows with a loss; the rest contribute exactly
    zero) or "all" (every row, masked: a conventional trainer's cost, same loss and grads)."""
    rope_dense_only_window: bool = False
    """Reserved; kept False."""

    def _check_model(self) -> None:
        """The DeepSeek-V4 checks, after megatron-core's (its defaults filled in)."""
        if len(self.compress_ratios) != self.num_layers:
            raise ConfigError(
                f"compress_ratios has {len(self.compress_ratios)} entries but num_layers is "
                f"{self.num_layers}; give one ratio per decoder layer"
            )
        self._validate_layers()
        if self.num_query_groups not in (None, 1):
            raise ConfigError("DeepSeek-V4 uses one shared KV latent: num_query_groups must be 1")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} must divide into o_groups "
                f"{self.o_groups}"
            )
        if self.qk_pos_emb_head_dim % 2 or self.qk_pos_emb_head_dim > self.kv_channels:
            raise ConfigError("qk_pos_emb_head_dim must be even and at most kv_channels")
        self._validate_moe_and_heads()

    def _validate_layers(self) -> None:
        """Every layer's compress ratio names a layer kind of this family."""
        for i, ratio in enumerate([*self.compress_ratios, self.mtp_compress_ratio]):
            if ratio not in LAYER_KINDS:
                raise ConfigError(f"compress ratio {ratio} (layer {i}) must be one of 0, 4, 128")

    def _validate_moe_and_heads(self) -> None:
        """MoE / mHC / MTP / loss fields (every decoder layer is MoE in DeepSeek-V4)."""
        if not self.num_moe_experts or not self.moe_ffn_hidden_size:
            raise ConfigError(
                "num_moe_experts and moe_ffn_hidden_size must be set: every V4 layer is MoE"
            )
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ConfigError(
                f"moe_router_topk {self.moe_router_topk} must be in [1, num_moe_experts "
                f"{self.num_moe_experts}]"
            )
        if not 0 <= self.num_hash_layers <= self.num_layers:
            raise ConfigError(
                f"num_hash_layers {self.num_hash_layers} must be in [0, num_layers "
                f"{self.num_layers}]"
            )
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ConfigError("hc_mult and hc_sinkhorn_iters must be >= 1")
        if (self.mtp_num_layers or 0) < 0:
            raise ConfigError(f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if self.lm_head_rows not in ("supervised", "all"):
            raise ConfigError(
                f"lm_head_rows must be 'supervised' or 'all', got {self.lm_head_rows!r}"
            )
        if self.ce_chunk_size < 1 or self.vocab_size < 1:
            raise ConfigError("ce_chunk_size and vocab_size must be positive")

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    def layer_kind(self, layer: int) -> str:
        return LAYER_KINDS[self.compress_ratios[layer]]

    @classmethod
    def preset(cls, name: str, **overrides) -> Self:
        """Load `primus_v4/configs/models/<name>.yaml`; keyword overrides win over the file."""
        import yaml

        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ConfigError(f"unknown model preset {name!r}; known presets: {known}")
        values = yaml.safe_load(path.read_text()) or {}
        family = values.pop("family", cls.family)
        if family != cls.family:
            raise ConfigError(f"{path}: family {family!r} is not {cls.family!r}")
        release = values.pop("release_config", None)
        if release is not None:  # the geometry is the release's own config.json
            values = {**cls.release_fields(PRESET_DIR / release), **values}
        values.update(overrides)
        return cls.from_dict(values, source=str(path))

    @classmethod
    def release_fields(cls, path: Path) -> dict[str, Any]:
        """The model fields of a release config.json that a preset names (`release_config:`,
        relative to the preset directory); a family without a torch-free reader refuses."""
        raise ConfigError(f"{path}: the {cls.family} presets do not read a release config.json")

    @classmethod
    def from_dict(cls, values: dict, *, source: str = "<dict>") -> Self:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown model config keys {unknown}")
        check_sizes(values, source=source)
        return cls(**values)


@dataclass(kw_only=True)
class DeepseekV4Geometry(DeepseekV4Fields):
    """`DeepseekV4Config` without torch: the DeepSeek-V4 fields and the megatron-core fields the
    shipped presets set (same names, same defaults), checked as the config checks them with
    megatron-core's parallel sizes at their defaults (a config holding any other megatron-core
    field is built as `DeepseekV4Config`)."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    kv_channels: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float | list[float] = 0.0
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float | None = 0.1
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None

    def __post_init__(self) -> None:
        check_sizes(vars(self), source="model config")
        self._megatron_checks()
        if self.recompute_granularity == "selective":  # as DeepseekV4Config names its parts
            from primus_v4.models.common.recompute_choice import DEFAULT_MODULES, check_modules

            modules = self.recompute_modules
            self.recompute_modules = list(DEFAULT_MODULES if modules is None else modules)
            check_modules(self.recompute_modules)
        self._check_model()

    def _megatron_checks(self) -> None:
        """What `TransformerConfig.__post_init__` derives and refuses of these fields (tp = 1,
        its router at its defaults: softmax scores, aux-loss balancing), in its order."""
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_moe_experts is not None and self.num_moe_experts <= 0:
            raise ValueError("num_moe_experts must be non-negative.")
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_moe_experts is None:
            assert self.moe_ffn_hidden_size is None, (
                "moe_ffn_hidden_size must be None when num_experts is not set."
            )
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared <= 0:
            raise ValueError(
                "moe_shared_expert_intermediate_size must be num_shared_experts * "
                f"ffn_size_of_each_shared_expert, but got {shared}"
            )
        self._megatron_recompute_checks()
        # the output layers' init std (init_method_std / sqrt(2 num_layers)): megatron-core
        # computes it here, and a num_layers of 0 (or below) fails in the division (the root)
        _ = self.init_method_std / math.sqrt(2.0 * self.num_layers)
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            raise ValueError("Please use --moe-router-pre-softmax when topk is 1.")

    def _megatron_recompute_checks(self) -> None:
        """`TransformerConfig.__post_init__`'s checks of the recompute fields (pp = 1, no CPU
        offloading, no sequence parallelism; its module list is not checked: DeepseekV4Config
        names this model's parts instead)."""
        granularity, method = self.recompute_granularity, self.recompute_method
        if granularity is None:
            return
        if granularity not in ["full", "selective"]:
            raise ValueError(
                f'When using recompute_granuarlity: {granularity} must be "full"or "selective".'
            )
        if method is not None:
            if method not in ["block", "uniform"]:
                raise ValueError(f'recompute_method: {method} must be "block" or "uniform".')
        elif granularity != "selective":
            raise ValueError(
                f"Using recompute_granularity: {granularity} so "
                'recompute_method must be "block" or "uniform"'
            )
        if granularity != "selective" and self.recompute_num_layers is None:
            raise ValueError(
                f"When using recompute_granularity: {granularity} recompute_num_layers must be "
                f"between 1 and num_layers_per_pipeline_rank: {self.num_layers}"
            )
        if granularity == "selective" and self.recompute_num_layers is not None:
            raise ValueError(
                f"When using recompute_granularity: {granularity} recompute_num_layers must be "
                "None."
            )


def boundary_rows(ratio: int, overlap: bool) -> int:
    """Hidden rows a rank needs from its left neighbour to pool the windows it owns."""
    return 2 * ratio if overlap else ratio


def required_local_rows(model_cfg: Any) -> int:
    """Fewest rows a CP rank may hold: every boundary it must send to its right neighbour."""
    need = max(model_cfg.attn_sliding_window - 1, 1)
    ratios = list(model_cfg.compress_ratios)
    if model_cfg.mtp_num_layers:
        ratios.append(model_cfg.mtp_compress_ratio or 0)
    for r in ratios:
        if r:  # CSA layers pool with overlap (their indexer's compressor too); HCA without
            need = max(need, boundary_rows(r, overlap=LAYER_KINDS[r] == "csa"))
    return need


GEOMETRY = GeometrySpec(
    config_class=DeepseekV4Geometry, preset_dir=PRESET_DIR, cp_min_rows=required_local_rows
)
