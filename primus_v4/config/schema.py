"""Run configuration: one typed, kw_only dataclass per concern, validated next to its fields.

YAML is data: `loader.py` turns a file (plus `--set` overrides and `${ENV}` references) into a
`RunConfig`, rejecting unknown keys and wrong types. Each section checks its own fields in
`__post_init__`; checks that need two sections live on `RunConfig`; checks that need the world
size or the model preset live in `resolve.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from primus_v4.data.mixing import parse_sources
from primus_v4.data.packing import MAX_SEQ_LENGTH
from primus_v4.errors import ConfigError, DataError


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


# Upper bounds of the run's sizes, far above any real run, so that a typo fails here with its
# name and value, before batches or adapters are allocated (model sizes: SIZE_BOUNDS of the
# model family; data.seq_length: packing.MAX_SEQ_LENGTH).
RUN_SIZE_BOUNDS = {
    "model.lora.rank": 1 << 14,
    "train.micro_batch_size": 1 << 16,
    "train.global_batch_size": 1 << 24,
}


def _bounded(key: str, value: int) -> None:
    bound = RUN_SIZE_BOUNDS[key]
    _require(value <= bound, key, f"{value} is above its bound {bound}")


@dataclass(kw_only=True)
class DataConfig:
    """Where the corpus is and how it becomes rows."""

    path: str | list[Any] = "synthetic"
    """Corpus: a local json/jsonl/parquet file or a directory of them, a hub name[@revision],
    `synthetic`, or a list of sources `{path, format?, weight?, split?, subset?}` mixed by
    weight (a sampling ratio: 3 repeats each row 3 times, 0.5 keeps a seeded half)."""
    format: str = "auto"
    """Row shape: `messages`, `sharegpt`, `alpaca`, `prompt_completion`, or `auto` (detected
    per source from its first rows; the choice is logged)."""
    chat_mode: Literal["chat", "thinking", "auto"] = "auto"
    """DeepSeek-V4 rendering: `chat` (answers open with `</think>`), `thinking` (`<think>`,
    reasoning rendered), `auto` (thinking for a row with any reasoning_content, else chat)."""
    chat_format: Literal["auto", "v4", "v4-0731", "v4.1"] = "auto"
    """Conversation format (rendered by DeepSeek's `deepseek-recipe`): `v4`, `v4-0731` (V4's,
    with 0731's reasoning-effort texts), `v4.1` (`<｜System｜>`, efforts 1-100), or `auto`: the
    format of the run's model (model.pretrained's config.json, else the preset's family)."""
    seq_length: int = 512
    """Tokens per row (pack). Micro-batch rows are always exactly this long."""
    layout: Literal["thd", "bshd"] = "thd"
    """`thd`: many samples packed per row (cu_seqlens); `bshd`: one sample per padded row."""
    algorithm: Literal["ffd", "bfd"] = "ffd"
    """Packer: first-fit-decreasing or best-fit-decreasing (both deterministic)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """Samples longer than seq_length: cut to seq_length, or leave out (counted either way)."""
    tokenizer: str | None = None
    """Tokenizer dir or tokenizer.json; None = the DeepSeek-V4 tokenizer (offline)."""
    strict: bool = False
    """Bad corpus rows, and pictures of more than 8 bits per channel, become an error naming
    file and line instead of being counted."""
    special_tokens_in_text: Literal["keep", "warn", "error"] = "warn"
    """Special-token text inside message content (`<｜Assistant｜>`, `</think>`...), which
    encodes as the special token itself: counted in the pack stats and `keep` (silently),
    `warn` (once per source) or `error` (the corpus is refused, naming the first row)."""
    cache_dir: str | None = None
    """Pack cache directory (node-local by default when None)."""
    lock_dir: str | None = None
    """Node-local directory for the build lock (default when None)."""
    lock_timeout_s: float = 600.0
    """How long a rank waits for another rank on its node to build the cache."""
    eval_path: str | None = None
    """Evaluation corpus (same formats and sources as `path`), packed like the training data;
    None = no separate evaluation corpus."""
    eval_fraction: float = 0.0
    """Fraction of `path`'s rows held out for evaluation before packing (a fixed, seed-independent
    choice; never trained on); 0 = none. Exclusive with eval_path."""

    def __post_init__(self) -> None:
        _require(bool(self.path), "data.path", "must not be empty")
        if isinstance(self.path, list):
            try:
                parse_sources(self.path)
            except DataError as exc:
                raise ConfigError(f"data.path: {exc}") from None
        _require(
            0.0 <= self.eval_fraction < 1.0,
            "data.eval_fraction",
            f"must be in [0, 1), got {self.eval_fraction}",
        )
        _require(
            not (self.eval_path and self.eval_fraction > 0),
            "data.eval_fraction",
            "set either data.eval_path or data.eval_fraction, not both",
        )
        _require(self.seq_length >= 8, "data.seq_length", f"must be >= 8, got {self.seq_length}")
        _require(self.seq_length <= MAX_SEQ_LENGTH, "data.seq_length",
                 f"{self.seq_length} is above its bound {MAX_SEQ_LENGTH} (4x the 1M-token "
                 "context of the V4 releases)")  # fmt: skip
        _require(self.lock_timeout_s > 0, "data.lock_timeout_s", "must be > 0")


LORA_TARGETS = (
    "wq_a", "wq_b", "wkv", "wo_a", "wo_b", "compressor.wkv", "compressor.wgate",
    "shared_experts.w1", "shared_experts.w2", "shared_experts.w3",
    "experts.w1", "experts.w2", "experts.w3",
)  # fmt: skip
"""LoRA targets by the release's module names inside a layer (`layers.N.attn.*`,
`layers.N.ffn.*`): the attention projections, the attention's compressor, the shared and the
routed experts (w1 gate, w3 up, w2 down). The indexer has no backward (it is frozen)."""
LORA_ENGRAM_TARGETS = ("engram.wkv",)
"""Targets of DeepSeek-V4.1 only (`layers.N.engram.wkv`: the Engram rows' key / value
projection; off by default)."""
LORA_VISION_TARGETS = ("vision.wqkv", "vision.wo", "vision.w1", "vision.w2", "aligner.w1",
                       "aligner.w2")  # fmt: skip
"""Targets of DeepSeek-V4.1's image encoder (off by default): every ViT block's fused qkv and
output projection and MLP (`vision.blocks.N.attn.wqkv` / `wo`, `vision.blocks.N.mlp.w1` / `w2`)
and the aligner's two linears. The run's rows must hold images."""
LORA_DEFAULT_TARGETS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts.w1",
                        "shared_experts.w2", "shared_experts.w3", "experts.w1", "experts.w2",
                        "experts.w3")  # fmt: skip


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on named release modules; the base is frozen (rank 0: off)."""

    rank: int = 0
    """Adapter rank r (0 = full fine-tuning, no adapters)."""
    alpha: float = 16.0
    """The update is (alpha / rank) B A x, as PEFT's lora_alpha."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Which modules get adapters, by release name (LORA_TARGETS; DeepSeek-V4.1 also
    LORA_ENGRAM_TARGETS and LORA_VISION_TARGETS)."""
    expert_adapters: Literal["per_expert", "shared"] = "per_expert"
    """Routed experts: one adapter per expert, or one shared by the experts of a rank."""
    base: Literal["bfloat16", "release"] = "bfloat16"
    """How the frozen base is held: decoded into model.dtype (bfloat16), or as the release
    stores it (release: FP8 / FP4 bytes and ue8m0 scales, decoded one weight at a time in the
    forward and backward; Flash's base ~160 GB instead of ~580 GB). A random-init base is
    quantized as a release would store it."""
    allow_random_base: bool = False
    """Adapters need a trained base: with rank > 0 and no model.pretrained the run is refused
    unless this is true (tests and demos on the tiny presets)."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "model.lora.rank", f"must be >= 0, got {self.rank}")
        _bounded("model.lora.rank", self.rank)
        _require(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _require(0.0 <= self.dropout < 1.0, "model.lora.dropout",
                 f"must be in [0, 1), got {self.dropout}")  # fmt: skip
        indexer = sorted(t for t in self.targets if t.startswith("indexer"))
        _require(not indexer, "model.lora.targets",
                 f"{indexer}: the indexer only picks which compressed keys a query attends to "
                 "(a top-k, no gradient passes it), so adapters there could not learn; it stays "
                 "frozen")  # fmt: skip
        known = LORA_TARGETS + LORA_ENGRAM_TARGETS + LORA_VISION_TARGETS
        unknown = sorted(set(self.targets) - set(known))
        _require(not unknown, "model.lora.targets",
                 f"unknown {unknown}; choose from {list(known)}")  # fmt: skip
        _require(bool(self.targets) or not self.rank, "model.lora.targets",
                 "must name at least one module when model.lora.rank > 0")  # fmt: skip
        _require(len(set(self.targets)) == len(self.targets), "model.lora.targets",
                 f"names a module twice: {self.targets}")  # fmt: skip

    @property
    def keeps_release(self) -> bool:
        """Whether the frozen base is held as the release stores it (adapters on, base
        `release`): the one place this rule is written."""
        return self.rank > 0 and self.base == "release"


@dataclass(kw_only=True)
class EngramConfig:
    """Where a DeepSeek-V4.1 model's Engram tables live (other families have none)."""

    trainable: bool = False
    """False: the tables stay frozen in their release encoding (FP8 e4m3 + an e8m0 scale per
    32 values of a row); True: they train (decoded into model.dtype, with optimizer state for
    the rows a rank holds)."""
    placement: Literal["replicated", "sharded", "host"] = "replicated"
    """`replicated`: every rank holds whole tables; `sharded`: each rank of the data-parallel
    group holds 1/n of every table's rows and a step fetches from their owners only the rows
    its packs hash to; `host`: the tables stay in host memory and a step copies its rows to
    the device."""

    def __post_init__(self) -> None:
        _require(
            not (self.trainable and self.placement == "host"),
            "model.engram.placement",
            "host holds frozen tables only; a trainable Engram is replicated or sharded",
        )


