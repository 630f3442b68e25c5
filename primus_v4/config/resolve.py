"""Checks that need more than the config file: the world size (from the launcher) and the model.

Layout (megatron-core, tp = etp = 1):
  dense ranks:  world = pp x cp x dp
  expert ranks: world = pp x ep x edp, independent of cp (ep spans dp x cp ranks)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus_v4.config.schema import RunConfig
from primus_v4.data import chat_format
from primus_v4.data.pipeline import PackSpec
from primus_v4.data.tokenizer import resolve_tokenizer_dir
from primus_v4.errors import CheckpointFormatError, ConfigError, DataError
from primus_v4.log import get_logger
from primus_v4.models import (
    DEFAULT_FAMILY,
    check_family,
    model_geometry,
    model_spec,
    presets,
    release_family,
    spec_of,
)
from primus_v4.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from primus_v4.models.model_spec import GeometrySpec, ModelSpec

log = get_logger(__name__)


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} is not an integer") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1")
    return world


def parallel_sizes(cfg: RunConfig, world: int) -> ParallelDims:
    """The run's group sizes (`ParallelDims` derives and checks dp and expert-dp: the one place
    that rule is written) and the batch they must divide; errors name the numbers that
    disagree."""
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size {world!r} (WORLD_SIZE or --world-size {world}) must be >= 1")
    p = cfg.parallel
    dims = ParallelDims(world=world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp)
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if gbs % (mbs * dims.dp):
        raise ConfigError(
            f"train.global_batch_size={gbs} must be divisible by train.micro_batch_size x dp = "
            f"{mbs} x {dims.dp} = {mbs * dims.dp}"
        )
    return dims


# Model sizes that must be positive integers: a 0 or a negative one otherwise ends in a division
# by zero or a math domain error inside the build, or passes --dry-run and fails in the optimizer.
POSITIVE_SIZES = (
    "num_layers", "hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size",
    "q_lora_rank", "o_groups", "o_lora_rank", "num_moe_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "index_n_heads",
    "index_head_dim", "index_topk", "index_topk_chunk", "attn_sliding_window", "hc_mult",
    "hc_sinkhorn_iters", "vocab_size", "ce_chunk_size",
)  # fmt: skip
NON_NEGATIVE_SIZES = ("mtp_num_layers", "num_hash_layers", "qk_pos_emb_head_dim")


def _model_defaults(spec: ModelSpec | GeometrySpec, preset: str | None) -> dict[str, Any]:
    """The value each model field has before overrides: the preset file's, else the default."""
    import yaml

    fields = dataclasses.fields(spec.config_class)
    out = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    path = spec.preset_dir / f"{preset}.yaml" if preset is not None else None
    if path is not None and path.is_file():
        out.update(yaml.safe_load(path.read_text()) or {})
        out.pop("family", None)
    return out


@contextmanager
def _reading_release(directory: str) -> Iterator[None]:
    """A failure to read a release's config.json as one CheckpointFormatError naming it."""
    try:
        yield
    except FileNotFoundError as exc:
        raise CheckpointFormatError(f"model.pretrained: {exc}") from None
    except OSError as exc:
        raise CheckpointFormatError(
            f"model.pretrained={directory}: cannot read {exc.filename} ({exc.strerror})"
        ) from None
    except (CheckpointFormatError, ConfigError, TypeError, ValueError, AssertionError,
            ArithmeticError) as exc:  # fmt: skip
        raise CheckpointFormatError(f"model.pretrained={directory}: {exc}") from None


