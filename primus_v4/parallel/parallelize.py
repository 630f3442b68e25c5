"""Turn one rank's freshly built model into its parallel form: pipeline stage, then experts.

Order matters: the pipeline cut keeps only this stage's layers (moved, not copied, from a model
built with the run's seed, so every layout starts from the same weights as one process), then
expert parallelism slices the remaining MoE layers to this rank's experts [E/ep, ...].
Data parallel (DP x CP) needs no wrapper: gradients are summed explicitly after backward
(`data_parallel.sum_gradients`), because the loss is already normalized by global token counts.
"""

from __future__ import annotations

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
) -> Parallelized:
    """Apply pipeline and expert parallelism of `ctx` to a full DeepseekV4Model."""
    if ctx.pp.size == 1 and ctx.ep.size == 1:
        return Parallelized(model=model)
    from primus_v4.models.deepseek_v4 import DeepseekV4Model

    if not isinstance(model, DeepseekV4Model):
        raise ConfigError(
            f"parallel.pp={ctx.pp.size} / parallel.ep={ctx.ep.size} need a DeepseekV4Model, "
            f"got {type(model).__name__}"
        )
    runner = None
    if ctx.pp.size > 1:
        from primus_v4.parallel.pipeline import plan_stages
        from primus_v4.parallel.pipeline_schedule import PipelineRunner
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
        runner = PipelineRunner(model, ctx, device=device)
        log.info("pipeline stage %d/%d: %s", spec.index, ctx.pp.size, spec.symbols)
    if ctx.ep.size > 1:
        from primus_v4.parallel.expert_parallel import apply_expert_parallel

        layers = apply_expert_parallel(model, ctx.ep)
        log.info("expert parallel: %d MoE layers hold %d of their experts each", layers,
                 model.cfg.num_moe_experts // ctx.ep.size)  # fmt: skip
    return Parallelized(model=model, pipeline=runner)