@dataclass(kw_only=True)
class DraftConfig:
    """Training DeepSeek-V4.1's DSpark drafter, the release's speculative-decoding draft
    stages (`mtp.*`; other families have none to train)."""

    train: Literal["off", "joint", "only"] = "off"
    """`off`: the drafter is carried byte for byte, as released; `joint`: the SFT step also
    trains it (its own loss, logged apart; its gradients reach only the drafter); `only`: the
    backbone is frozen (forward only: no gradients, optimizer state or checkpoint bytes) and
    the drafter trains, e.g. to refresh it after a fine-tune."""
    weight: float = 1.0
    """Weight of the draft objective (a mean over the step's draft target slots) in the loss."""
    anchor_rate: float = 0.0625
    """Share of the supervised rows that anchor a draft block (chosen by a hash of each
    sample's own tokens under train.seed: the same however the samples are packed)."""
    kl: float = 1.0
    """Weight of KL(backbone || draft) beside the cross entropy to the data token (weight 1)."""
    confidence: float = 0.1
    """Weight of the confidence head's loss against the greedy acceptance it predicts."""
    decay: float = 1.0
    """Slot i of a block weighs decay**i (later slots count less below 1)."""

    def __post_init__(self) -> None:
        _require(self.weight > 0, "model.draft.weight", f"must be > 0, got {self.weight}")
        _require(0 < self.anchor_rate <= 1, "model.draft.anchor_rate",
                 f"must be in (0, 1], got {self.anchor_rate}")  # fmt: skip
        _require(0 < self.decay <= 1, "model.draft.decay", f"must be in (0, 1], got {self.decay}")
        for key in ("kl", "confidence"):
            value = getattr(self, key)
            _require(value >= 0, f"model.draft.{key}", f"must be >= 0, got {value}")