def model_family(cfg: RunConfig) -> str:
    """The run's model family: the release's config.json `model_type` with `model.pretrained`,
    else `model.family`; both given must agree."""
    named = cfg.model.family
    if named is not None:
        try:
            check_family(named)
        except ConfigError as exc:
            raise ConfigError(f"model.family: {exc}") from None
    if cfg.model.pretrained is None:
        preset = cfg.model.preset or "tiny"
        found = presets().get(preset, named or DEFAULT_FAMILY)
        if named is not None and named != found:
            raise ConfigError(
                f"model.family: {named!r} conflicts with model.preset={preset!r} (a {found!r} "
                "preset); drop model.family or pick a preset of that family"
            )
        return found
    with _reading_release(cfg.model.pretrained):
        found = release_family(cfg.model.pretrained)
    preset = cfg.model.preset
    preset_family = presets().get(preset, found) if preset is not None else found
    if preset_family != found:
        raise ConfigError(
            f"model.preset: {preset!r} is a {preset_family!r} preset and model.pretrained="
            f"{cfg.model.pretrained} a {found!r} release (config.json model_type); the release "
            "is the model: drop model.preset"
        )
    if named is not None and named != found:
        raise ConfigError(
            f"model.family: {named!r} conflicts with model.pretrained={cfg.model.pretrained} "
            f"(config.json model_type {found!r}); drop model.family"
        )
    return found


def _expected_type(value: Any) -> tuple[type, ...] | None:
    for kind, accepted in ((bool, (bool,)), (int, (int,)), (float, (int, float)), (str, (str,)),
                           (list, (list,))):  # fmt: skip
        if isinstance(value, kind):
            return accepted
    return None


