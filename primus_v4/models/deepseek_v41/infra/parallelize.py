"""How DeepSeek-V4.1 is cut for parallelism: DeepSeek-V4's cut (pipeline stage, then experts,
then materialize; data parallel through the sharded optimizer) with V4.1's pipeline stage,
whose boundary also carries the single-pass mHC pre and the shared compressed cache
(pipeline_stage.py says why)."""

from __future__ import annotations

from typing import Any

from torch import nn

from primus_v4.models.deepseek_v4.infra.parallelize import Parallelized
from primus_v4.models.deepseek_v4.infra.parallelize import parallelize as v4_parallelize
from primus_v4.models.deepseek_v41.infra.pipeline_stage import build_stage
from primus_v4.parallel.groups import ParallelContext


def parallelize(model: nn.Module, ctx: ParallelContext, **kwargs: Any) -> Parallelized:
    """Pipeline, expert and data parallelism of `ctx` applied to a full DeepseekV41Model (see
    DeepSeek-V4's `parallelize` for the arguments); context parallelism needs no cut (the
    layers exchange their boundary rows through the CP comm of each pack's layout)."""
    return v4_parallelize(model, ctx, stage_builder=build_stage, **kwargs)