@dataclass(kw_only=True)
class VisionConfig:
    """Which parts of DeepSeek-V4.1's image encoder a run with images trains."""

    train: Literal["frozen", "aligner", "all"] = "frozen"
    """`frozen` (the default): the release's encoder fills the image spans as released and only
    the language model learns; it holds no gradients or optimizer state, is in no checkpoint,
    and an export carries its tensors byte for byte. The released tower was trained on far more
    pictures than a fine-tuning corpus holds, and training it on a few thousand forgets that
    while its ~0.5B parameters (9 ViT patches per image token) cost gradients, optimizer state
    and activations. `aligner`: the aligner and the span vectors (the bridge into the language
    model, the part LLaVA-style recipes adapt first) train as parameters of the model,
    checkpointed and exported in BF16 as released; the tower stays frozen. `all`: the tower
    trains too."""


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to build."""

    family: str | None = None
    """The model family (`deepseek_v4`); None = the preset's, or the `model_type` of the
    `pretrained` release's config.json (which must agree with it when both are given)."""
    preset: str | None = None
    """A shipped preset (`primus-v4 inspect presets`; primus_v4/configs/models/<preset>.yaml,
    DeepseekV4Config fields); None = `tiny`. With `pretrained` the release's config.json is the
    model and a preset is ignored (one INFO line), or refused when of another family."""
    pretrained: str | None = None
    """A released checkpoint directory (config.json + safetensors, e.g. DeepSeek-V4-Flash) to
    start from: the model config comes from its config.json and each rank loads only its own
    stage's and experts' weights. A resumable checkpoint in checkpoint.dir takes precedence."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """DeepseekV4Config fields that win over the preset (or the pretrained config.json), e.g.
    {num_layers: 2} or training knobs such as recompute."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and activation dtype (float32 on CPU; bfloat16 on GPUs)."""
    fused_linear_ce: bool = True
    """Chunked LM-head + cross-entropy: the [S, vocab] logits are never materialized."""
    lm_head_rows: Literal["supervised", "all"] = "supervised"
    """LM head + CE on supervised rows only (exact: other rows add zero) or on all rows, as a
    conventional trainer does (same loss and grads, more work; for cost comparisons)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in backward. `none`: autograd keeps what it saves; `selective`: the
    parts in recompute_modules rerun in backward (their gradients are the same bits);
    `full`: every decoder layer and MTP depth reruns whole from its input streams (one more
    forward of the layers per step). `primus-v4 inspect memory` shows what each choice plans."""
    recompute_modules: list[str] | None = None
    """With recompute selective: which parts each layer reruns, any of `layernorm` (mHC
    collapse + RMSNorm before attention and MoE), `mla_up_proj` (query up-projection, its norm
    and RoPE), `core_attn` (sparse attention and the output-group split), `shared_experts`,
    `moe` (the whole MoE); None = [layernorm, mla_up_proj, core_attn]."""
    engram: EngramConfig = field(default_factory=EngramConfig)
    """DeepSeek-V4.1's Engram tables: frozen or trainable, and where they are held."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """DeepSeek-V4.1's DSpark drafter: carried (off), trained with the fine-tune (joint) or
    alone on a frozen backbone (only)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """DeepSeek-V4.1's image encoder: frozen (default), or its aligner (and tower) trained."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA fine-tuning (model.lora.rank > 0): adapters on the named modules, the base frozen;
    only adapters get gradients, optimizer state and checkpoint bytes."""
    router_bias_update_rate: float = 0.0
    """DeepSeek-V3-style update of the routed layers' gate.bias after each optimizer step:
    b_e += rate * sign(mean_load - load_e) on the step's global expert loads (0 = off, the
    bias stays the checkpoint's; the Flash recipes set 1e-3)."""

    def __post_init__(self) -> None:
        _require(self.router_bias_update_rate >= 0, "model.router_bias_update_rate", "must be >= 0")
        _require(
            self.recompute_modules is None or self.recompute == "selective",
            "model.recompute_modules",
            f"applies to model.recompute: selective only (got recompute={self.recompute!r})",
        )
        _require(self.pretrained != "", "model.pretrained", "must not be empty (or leave unset)")
        _require(
            not (self.engram.trainable and self.lora.rank > 0),
            "model.engram.trainable",
            f"true with model.lora.rank={self.lora.rank}: LoRA freezes the base, Engram tables "
            "included; train adapters (model.lora.targets may name engram.wkv) or the tables, "
            "not both",
        )
        _require(
            self.vision.train == "frozen" or self.lora.rank == 0,
            "model.vision.train",
            f"{self.vision.train} with model.lora.rank={self.lora.rank}: LoRA freezes the base, "
            "the image encoder included; train adapters or the encoder's parts, not both",
        )
        _require(
            self.draft.train == "off" or self.lora.rank == 0,
            "model.draft.train",
            f"{self.draft.train} with model.lora.rank={self.lora.rank}: a LoRA run carries the "
            "drafter as released; train it in full (joint) or alone (only) without adapters",
        )


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout. world = pp x cp x dp; experts: world = pp x ep x etp x edp (megatron)."""

    tp: int = 1
    """Tensor parallel: deliberately absent, must be 1."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context parallel ranks: each holds a contiguous 1/cp of every pack."""
    ep: int = 1
    """Expert parallel ranks (experts split over ep; laid out over dp x cp, independent of cp)."""
    etp: int = 1
    """Expert tensor parallel: absent like tp, must be 1."""
    pp_layout: str | None = None
    """Megatron-style stage layout (`E` embedding, `t` layer, `m` MTP, `L` loss, `|` stage
    boundary, `t*14` repeats), e.g. `Et*14|t*14|t*15mL`; None = an even split."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for its peers before it fails (every process group's
    timeout). A hung collective then ends the worker with an error, which torchrun's elastic
    agent turns into a restart from the newest checkpoint; keep it well under the scheduler's
    own limits (job time, liveness probes) and above the slowest legitimate wait (a checkpoint
    save, the first step's compilation)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            _require(value >= 1, f"parallel.{name}", f"must be >= 1, got {value}")
        _require(
            self.collective_timeout_s > 0,
            "parallel.collective_timeout_s",
            f"must be > 0 seconds, got {self.collective_timeout_s}",
        )
        _require(
            self.tp == 1,
            "parallel.tp",
            f"tensor parallelism is deliberately absent (got tp={self.tp}; use 1): the single "
            "KV latent, the indexer scores and the compressed pools have no head axis worth "
            "sharding, so long context scales with parallel.cp and experts with parallel.ep",
        )
        _require(
            self.etp == 1,
            "parallel.etp",
            f"expert tensor parallelism is absent like tp (got etp={self.etp}; use 1): experts "
            "scale with parallel.ep",
        )
        if self.pp_layout is not None:
            stages = self.pp_layout.count("|") + 1
            _require(
                stages == self.pp,
                "parallel.pp_layout",
                f"{self.pp_layout!r} has {stages} stages but parallel.pp is {self.pp}",
            )


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW details (the schedule numbers are in `train`)."""

    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    offload_fraction: float = 0.0
    """Fraction of the optimizer state (and its update) kept in host memory, in [0, 1]."""
    grad_reduce_dtype: Literal["float32", "float64"] = "float32"
    """dtype the gradients are accumulated over micro-batches and summed over replicas in, before
    the fp32 step. float64 makes the sums independent of how micro-batches are split over DP
    ranks (dp=N gives the same bits as dp=1, e.g. for parity checks) for 2x the gradient-buffer
    and reduce-scatter bytes; float32 keeps the sums AdamW always got (training/optim/zero.py)."""
    grad_accum_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the full-size buffers the micro-batches' gradients add into. bfloat16 (bf16
    models, grad_reduce_dtype float32) halves them: each bucket is upcast to float32 to be
    summed over replicas (one float32 reduce-scatter per bucket) or, without replicas, after
    backward for the step; each added micro-batch rounds the running sum to bf16 once."""

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"optim.{name}", f"must be in [0, 1), got {value}")
        _require(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        _require(
            0.0 <= self.offload_fraction <= 1.0,
            "optim.offload_fraction",
            f"must be in [0, 1], got {self.offload_fraction}",
        )
        _require(
            self.grad_accum_dtype == "float32" or self.grad_reduce_dtype == "float32",
            "optim.grad_accum_dtype",
            f"bfloat16 accumulation reduces in float32; grad_reduce_dtype is "
            f"{self.grad_reduce_dtype}",
        )


@dataclass(kw_only=True)
class TrainConfig:
    """Steps, batch and learning-rate schedule."""

    steps: int | None = 30
    """Optimizer steps to run; null when `epochs` sets the length instead."""
    epochs: float | None = None
    """Passes over the packed corpus instead of `steps` (exactly one of the two is set): steps =
    ceil(epochs x rows per epoch / global_batch_size), rows = packs (thd) or samples (bshd)."""
    seed: int = 1234
    """Seeds model init and data order: two runs with the same seed log the same numbers."""
    global_batch_size: int = 2
    """Rows per optimizer step over all data-parallel ranks (thd: packs; bshd: samples)."""
    micro_batch_size: int = 1
    """Rows per forward; 1 for thd (a pack already holds many samples)."""
    lr: float = 5e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 5e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 3
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""
    nan_policy: Literal["error", "skip"] = "error"
    """Non-finite loss or gradient: stop with an error naming the step, or skip the step."""
    quant_aware: Literal["none", "release"] = "none"
    """`release`: quantization-aware training in the release's own formats: every weight the
    release stores FP8 / FP4 is used in the forward and backward as the release stores it
    (quantized by the export's own rule, decoded), its gradient passed straight through to the
    full-precision weight, so `export --dtype fp8` writes the weights the run trained against.
    bf16 / fp32 weights of the release train as with `none`. With LoRA (`model.lora.base:
    release`, no dropout) each adapted weight is used merged and rounded, Q(W + (alpha / r) B A),
    so the merged FP8 / FP4 export is the model that trained."""
    shuffle: bool = True
    """Shuffle pack order each epoch (seeded); False keeps the packer's order."""
    eval_interval: int = 0
    """Evaluate every this many steps (and always after the last step) when data.eval_path or
    data.eval_fraction is set; 0 = only after the last step."""
    ignore_memory_plan: bool = False
    """Launch even when the memory plan (`primus-v4 inspect memory`) puts a pipeline stage over
    the device's memory; by default such a launch (and a dry run given --device-memory) stops
    with one line naming the stage."""

    def __post_init__(self) -> None:
        _require(
            (self.steps is None) != (self.epochs is None),
            "train.steps",
            f"set exactly one of train.steps and train.epochs (got steps={self.steps}, "
            f"epochs={self.epochs}); e.g. --set train.steps=null --set train.epochs=2",
        )
        if self.steps is not None:
            _require(self.steps >= 1, "train.steps", f"must be >= 1, got {self.steps}")
        if self.epochs is not None:
            _require(self.epochs > 0, "train.epochs", f"must be > 0, got {self.epochs}")
        _require(
            self.global_batch_size >= 1,
            "train.global_batch_size",
            f"must be >= 1, got {self.global_batch_size}",
        )
        _require(
            self.micro_batch_size >= 1,
            "train.micro_batch_size",
            f"must be >= 1, got {self.micro_batch_size}",
        )
        _bounded("train.micro_batch_size", self.micro_batch_size)
        _bounded("train.global_batch_size", self.global_batch_size)
        _require(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _require(
            0 <= self.min_lr <= self.lr,
            "train.min_lr",
            f"must be in [0, train.lr={self.lr}], got {self.min_lr}",
        )
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _require(self.clip_grad >= 0, "train.clip_grad", "must be >= 0 (0 disables clipping)")
        _require(self.eval_interval >= 0, "train.eval_interval", "must be >= 0 (0 = at the end)")


@dataclass(kw_only=True)
class OutputConfig:
    """Where a run writes config.yaml, metrics.jsonl and loss.png."""

    dir: str = "outputs/tiny_cpu_thd"
    """Run directory (created). One run writes it at a time (locked while it runs); one that
    holds another run's config.yaml or metrics.jsonl is refused unless this run resumes that
    one (same checkpoint.dir) or output.overwrite is true."""
    overwrite: bool = False
    """Start over another run's outputs in dir: its metrics.jsonl, loss.png and tracker dirs are
    removed first (never its checkpoints)."""
    progress_bar: bool = True
    """tqdm bar on rank 0 (stderr)."""
    plot: bool = True
    """Write loss.png (loss, eval loss, grad norm and lr vs step) at the end."""
    tracker: Literal["none", "tensorboard", "wandb", "mlflow"] = "none"
    """Also send the run to an experiment tracker (rank 0 only): the metrics.jsonl scalars at
    every step, the resolved config as the run's parameters, loss.png and metrics.jsonl as
    artifacts. tensorboard: event files under <dir>/tensorboard; wandb: a run under <dir>/wandb;
    mlflow: a run of experiment tracker_project. Each needs its extra, e.g. pip install
    'primus_v4[wandb]'."""
    tracker_mode: Literal["offline", "online"] = "offline"
    """offline: nothing leaves the machine (wandb's offline mode, to `wandb sync` later; mlflow's
    file store under <dir>/mlruns). online: wandb uploads (WANDB_API_KEY); mlflow logs to
    MLFLOW_TRACKING_URI, which must be set."""
    tracker_project: str = "primus_v4"
    """The wandb project or mlflow experiment; the run is named after the last part of dir."""
    tensorboard: bool = False
    """Older spelling of tracker: tensorboard (true sets it; with another tracker it is an
    error)."""

    def __post_init__(self) -> None:
        _require(bool(self.dir), "output.dir", "must not be empty")
        _require(bool(self.tracker_project), "output.tracker_project", "must not be empty")
        if self.tensorboard:
            _require(
                self.tracker in ("none", "tensorboard"),
                "output.tensorboard",
                f"true asks for tensorboard but output.tracker is {self.tracker}; set "
                "output.tracker=tensorboard and drop output.tensorboard",
            )
            self.tracker = "tensorboard"


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming (torch.distributed.checkpoint)."""

    dir: str | None = None
    """Checkpoint directory; None disables checkpoints."""
    interval: int = 0
    """Save every this many steps (and at the end); 0 = only at the end."""
    resume: bool = True
    """Resume from the newest intact checkpoint in dir when there is one (a damaged newer one is
    reported by file and skipped). The model and pp/cp/ep sizes must match the saved run; a
    changed schedule (steps, lr, min_lr, warmup) is allowed and applies from the resumed step.
    False: start from scratch, into a dir that holds no checkpoints (else an error: two runs
    in one dir would mix)."""
    keep_last: int = 3
    """Keep the newest this many complete checkpoints; older ones are deleted once a newer one is
    published (never the one just saved, nor the one `latest` names). 0 keeps all."""

    def __post_init__(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval", "must be >= 0 (0 = only at the end)")
        _require(self.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0 keeps all)")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "output": OutputConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass(kw_only=True)
class RunConfig:
    """A whole run: one field per section. Cross-section rules are checked here."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.data.layout == "thd":
            _require(
                self.train.micro_batch_size == 1,
                "train.micro_batch_size",
                f"must be 1 with data.layout=thd (got {self.train.micro_batch_size}): a pack "
                "already holds many samples; raise train.global_batch_size to accumulate more",
            )
        _require(
            self.train.steps is None or self.train.warmup_steps <= self.train.steps,
            "train.warmup_steps",
            f"{self.train.warmup_steps} exceeds train.steps={self.train.steps}",
        )
        _require(
            self.optim.grad_accum_dtype == "float32" or self.model.dtype == "bfloat16",
            "optim.grad_accum_dtype",
            "bfloat16 gradient buffers need model.dtype bfloat16 (float32 parameters have "
            "float32 gradients)",
        )
        _require(
            self.data.seq_length % self.parallel.cp == 0,
            "data.seq_length",
            f"{self.data.seq_length} must be divisible by parallel.cp={self.parallel.cp} "
            "(each CP rank holds a contiguous equal slice of every pack)",
        )

    @property
    def packed(self) -> bool:
        return self.data.layout == "thd"