def check_overrides(overrides: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Each `model.overrides` value has its field's type, and a size is in range: one line per
    key, before the model config is built from them."""
    for key, value in overrides.items():
        where = f"model.overrides.{key}"
        if key in POSITIVE_SIZES or key in NON_NEGATIVE_SIZES:
            low = 1 if key in POSITIVE_SIZES else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(
                    f"{where}: must be an integer >= {low} (a model size), got {value!r}"
                )
            continue
        accepted = _expected_type(defaults.get(key))
        if value is None or accepted is None:
            continue
        if not isinstance(value, accepted) or (bool not in accepted and isinstance(value, bool)):
            raise ConfigError(
                f"{where}: expected {accepted[-1].__name__} like the model's "
                f"{defaults[key]!r}, got {type(value).__name__} {value!r}"
            )


def model_config(cfg: RunConfig, *, geometry: bool = False) -> Any:
    """The model preset with `model.overrides` and `model.*` applied (errors name the key).
    `geometry`: the family's torch-free geometry (models/model_spec.GeometrySpec) where it holds
    every field the run sets, checked alike (what builds no model reads no more); otherwise, and
    always with `model.pretrained`, the model config itself."""
    # torch (megatron, the model) loads only when a model config is asked for: `pack` and
    # config validation stay torch-free
    family = model_family(cfg)
    light = geometry and _geometry_holds(cfg, model_geometry(family))
    spec = model_geometry(family) if light else model_spec(family)
    preset = None if cfg.model.pretrained is not None else (cfg.model.preset or "tiny")
    check_overrides(cfg.model.overrides, _model_defaults(spec, preset))
    overrides = dict(cfg.model.overrides)
    if not cfg.model.fused_linear_ce:
        # One CE chunk spanning the whole row: the [S, vocab] logits exist at once (unfused).
        overrides.setdefault("ce_chunk_size", cfg.data.seq_length)
    overrides.setdefault("lm_head_rows", cfg.model.lm_head_rows)
    _recompute_overrides(cfg, overrides)
    _training_overrides(cfg, overrides)
    if cfg.model.dtype == "bfloat16" and not light:  # the geometry holds no dtype
        import torch

        overrides.setdefault("bf16", True)
        overrides.setdefault("params_dtype", torch.bfloat16)
    if cfg.model.pretrained is not None:
        return pretrained_model_config(spec, cfg.model.pretrained, overrides)
    assert preset is not None
    try:
        return spec.config_class.preset(preset, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"model.preset / model.overrides: {exc}") from None
    except (TypeError, ValueError, AssertionError, ArithmeticError) as exc:
        raise ConfigError(
            f"model.overrides {sorted(cfg.model.overrides)} on preset {preset!r} give "
            f"an invalid model: {exc}"
        ) from None


def _geometry_holds(cfg: RunConfig, geometry: GeometrySpec) -> bool:
    """Whether the family's geometry has every field the run's model config sets (a preset's
    fields, `model.overrides`), so that it checks what the model config would."""
    fields = {f.name for f in dataclasses.fields(geometry.config_class)}
    return cfg.model.pretrained is None and set(cfg.model.overrides) <= fields


def _recompute_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> None:
    """`model.recompute` as the model config's (Megatron-named) recompute fields."""
    choice = cfg.model.recompute
    if choice == "none":
        return
    given = overrides.get("recompute_granularity")
    if given not in (None, choice):
        raise ConfigError(
            f"model.recompute={choice!r} conflicts with model.overrides.recompute_granularity="
            f"{given!r}; set one of them"
        )
    overrides["recompute_granularity"] = choice
    if choice == "full":  # every layer, one at a time (Megatron: uniform, 1 layer per unit)
        overrides.setdefault("recompute_method", "uniform")
        overrides.setdefault("recompute_num_layers", 1)
    elif cfg.model.recompute_modules is not None:
        overrides["recompute_modules"] = list(cfg.model.recompute_modules)


def _training_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> None:
    """The model config's training fields of the drafter (`model.draft`) and the image encoder
    (`model.vision`, LoRA targets on it)."""
    overrides.update(draft_overrides(cfg))
    overrides.update(vision_overrides(cfg))


def vision_held(cfg: RunConfig) -> tuple[str, str]:
    """(which parts of the image encoder the model holds as its own modules: `frozen` none,
    `aligner`, `all`; the setting that asks for them, in words): `model.vision.train`, or LoRA
    targets on them (`model.lora.targets` vision.* / aligner.*: adapters on a frozen base)."""
    lora = cfg.model.lora
    targets = [t for t in lora.targets if t.startswith(("vision.", "aligner."))]
    targets = targets if lora.rank else []
    if targets:
        held = "all" if any(t.startswith("vision.") for t in targets) else "aligner"
        return held, f"model.lora.targets {targets}"
    return cfg.model.vision.train, f"model.vision.train={cfg.model.vision.train}"


def vision_overrides(cfg: RunConfig) -> dict[str, Any]:
    """The image encoder's parts the model holds (`vision_held`) as the model config's
    `vision_train` (set only when it holds any, so a family without one is refused by
    `check_vision` in words)."""
    held, _ = vision_held(cfg)
    return {} if held == "frozen" else {"vision_train": held}


def check_vision(cfg: RunConfig, sizes: ParallelDims, family: str) -> None:
    """`model.vision.train` aligner / all, or LoRA targets on the image encoder: DeepSeek-V4.1
    from a release (whose encoder the run trains), one pipeline stage and context rank (as rows
    with images); data parallel works."""
    train, where = vision_held(cfg)
    if train == "frozen":
        return
    if family != "deepseek_v41":
        raise ConfigError(f"{where}: the {family} family has no image encoder (DeepSeek-V4.1's);"
                          " leave it frozen")  # fmt: skip
    if cfg.model.pretrained is None:
        raise ConfigError(f"{where} trains the release's image encoder: set model.pretrained to "
                          "a DeepSeek-V4.1 release with a vision tower")  # fmt: skip
    over = {k: v for k, v in {"pp": sizes.pp, "cp": sizes.cp}.items() if v > 1}
    if over:
        named = ", ".join(f"parallel.{k}={v}" for k, v in over.items())
        raise ConfigError(
            f"{where}: rows with images train on one process or data parallel "
            f"for now ({named}); set those to 1 or leave the image encoder frozen"
        )


def draft_overrides(cfg: RunConfig) -> dict[str, Any]:
    """`model.draft` as the model config's `dspark_*` training fields (set only when the drafter
    trains, so a family without a drafter is refused by `check_draft` in words)."""
    draft = cfg.model.draft
    if draft.train == "off":
        return {}
    return dict(
        dspark_train=draft.train,
        dspark_loss_weight=draft.weight,
        dspark_anchor_rate=draft.anchor_rate,
        dspark_anchor_seed=cfg.train.seed,
        dspark_kl_weight=draft.kl,
        dspark_confidence_weight=draft.confidence,
        dspark_decay=draft.decay,
    )


def check_draft(cfg: RunConfig, sizes: ParallelDims, family: str, model: Any = None) -> None:
    """`model.draft.train` joint / only: a family with a drafter to train, packed rows, one
    pipeline stage, context and expert rank (those axes come later); data parallel works."""
    train = cfg.model.draft.train
    if train == "off":
        return
    where = f"model.draft.train={train}"
    if family != "deepseek_v41":
        carried = model is not None and getattr(model, "dspark", None)
        why = (
            "DeepSeek-V4-Flash-0731's DSpark stages (markov_head.markov_w1/w2, hc_head_fn) have "
            "no public reference to train them against: they are carried byte for byte"
            if carried
            else f"the {family} family has no DSpark drafter (DeepSeek-V4.1's)"
        )
        raise ConfigError(f"{where}: {why}; set model.draft.train=off")
    if not cfg.packed:
        raise ConfigError(
            f"{where} needs data.layout=thd: the drafter reads the sample boundaries "
            "(cu_seqlens) of packed rows"
        )
    axes = {"pp": sizes.pp, "cp": sizes.cp, "ep": sizes.ep}
    over = {k: v for k, v in axes.items() if v > 1}
    if over:
        named = ", ".join(f"parallel.{k}={v}" for k, v in over.items())
        raise ConfigError(
            f"{where} runs with data parallelism only for now ({named}); set those to 1 or "
            "model.draft.train=off"
        )


def check_quant_aware(cfg: RunConfig) -> None:
    """`train.quant_aware: release`: full fine-tuning, or LoRA on the base kept as released (the
    merge is what is rounded) with no adapter dropout (the merged weight has none); refused in
    one line otherwise."""
    if cfg.train.quant_aware == "none":
        return
    where = f"train.quant_aware={cfg.train.quant_aware}"
    lora = cfg.model.lora
    if lora.rank and lora.base != "release":
        raise ConfigError(f"{where} with model.lora.rank={lora.rank} needs model.lora.base="
                          "release: the adapters train against the merged weight rounded as "
                          f"the release stores it, over the base as released (model.lora.base="
                          f"{lora.base})")  # fmt: skip
    if lora.rank and lora.dropout:
        raise ConfigError(f"{where} with model.lora.dropout={lora.dropout}: the merged weight "
                          "the served model uses has no adapter dropout; set "
                          "model.lora.dropout=0")  # fmt: skip


def pretrained_model_config(spec: ModelSpec, directory: str, overrides: dict[str, Any]) -> Any:
    """The model config of a released checkpoint (its config.json), overrides applied."""
    read_config = spec.release.read_config
    # the release's own config.json first: a problem there is the release's
    with _reading_release(directory):
        read_config(directory)
    try:
        return read_config(directory, **overrides)
    except (ConfigError, TypeError, ValueError, AssertionError, ArithmeticError) as exc:
        raise ConfigError(f"model.pretrained={directory!r} / model.overrides: {exc}") from None


CHAT_FORMATS = {"deepseek_v4": "v4", "deepseek_v41": "v4.1"}
"""model family -> the conversation format of its releases (V4-0731 is told by its config.json)."""


def chat_format_of(cfg: RunConfig) -> str:
    """data.chat_format, `auto` resolved from the run's model: model.pretrained's config.json
    (model_type, V4-0731's dspark_* keys), else the family of the preset; V4.1's format not on
    a DeepSeek-V4 tokenizer (V4's tokens, not V4.1's: V4.1's preset on the bundled tokenizer,
    or the export of such a run, which carries it: v4)."""
    if cfg.data.chat_format != "auto":
        return cfg.data.chat_format
    found = None
    if cfg.model.pretrained is not None:
        found = chat_format.release_format(Path(cfg.model.pretrained))
    found = found or CHAT_FORMATS.get(model_family(cfg), "v4")
    if found == "v4.1":
        tokenizer = tokenizer_of(cfg)
        if tokenizer is None:
            log.info("data.chat_format auto: v4 (the bundled DeepSeek-V4 tokenizer has no V4.1 "
                     "tokens; set data.tokenizer to V4.1's, or model.pretrained to a V4.1 "
                     "release, for v4.1)")  # fmt: skip
            return "v4"
        if chat_format.tokenizer_format(resolve_tokenizer_dir(tokenizer)) == "v4":
            log.info("data.chat_format auto: v4 (tokenizer %s is DeepSeek-V4's, without V4.1's "
                     "tokens; set data.tokenizer to V4.1's for v4.1)", tokenizer)  # fmt: skip
            return "v4"
    return found


def tokenizer_of(cfg: RunConfig) -> str | None:
    """data.tokenizer, else the pretrained checkpoint's tokenizer.json, else None (DeepSeek's)."""
    if cfg.data.tokenizer is not None or cfg.model.pretrained is None:
        return cfg.data.tokenizer
    own = Path(cfg.model.pretrained) / "tokenizer.json"
    return str(own.parent) if own.is_file() else None


def pack_spec(cfg: RunConfig, *, split: str | None = None) -> PackSpec:
    """What the data pipeline packs and caches (checked here; nothing is read or built).
    `split="eval"`: the evaluation corpus (data.eval_path, or data.path's held-out rows)."""
    d = cfg.data
    path, holdout = d.path, d.eval_fraction
    if split == "eval" and d.eval_path:
        path, split, holdout = d.eval_path, "all", 0.0
    elif holdout == 0:
        split = "all"
    else:
        split = split or "train"  # the training corpus is what is not held out
    try:
        return PackSpec(
            data=path,
            holdout_fraction=holdout,
            split=split,
            format=d.format,
            chat_mode=d.chat_mode,
            chat_format=chat_format_of(cfg),
            seed=cfg.train.seed,
            seq_length=d.seq_length,
            algorithm=d.algorithm,
            overlong=d.overlong,
            tokenizer=tokenizer_of(cfg),
            strict=d.strict,
            special_tokens_in_text=d.special_tokens_in_text,
            cache_dir=d.cache_dir,
            lock_dir=d.lock_dir,
            lock_timeout_s=d.lock_timeout_s,
            knobs="config",
        )
    except DataError as exc:
        raise ConfigError(f"data: {exc}") from None


def train_steps(cfg: RunConfig, rows_per_epoch: int) -> int:
    """`train.steps`, or the steps `train.epochs` passes over `rows_per_epoch` rows take."""
    t = cfg.train
    if t.steps is not None:
        return t.steps
    assert t.epochs is not None  # the schema requires exactly one of the two
    steps = max(1, math.ceil(t.epochs * rows_per_epoch / t.global_batch_size))
    if t.warmup_steps > steps:
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps} exceeds the {steps} steps of train.epochs="
            f"{t.epochs:g} ({rows_per_epoch} rows per epoch, global batch {t.global_batch_size})"
        )
    return steps


