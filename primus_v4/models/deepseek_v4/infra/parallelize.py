"""How DeepSeek-V4 is cut for parallelism: one rank's freshly built model into its parallel form
(pipeline stage, then experts), with the generic collectives of `primus_v4.parallel`.

Order matters: the pipeline cut keeps only this stage's layers (moved, not copied), then expert
parallelism slices the remaining MoE layers to this rank's experts [E/ep, ...]. The model is
normally built on the meta device (a 290B-parameter model fits no rank), so both cuts are
shape-only and `materialize` then allocates and initializes just what the rank keeps. Every
parameter draws from a generator of (seed, its name), experts from (seed, name, expert index),
so each layout starts from exactly the weights of the one-process model.
Data parallel (DP x CP) needs no wrapper: the trainer's optimizer (training.optim.zero) sums the
gradients over the replicas (reduce-scatter, never an average: the loss is already normalized by
global token counts) and shards its state over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from primus_v4.log import get_logger
from primus_v4.models.deepseek_v4.infra.pipeline_stage import build_stage
from primus_v4.models.deepseek_v4.model import DeepseekV4Model, ModelOutput
from primus_v4.models.deepseek_v4.moe import MoE, combine_experts
from primus_v4.models.deepseek_v4.weight_init import init_buffers
from primus_v4.parallel.expert_parallel import AllToAllDispatcher
from primus_v4.parallel.groups import Axis, ParallelContext
from primus_v4.parallel.pipeline_layout import plan_stages
from primus_v4.parallel.pipeline_schedule import PipelineRunner

log = get_logger(__name__)


@dataclass(kw_only=True)
class Parallelized:
    """model: this rank's module (a pipeline stage when pp > 1); pipeline: its schedule runner."""

    model: nn.Module
    pipeline: object | None = None


def parallelize(
    model: DeepseekV4Model,
    ctx: ParallelContext,
    *,
    pp_layout: str | None,
    packed: bool,
    device: torch.device,
    seed: int | None = None,
    weights: Callable[[nn.Module], None] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    stage_builder: Callable[..., nn.Module] = build_stage,
) -> Parallelized:
    """Apply pipeline and expert parallelism of `ctx` to a full DeepseekV4Model; a meta-device
    model is materialized on `device` afterwards under `seed` (see `materialize`), or filled by
    `weights(rank_model)` (a pretrained checkpoint: only what the rank keeps is read).
    `prepare(rank_model)` runs first, before anything is allocated (e.g. keeping the base as
    released: release_base.keep_release_base). `stage_builder(model, spec, packed=)` cuts the
    pipeline stage (a family whose stages send more than the streams brings its own)."""
    if ctx.pp.size == 1 and ctx.ep.size == 1:
        _materialize_or_fill(model, device=device, seed=seed, weights=weights, prepare=prepare)
        return Parallelized(model=model)
    spec = None
    if ctx.pp.size > 1:
        cfg = model.cfg
        specs = plan_stages(
            pp=ctx.pp.size,
            num_layers=cfg.num_layers,
            mtp_num_layers=cfg.mtp_num_layers or 0,
            layout=pp_layout,
        )
        spec = specs[ctx.pp.rank]
        model = stage_builder(model, spec, packed=packed)
        log.info("pipeline stage %d/%d: %s", spec.index, ctx.pp.size, spec.symbols)
    if ctx.ep.size > 1:
        layers = apply_expert_parallel(model, ctx.ep)
        log.info("expert parallel: %d MoE layers hold %d of their experts each", layers,
                 model.cfg.num_moe_experts // ctx.ep.size)  # fmt: skip
    _materialize_or_fill(model, device=device, seed=seed, weights=weights, prepare=prepare)
    runner = None
    if spec is not None:
        runner = PipelineRunner(model, ctx, device=device, output=ModelOutput.from_sums)
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
    prepare: Callable[[nn.Module], None] | None = None,
) -> None:
    if prepare is not None:
        prepare(model)
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
        # derived buffers first: the load then fills what the release holds of them (V4.1's
        # image routing bias `bias_vl`, zeroed by init_buffers, was left zero the other way)
        init_buffers(model)
        weights(model)
    log.info("materialized %d parameters on %s", sum(p.numel() for p in model.parameters()),
             device)  # fmt: skip


def shard_moe(moe: nn.Module, ep: Axis) -> None:
    """Keep this rank's experts of `moe` (weights [E, ...] -> [L, ...]) and dispatch over `ep`.

    Sharded parameters are tagged `expert_parallel = True`: their gradients are summed over
    the expert-data-parallel group, not over DP x CP like the replicated ones; `expert_group`
    (the EP group) lets checkpoints store them as shards of one global [E, ...] tensor.
    On the meta device the shard is shapes only; `init_weights` later draws its own experts.
    """
    if ep.size == 1:
        return
    num_experts = moe.num_experts
    dispatcher = AllToAllDispatcher(ep, num_experts, combine=combine_experts)
    lo = ep.rank * dispatcher.num_local
    for name in ("w_gate_up", "w_down"):
        full = getattr(moe, name)
        local = nn.Parameter(full.detach()[lo : lo + dispatcher.num_local].clone())
        local.expert_parallel = True  # type: ignore[attr-defined]
        # Checkpoints save the shard as rows [lo, lo + L) of the global [E, ...] tensor.
        local.expert_group = ep.group  # type: ignore[attr-defined]
        setattr(moe, name, local)
    moe.expert_offset = lo  # init draws expert i of the shard as global expert lo + i
    moe.dispatcher = dispatcher


def apply_expert_parallel(model: nn.Module, ep: Axis) -> int:
    """Shard every MoE layer of `model` over `ep`; returns how many layers were sharded."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        shard_moe(moe, ep)
    return len(layers)
