"""DeepSeek-V4.1's model config without torch: its own fields and checks (`DeepseekV41Fields`,
which `DeepseekV41Config` (config.py) inherits) and `DeepseekV41Geometry`, the config without
megatron-core (deepseek_v4/geometry.py says what that holds).

The V4 fields keep their meaning (heads, q/o LoRA ranks, RoPE and YaRN, mHC, MoE sizes, SwiGLU
limit); V4.1 reads `compress_ratios` as the compressed cache a layer attends to (0 = window
only, 2 = a 2:1 cache, 1 = a full-resolution cache), routes every layer by noaux_tc (no hash
layers) and has no MTP depth in the backbone (the release's DSpark stages are not trained here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.geometry import PRESET_DIR, DeepseekV4Fields, DeepseekV4Geometry
from primus_v4.models.model_spec import GeometrySpec

LAYER_KINDS = {0: "window", 2: "ratio2", 1: "ratio1"}
VISION_TRAIN = ("frozen", "aligner", "all")
VISION_SIZE_BOUNDS = {
    "num_hidden_layers": 16 * 32, "hidden_size": 16 * 1024, "num_attention_heads": 16 * 16,
    "intermediate_size": 16 * 2816, "patch_size": 16 * 14, "downsample_ratio": 16 * 3,
}  # fmt: skip
"""Upper bounds of the image encoder's sizes (`vision_config` keys): 16x DeepSeek-V4.1-Flash's
(32 blocks of width 1024, 16 heads, MLP 2816, 14-pixel patches, 3 x 3 aligner cells); the
patch and cell sides size the patch embedding (3 p^2 -> width) and the aligner (width r^2 ->
the language model's width). A size this large is a typo or not this model, and fails before
the encoder is allocated."""
VISION_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
"""The sizes a `vision_config` must give (vision.py's `VisionSizes.of` reads them)."""


@dataclass(kw_only=True)
class DeepseekV41Fields(DeepseekV4Fields):
    """The DeepSeek-V4.1 fields (each documented where declared) over DeepSeek-V4's, and their
    checks."""

    family = "deepseek_v41"  # not a field: the model family (models/__init__.py) of this config

    compress_ratios: list[int] = field(default_factory=lambda: [0, 2, 2, 1])
    """Per layer, the compressed cache it attends to: 0 window only, 2 a 2:1 cache, 1 a
    full-resolution cache."""
    num_hash_layers: int = 0
    """V4.1 routes every layer by noaux_tc: must stay 0."""
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [1, 3])
    """Layers that own a compressor (compressed KV + index keys); the layers after one reuse its
    cache until the next source."""
    index_source_layer_ids: list[int] = field(default_factory=lambda: [1, 3])
    """Layers that run an indexer query (top-k selection); the others reuse the latest one's."""
    candidate_source_layer_id: int = -1
    """Two-level top-k: the layer whose index scores choose candidate blocks (-1 = off); index
    sources after it only pick inside those blocks."""
    candidate_topk_blocks: int = 0
    """Two-level top-k: candidate blocks kept per query (the newest block is always kept)."""
    candidate_block_size: int = 0
    """Two-level top-k: compressed positions per candidate block."""
    engram_layer_ids: list[int] = field(default_factory=list)
    """Layers with an Engram memory lookup (applied to the 4 streams before the layer)."""
    engram_num_embeddings: list[int] = field(default_factory=list)
    """Rows of each Engram layer's table."""
    engram_max_ngram_size: int = 4
    """n-grams of 2 .. this size are hashed at every position."""
    engram_vocab_size: int = 0
    """Each (layer, n, head) bucket count is the next unused prime above this."""
    engram_n_heads: int = 0
    """Hash heads per n-gram size."""
    engram_head_dim: int = 0
    """Width of one table row."""
    engram_pad_token_id: int = 2
    """Token id whose compressed id fills the look-back before a sample's start."""
    engram_compressed_vocab_size: int = 0
    """Size of the Engram token map's range (the hash multipliers derive from it)."""
    dspark_stages: int = 0
    """DSpark draft stages after the backbone (the release's `num_nextn_predict_layers`, its
    `mtp.0..` tensors); 0 = no drafter. Built only when asked (`DeepseekV41Model(drafter=True)`,
    `load_pretrained(..., drafter=True)`): the backbone trains and exports as before."""
    dspark_block_size: int = 0
    """Draft positions per anchor: the anchor token, then `dspark_block_size - 1` noise tokens."""
    dspark_noise_token_id: int = 0
    """The token id that fills a draft block after its anchor."""
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    """Backbone layers whose INPUT (mean over the mHC streams) the drafter reads, concatenated."""
    dspark_markov_rank: int = 0
    """Rank of the Markov head (previous draft token -> a bias on the draft logits)."""
    dspark_n_routed_experts: int = 0
    """Routed experts of each draft stage's own MoE."""
    dspark_num_experts_per_tok: int = 0
    """Experts each draft token is routed to."""
    dspark_train: str = "off"
    """Whether a run trains the drafter (the run's `model.draft.train`): `off` (not built; the
    release's `mtp.*` are carried byte for byte), `joint` (built and trained beside the
    backbone), `only` (built and trained; the backbone frozen, forward only). A training
    field: never in config.json."""
    dspark_loss_weight: float = 1.0
    """Weight of the draft objective (a mean over the step's draft target slots) in the step's
    loss (`model.draft.weight`)."""
    dspark_anchor_rate: float = 0.0625
    """Share of the supervised rows that anchor a draft block (`model.draft.anchor_rate`)."""
    dspark_anchor_seed: int = 0
    """Seed of the anchor hash (the run's `train.seed`)."""
    dspark_kl_weight: float = 1.0
    """Weight of KL(backbone || draft) beside the cross entropy to the data token (weight 1)."""
    dspark_confidence_weight: float = 0.1
    """Weight of the confidence head's binary cross entropy against greedy acceptance."""
    dspark_decay: float = 1.0
    """Slot i of a block weighs decay**i (later slots count less below 1)."""
    vision_config: dict[str, Any] | None = None
    """The release's `vision_config` (beside `text_config` in its config.json): the sizes of its
    image encoder (models/deepseek_v41/vision.py); None for a release without one."""
    vision_train: str = "frozen"
    """Which parts of the image encoder the model holds as its own parameters (the run's
    `model.vision.train`, or `all` / `aligner` for LoRA targets on them): `frozen` (none: the
    encoder is attached outside the model, in no checkpoint, its tensors carried by an export),
    `aligner` (the aligner and the span vectors: loaded from the release, trained or adapted,
    checkpointed and exported in BF16; the tower attached frozen) or `all` (the ViT too). A
    training field: never in config.json."""
    activation_fake_quant: bool = False
    """Simulate the release's inference activation quantization (window KV FP8 per 32 values,
    compressed KV FP4 per 16 with e4m3 scales, indexer q/k FP4 per 32; straight-through
    gradients). Off: the released weights' exact float math, which the reference logits use."""

    def _validate_layers(self) -> None:
        n = self.num_layers
        for i, ratio in enumerate(self.compress_ratios):
            if ratio not in LAYER_KINDS:
                raise ConfigError(f"compress ratio {ratio} (layer {i}) must be one of 0, 2, 1")
        if self.num_hash_layers:
            raise ConfigError("DeepSeek-V4.1 has no hash-routed layers: num_hash_layers must be 0")
        if self.mtp_num_layers:
            raise ConfigError("DeepSeek-V4.1's backbone has no MTP depth: mtp_num_layers must be 0")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if sorted(set(ids)) != list(ids) or any(not 0 <= i < n for i in ids):
                raise ConfigError(f"{name} {ids} must be increasing layer indices in [0, {n})")
        for i, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                continue
            src = self.kv_source(i)
            if src is None or self.compress_ratios[src] != ratio:
                raise ConfigError(
                    f"layer {i} (ratio {ratio}) has no earlier kv source of the same ratio in "
                    f"kv_source_layer_ids {self.kv_source_layer_ids}"
                )
            if self.index_source(i) is None or self.index_source(i) < src:
                raise ConfigError(
                    f"layer {i}: no index source at or after its kv source {src} in "
                    f"index_source_layer_ids {self.index_source_layer_ids}"
                )
        for i in [*self.kv_source_layer_ids, *self.index_source_layer_ids]:
            if self.compress_ratios[i] == 0:
                raise ConfigError(f"layer {i} is a kv/index source but its compress ratio is 0")
        self._validate_candidates()
        self._validate_engram()
        self._validate_dspark()
        self._validate_vision()
        if self.activation_fake_quant and (self.kv_channels % 32 or self.index_head_dim % 32):
            raise ConfigError(
                "activation_fake_quant quantizes KV and index vectors in blocks of 32: "
                f"kv_channels ({self.kv_channels}) and index_head_dim ({self.index_head_dim}) "
                "must be multiples of 32"
            )

    def _validate_candidates(self) -> None:
        c = self.candidate_source_layer_id
        if c < 0:
            return
        if c not in self.index_source_layer_ids:
            raise ConfigError(f"candidate_source_layer_id {c} must be an index source layer")
        if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
            raise ConfigError("candidate_topk_blocks and candidate_block_size must be >= 1")

    def _validate_vision(self) -> None:
        if self.vision_train not in VISION_TRAIN:
            raise ConfigError(f"vision_train must be one of {', '.join(VISION_TRAIN)}, got "
                              f"{self.vision_train!r}")  # fmt: skip
        if self.vision_train != "frozen" and not self.vision_config:
            raise ConfigError(
                f"vision_train {self.vision_train!r} (model.vision.train, or LoRA targets on the "
                "image encoder): the model has no image encoder (no vision_config: a release's "
                "config.json holds it beside text_config)"
            )
        if self.vision_config is not None:
            check_vision_sizes(self.vision_config)

    def _validate_dspark(self) -> None:
        if self.dspark_train not in ("off", "joint", "only"):
            raise ConfigError(f"dspark_train must be off, joint or only, got {self.dspark_train!r}")
        if self.dspark_train != "off" and not self.dspark_stages:
            raise ConfigError(
                f"dspark_train {self.dspark_train!r}: the model has no DSpark draft stages "
                "(dspark_stages 0; a release's config.json num_nextn_predict_layers)"
            )
        if not 0 < self.dspark_anchor_rate <= 1 or not 0 < self.dspark_decay <= 1:
            raise ConfigError(
                f"dspark_anchor_rate ({self.dspark_anchor_rate}) and dspark_decay "
                f"({self.dspark_decay}) must be in (0, 1]"
            )
        weights = (self.dspark_loss_weight, self.dspark_kl_weight, self.dspark_confidence_weight)
        if min(weights) < 0:
            raise ConfigError(f"dspark loss, kl and confidence weights {weights} must be >= 0")
        if not self.dspark_stages:
            return
        n = self.num_layers
        ids = self.dspark_target_layer_ids
        if not ids or sorted(set(ids)) != list(ids) or any(not 0 <= i < n for i in ids):
            raise ConfigError(
                f"dspark_target_layer_ids {ids} must be increasing backbone layer indices in "
                f"[0, {n}) (dspark_stages {self.dspark_stages})"
            )
        if self.dspark_block_size < 1 or self.dspark_markov_rank < 1:
            raise ConfigError("dspark_block_size and dspark_markov_rank must be >= 1")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ConfigError(
                f"dspark_noise_token_id {self.dspark_noise_token_id} is not a token id of the "
                f"vocabulary ({self.vocab_size})"
            )
        if not 1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts:
            raise ConfigError(
                f"dspark_num_experts_per_tok ({self.dspark_num_experts_per_tok}) must be in "
                f"[1, dspark_n_routed_experts ({self.dspark_n_routed_experts})]"
            )

    def _validate_engram(self) -> None:
        if not self.engram_layer_ids:
            return
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError("engram_num_embeddings needs one row count per engram layer")
        if self.engram_max_ngram_size < 2 or self.engram_n_heads < 1:
            raise ConfigError("engram_max_ngram_size must be >= 2 and engram_n_heads >= 1")
        if self.engram_head_dim < 1 or self.engram_compressed_vocab_size < 1:
            raise ConfigError("engram_head_dim and engram_compressed_vocab_size must be >= 1")

    @classmethod
    def release_fields(cls, path: Path) -> dict[str, Any]:
        """The model fields of the release config.json at `path` (release/config_json.py)."""
        import json

        from primus_v4.errors import CheckpointFormatError
        from primus_v4.models.deepseek_v41.release.config_json import fields_from_release

        try:
            return fields_from_release(json.loads(path.read_text()), source=str(path))
        except (OSError, json.JSONDecodeError, CheckpointFormatError) as err:
            raise ConfigError(f"{path}: the preset's release config.json: {err}") from None

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed KV and index keys `layer` reads (the latest source)."""
        return max((s for s in self.kv_source_layer_ids if s <= layer), default=None)

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k selection `layer` uses (the latest index source)."""
        return max((s for s in self.index_source_layer_ids if s <= layer), default=None)

    def layer_kind(self, layer: int) -> str:
        return LAYER_KINDS[self.compress_ratios[layer]]


def check_vision_sizes(vision: Any, *, source: str = "model config") -> None:
    """Refuse an image encoder size (`VISION_SIZE_BOUNDS`) that is not an integer >= 1 or is
    above its bound, a missing one of `VISION_REQUIRED`, and a width its heads do not split into
    a head dim that is a multiple of 4, naming `vision_config.<key>`; an empty mapping is no
    image encoder."""
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: vision_config must be a mapping, got {vision!r:.80}")
    for key, bound in VISION_SIZE_BOUNDS.items():
        if key not in vision:
            continue
        value = vision[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{source}: vision_config.{key} must be an integer >= 1, got "
                              f"{value!r}")  # fmt: skip
        if value > bound:
            raise ConfigError(
                f"{source}: vision_config.{key}={value} is above its bound {bound} (about 16x "
                "DeepSeek-V4.1-Flash's; a size this large is a typo or not this model)"
            )
    missing = [key for key in VISION_REQUIRED if key not in vision]
    if vision and missing:
        raise ConfigError(f"{source}: vision_config has no {', '.join(missing)} (the image "
                          f"encoder's sizes: {', '.join(VISION_REQUIRED)})")  # fmt: skip
    width, heads = vision.get("hidden_size"), vision.get("num_attention_heads")
    if width and heads and (width % heads or (width // heads) % 4):
        raise ConfigError(f"{source}: vision_config.hidden_size {width} over "
                          f"num_attention_heads {heads} must give a head dim that is a multiple "
                          "of 4 (the encoder's 2-D rotary)")  # fmt: skip


@dataclass(kw_only=True)
class DeepseekV41Geometry(DeepseekV41Fields, DeepseekV4Geometry):
    """`DeepseekV41Config` without torch (`DeepseekV4Geometry` with the V4.1 fields)."""


def required_local_rows(model_cfg: Any) -> int:
    """Fewest rows a CP rank may hold: every boundary it must send to its right neighbour."""
    need = [model_cfg.attn_sliding_window - 1, 1]
    need += [r - 1 for r in model_cfg.compress_ratios]
    if model_cfg.engram_layer_ids:
        need.append(model_cfg.engram_max_ngram_size - 1)
    return max(need)


GEOMETRY = GeometrySpec(
    config_class=DeepseekV41Geometry, preset_dir=PRESET_DIR, cp_min_rows=required_local_rows
)