def check_model_fits(cfg: RunConfig, sizes: ParallelDims, model: Any) -> None:
    """Model-dependent parallel checks (`ParallelDims.check_model`): layers per pipeline stage,
    experts per EP rank, rows per CP rank."""
    sizes.check_model(
        num_layers=model.num_layers,
        num_experts=model.num_moe_experts,
        pp_layout=cfg.parallel.pp_layout,
        mtp_num_layers=model.mtp_num_layers or 0,
        seq_length=cfg.data.seq_length,
        cp_min_rows=model_geometry(getattr(model, "family", DEFAULT_FAMILY)).cp_min_rows(model),
    )


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """A config checked against the world size and the model, ready to run."""

    cfg: RunConfig
    sizes: ParallelDims
    model: Any
    data: PackSpec
    eval_data: PackSpec | None = None
    """The evaluation corpus (None: no evaluation)."""

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        train = self.cfg.train
        return train.global_batch_size // (train.micro_batch_size * self.sizes.dp)

    def summary(self) -> dict[str, Any]:
        """Derived numbers printed next to the config by `--dry-run`."""
        return {
            "world_size": self.sizes.world,
            "dp": self.sizes.dp,
            "edp": self.sizes.expert_dp,
            "num_micro_batches": self.num_micro_batches,
            "packed": self.cfg.packed,
            "num_layers": self.model.num_layers,
            "compress_ratios": list(self.model.compress_ratios),
            "mtp_num_layers": self.model.mtp_num_layers or 0,
            "num_moe_experts": self.model.num_moe_experts,
        }


