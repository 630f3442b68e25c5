"""Meta-device planning of DeepSeek-V4 Flash (pp = 3, ep = 8): one rank's stage and expert
slice are cut on the meta device and their parameters counted without allocating anything."""

from __future__ import annotations

import torch

from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.models.deepseek_v4.infra.parallelize import shard_moe
from primus_v4.models.deepseek_v4.infra.pipeline_stage import build_stage
from primus_v4.models.deepseek_v4.moe import MoE
from primus_v4.parallel.groups import Axis
from primus_v4.parallel.pipeline_layout import plan_stages

PP, EP = 3, 8


def _rank_numel(cfg: DeepseekV4Config, stage: int) -> tuple[int, int]:
    """(parameters of this stage on EP rank 0, of the whole model); all on the meta device."""
    with torch.device("meta"):
        full = DeepseekV4Model(cfg)
    total = sum(p.numel() for p in full.parameters())
    specs = plan_stages(pp=PP, num_layers=cfg.num_layers, mtp_num_layers=cfg.mtp_num_layers or 0,
                        layout=None)  # fmt: skip
    model = build_stage(full, specs[stage])
    ep = Axis(group=None, rank=0, size=EP, ranks=tuple(range(EP)))
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        shard_moe(moe, ep)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    return sum(p.numel() for p in model.parameters()), total


def test_flash_stage_plan_counts_rank_parameters_on_meta() -> None:
    cfg = DeepseekV4Config.preset("deepseek_v4_flash")
    counts = [_rank_numel(cfg, s) for s in range(PP)]
    total = counts[0][1]
    assert total > 250e9  # ~290B: this could never be allocated here
    for rank, _ in counts:
        # A rank holds one stage's dense part and 1/8 of its experts.
        assert rank < total / PP, (rank, total)
