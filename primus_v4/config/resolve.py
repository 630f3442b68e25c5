"""Checks that need more than the config file: the world size (from the launcher) and the model.

Layout (megatron-core, tp = etp = 1):
  dense ranks:  world = pp x cp x dp
  expert ranks: world = pp x ep x edp, independent of cp (ep spans dp x cp ranks)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primus_v4.config.schema import RunConfig
from primus_v4.data.pipeline import PackSpec
from primus_v4.errors import ConfigError, DataError
from primus_v4.parallel.pipeline_layout import plan_stages

if TYPE_CHECKING:
    from primus_v4.models.deepseek_v4.config import DeepseekV4Config


@dataclass(frozen=True, kw_only=True)
class ParallelSizes:
    """Every group size of the run, derived from the world size and `parallel.*`."""

    world: int
    pp: int
    cp: int
    ep: int
    dp: int
    edp: int
    num_micro_batches: int
    """Micro-batches each data-parallel rank runs per optimizer step."""


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} is not an integer") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1")
    return world


def parallel_sizes(cfg: RunConfig, world: int) -> ParallelSizes:
    """Derive dp/edp/micro-batches; errors name the numbers that disagree."""
    p = cfg.parallel
    if world % (p.pp * p.cp):
        raise ConfigError(
            f"world size {world} is not divisible by parallel.pp x parallel.cp = "
            f"{p.pp} x {p.cp} = {p.pp * p.cp} (world = pp x cp x dp)"
        )
    dp = world // (p.pp * p.cp)
    if (dp * p.cp) % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide dp x cp = {dp} x {p.cp} = {dp * p.cp} (world {world} "
            f"/ pp {p.pp}): expert ranks are laid out as edp x ep x pp, independent of cp"
        )
    edp = world // (p.pp * p.ep)
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if gbs % (mbs * dp):
        raise ConfigError(
            f"train.global_batch_size={gbs} must be divisible by train.micro_batch_size x dp = "
            f"{mbs} x {dp} = {mbs * dp}"
        )
    return ParallelSizes(
        world=world, pp=p.pp, cp=p.cp, ep=p.ep, dp=dp, edp=edp, num_micro_batches=gbs // (mbs * dp)
    )


def model_config(cfg: RunConfig) -> DeepseekV4Config:
    """The model preset with `model.overrides` and `model.*` applied (errors name the key)."""
    # torch (megatron, the model) loads only when a model config is asked for: `pack` and
    # config validation stay torch-free
    from primus_v4.models.deepseek_v4.config import DeepseekV4Config

    overrides = dict(cfg.model.overrides)
    if not cfg.model.fused_linear_ce:
        # One CE chunk spanning the whole row: the [S, vocab] logits exist at once (unfused).
        overrides.setdefault("ce_chunk_size", cfg.data.seq_length)
    overrides.setdefault("lm_head_rows", cfg.model.lm_head_rows)
    if cfg.model.dtype == "bfloat16":
        import torch

        overrides.setdefault("bf16", True)
        overrides.setdefault("params_dtype", torch.bfloat16)
    if cfg.model.pretrained is not None:
        return pretrained_model_config(cfg.model.pretrained, overrides)
    preset = cfg.model.preset or "tiny"
    try:
        return DeepseekV4Config.preset(preset, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"model.preset / model.overrides: {exc}") from None
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(
            f"model.overrides {sorted(cfg.model.overrides)} on preset {preset!r} give "
            f"an invalid model: {exc}"
        ) from None


def pretrained_model_config(directory: str, overrides: dict[str, Any]) -> DeepseekV4Config:
    """The model config of a released checkpoint (its config.json), overrides applied."""
    from primus_v4.pretrained.load import read_config  # torch-free config path, as above

    try:
        return read_config(directory, **overrides)
    except FileNotFoundError as exc:
        raise ConfigError(f"model.pretrained: {exc}") from None
    except (ConfigError, TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"model.pretrained={directory!r} / model.overrides: {exc}") from None


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
            seed=cfg.train.seed,
            seq_length=d.seq_length,
            algorithm=d.algorithm,
            overlong=d.overlong,
            tokenizer=tokenizer_of(cfg),
            strict=d.strict,
            cache_dir=d.cache_dir,
            lock_dir=d.lock_dir,
            lock_timeout_s=d.lock_timeout_s,
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


def check_model_fits(cfg: RunConfig, model: DeepseekV4Config) -> None:
    """Model-dependent parallel checks: experts per EP rank, layers per pipeline stage."""
    p = cfg.parallel
    experts = model.num_moe_experts or 0
    if experts % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide the model's num_moe_experts={experts} "
            f"(each EP rank holds experts / ep of them)"
        )
    if p.pp > 1 and p.pp_layout is None and model.num_layers < p.pp:
        raise ConfigError(
            f"parallel.pp={p.pp} exceeds the model's num_layers={model.num_layers}: every "
            "pipeline stage needs at least one decoder layer"
        )
    if p.pp > 1 or p.pp_layout is not None:
        try:  # the stage plan the pipeline engine will build, checked against the model
            plan_stages(
                pp=p.pp,
                num_layers=model.num_layers,
                mtp_num_layers=model.mtp_num_layers or 0,
                layout=p.pp_layout,
            )
        except ConfigError as exc:
            raise ConfigError(f"parallel.pp / parallel.pp_layout: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """A config checked against the world size and the model, ready to run."""

    cfg: RunConfig
    sizes: ParallelSizes
    model: DeepseekV4Config
    data: PackSpec
    eval_data: PackSpec | None = None
    """The evaluation corpus (None: no evaluation)."""

    def summary(self) -> dict[str, Any]:
        """Derived numbers printed next to the config by `--dry-run`."""
        return {
            "world_size": self.sizes.world,
            "dp": self.sizes.dp,
            "edp": self.sizes.edp,
            "num_micro_batches": self.sizes.num_micro_batches,
            "packed": self.cfg.packed,
            "num_layers": self.model.num_layers,
            "compress_ratios": list(self.model.compress_ratios),
            "mtp_num_layers": self.model.mtp_num_layers or 0,
            "num_moe_experts": self.model.num_moe_experts,
        }


def resolve_run(cfg: RunConfig, world: int | None = None) -> ResolvedRun:
    """Validate everything that can be validated without data or weights."""
    sizes = parallel_sizes(cfg, world_size_from_env() if world is None else world)
    model = model_config(cfg)
    check_model_fits(cfg, model)
    evaluates = bool(cfg.data.eval_path) or cfg.data.eval_fraction > 0
    return ResolvedRun(
        cfg=cfg,
        sizes=sizes,
        model=model,
        data=pack_spec(cfg),
        eval_data=pack_spec(cfg, split="eval") if evaluates else None,
    )