def check_pretrained(cfg: RunConfig, model: Any) -> None:
    """model.pretrained: the release's index, shard headers and tensor names against the model
    (no tensor is read), so a missing or truncated shard fails before any work. Called by the
    trainer and by --dry-run (a resumed run reads the release too)."""
    if cfg.model.pretrained is None:
        return
    try:
        spec_of(model).release.check(
            cfg.model.pretrained, model, keep_release=cfg.model.lora.keeps_release
        )
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"model.pretrained={cfg.model.pretrained}: {exc}") from None
    except OSError as exc:
        raise CheckpointFormatError(
            f"model.pretrained={cfg.model.pretrained}: cannot read {exc.filename} ({exc.strerror})"
        ) from None


@functools.lru_cache(maxsize=8)
def _tokenizer_ids(path: str, size: int, mtime_ns: int) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)


def check_vocabulary(cfg: RunConfig, model: Any) -> None:
    """model.pretrained: every id the run's tokenizer can produce indexes the release's
    embedding (a smaller vocabulary fails the first step with an index error, after packing)."""
    if cfg.model.pretrained is None:
        return
    try:
        directory = resolve_tokenizer_dir(tokenizer_of(cfg))
    except DataError:
        return  # the path check names a missing tokenizer
    file = directory / "tokenizer.json"
    st = file.stat()
    ids = _tokenizer_ids(str(file), st.st_size, st.st_mtime_ns)
    if ids > model.vocab_size:
        raise ConfigError(
            f"model.pretrained={cfg.model.pretrained}: its vocabulary has {model.vocab_size} "
            f"ids but the tokenizer {directory} makes {ids}: ids >= {model.vocab_size} would "
            "index past the embedding; set data.tokenizer to the release's own tokenizer"
        )


