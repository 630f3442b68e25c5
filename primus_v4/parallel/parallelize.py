"""Turn one rank's freshly built model into its parallel form: pipeline stage, then experts.

Order matters: the pipeline cut keeps only this stage's layers (moved, not copied), then expert
parallelism slices the remaining MoE layers to this rank's experts [E/ep, ...]. The model is
normally built on the meta device (a 290B-parameter model fits no rank), so both cuts are
shape-only and `materialize` then allocates and initializes just what the rank keeps. Every
parameter draws from a generator of (seed, its name), experts from (seed, name, expert index),
so each layout starts from exactly the weights of the one-process model.
Data parallel (DP x CP) needs no wrapper: the trainer's optimizer (training.zero) sums the
gradients over the replicas (reduce-scatter, never an average: the loss is already normalized by
global token counts) and shards its state over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from primus_v4.errors import ConfigError
from primus_v4.log import get_logger
from primus_v4.parallel.groups import ParallelContext

log = get_logger(__name__)


@dataclass(kw_only=True)
class Parallelized:
    """model: this rank's module (a pipeline stage when pp > 1); pipeline: its schedule runner."""

    model: nn.Module
    pipeline: object | None = None


def parallelize(
    model: nn.Module,
    ctx: ParallelContext,
    *,
    pp_layout: str | None,
    packed: bool,
    device: torch.device,
    seed: int | None = None,
    weights: Callable[[nn.Module], None] | None = None,
) -> Parallelized:
    """Apply pipeline and expert parallelism of `ctx` to a full DeepseekV4Model; a meta-device
    model is materialized on `device` afterwards under `seed` (see `materialize`), or filled by
    `weights(rank_model)` (a pretrained checkpoint: only what the rank keeps is read)."""
    if ctx.pp.size == 1 and ctx.ep.size == 1:
        _materialize_or_fill(model, device=device, seed=seed, weights=weights)
        return Parallelized(model=model)
    from primus_v4.models.deepseek_v4 import DeepseekV4Model

    if not isinstance(model, DeepseekV4Model):
        raise ConfigError(
            f"parallel.pp={ctx.pp.size} / parallel.ep={ctx.ep.size} need a DeepseekV4Model, "
            f"got {type(model).__name__}"
        )
    spec = None
    if ctx.pp.size > 1:
        from primus_v4.parallel.pipeline import plan_stages
        from primus_v4.parallel.pipeline_stage import build_stage

        cfg = model.cfg
        specs = plan_stages(
            pp=ctx.pp.size,
            num_layers=cfg.num_layers,
            mtp_num_layers=cfg.mtp_num_layers or 0,
            layout=pp_layout,
        )
        spec = specs[ctx.pp.rank]
        model = build_stage(model, spec, packed=packed)
        log.info("pipeline stage %d/%d: %s", spec.index, ctx.pp.size, spec.symbols)
    if ctx.ep.size > 1:
        from primus_v4.parallel.expert_parallel import apply_expert_parallel

        layers = apply_expert_parallel(model, ctx.ep)
        log.info("expert parallel: %d MoE layers hold %d of their experts each", layers,
                 model.cfg.num_moe_experts // ctx.ep.size)  # fmt: skip
    _materialize_or_fill(model, device=device, seed=seed, weights=weights)
    runner = None
    if spec is not None:
        from primus_v4.parallel.pipeline_schedule import PipelineRunner

        runner = PipelineRunner(model, ctx, device=device)
    return Parallelized(model=model, pipeline=runner)


def is_meta(model: nn.Module) -> bool:
    """Whether `model` holds meta (shape-only) parameters."""
    return any(p.is_meta for p in model.parameters())


def _materialize_or_fill(
    model: nn.Module,
    *,
    device: torch.device,
    seed: int | None,
    weights: Callable[[nn.Module], None] | None,
) -> None:
    if is_meta(model):
        materialize(model, device=device, seed=seed, weights=weights)
    elif weights is not None:
        weights(model)


def materialize(
    model: nn.Module,
    *,
    device: torch.device,
    seed: int | None,
    weights: Callable[[nn.Module], None] | None = None,
) -> None:
    """Allocate `model`'s meta parameters and buffers on `device`, then `init_weights(seed)`,
    or `weights(model)` (fills every parameter and persistent buffer) and the derived buffers.

    `to_empty` replaces the Parameter objects, so the tags set while cutting (expert_parallel,
    expert_group, ...) are carried over to the new ones by name.
    """
    tags = {name: dict(p.__dict__) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.__dict__.update(tags[name])
    if weights is None:
        model.init_weights(seed)  # type: ignore[operator]
    else:
        from primus_v4.models.deepseek_v4.init import init_buffers

        weights(model)
        init_buffers(model)
    log.info("materialized %d parameters on %s", sum(p.numel() for p in model.parameters()),
             device)  # fmt: skip