def check_lora_base(cfg: RunConfig) -> None:
    """Adapters on a random base learn nothing a release could use: refused unless asked."""
    lora = cfg.model.lora
    if lora.rank > 0 and cfg.model.pretrained is None and not lora.allow_random_base:
        raise ConfigError(
            f"model.lora.rank={lora.rank} with no model.pretrained trains adapters on random "
            "weights; set model.pretrained=DIR (a released checkpoint), or "
            "model.lora.allow_random_base=true for a test or demo"
        )


def _say_what_model(cfg: RunConfig, model: Any) -> None:
    """One INFO line when a preset is set beside a release (the release wins)."""
    if cfg.model.pretrained is not None and cfg.model.preset is not None:
        log.info("model.preset %r ignored: model.pretrained=%s is the model (%d layers, its "
                 "config.json)", cfg.model.preset, cfg.model.pretrained,
                 model.num_layers)  # fmt: skip


def resolve_run(cfg: RunConfig, world: int | None = None, *, geometry: bool = False) -> ResolvedRun:
    """Validate everything that can be validated without data or weights. `geometry`: the
    model as its torch-free geometry where that checks the same (`model_config`), for what
    builds no model (`train --dry-run` without a memory plan)."""
    check_lora_base(cfg)
    sizes = parallel_sizes(cfg, world_size_from_env() if world is None else world)
    if cfg.model.draft.train != "off":  # in words, before a family's config refuses the field
        family = model_family(cfg)
        release = None
        if family != "deepseek_v41":
            release = model_config(dataclasses.replace(cfg, model=dataclasses.replace(
                cfg.model, draft=type(cfg.model.draft)())), geometry=geometry)  # fmt: skip
        check_draft(cfg, sizes, family, release)
    check_quant_aware(cfg)
    check_vision(cfg, sizes, model_family(cfg))
    model = model_config(cfg, geometry=geometry)
    check_vocabulary(cfg, model)
    _say_what_model(cfg, model)
    check_model_fits(cfg, sizes, model)
    evaluates = bool(cfg.data.eval_path) or cfg.data.eval_fraction > 0
    return ResolvedRun(
        cfg=cfg,
        sizes=sizes,
        model=model,
        data=pack_spec(cfg),
        eval_data=pack_spec(cfg, split="eval") if evaluates else None,
    )
