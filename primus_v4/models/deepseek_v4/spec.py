"""DeepSeek-V4's `ModelSpec`: how the trainer builds, cuts, loads and updates this model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from primus_v4.models.deepseek_v4.cp_batch import CpSplitter
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora
from primus_v4.models.deepseek_v4.model import DeepseekV4Model
from primus_v4.models.deepseek_v4.parallelize import is_meta, parallelize
from primus_v4.models.deepseek_v4.release_base import keep_release_base
from primus_v4.models.deepseek_v4.router_bias import RouterBiasUpdate
from primus_v4.models.model_spec import ModelSpec, StepHook


def _step_hooks(modules: Iterable[nn.Module], section: Any, *, group: Any = None) -> list[StepHook]:
    """The router bias update (noaux_tc balancing; off at `model.router_bias_update_rate` 0).
    `section` is the run config's `model` section."""
    return [RouterBiasUpdate(modules, rate=section.router_bias_update_rate, group=group)]


def _add_adapters(module: nn.Module, section: Any, *, seed: int) -> int:
    """LoRA from the run config's `model.lora` section (lora.py)."""
    spec = LoraSpec(
        rank=section.rank,
        alpha=section.alpha,
        dropout=section.dropout,
        targets=tuple(section.targets),
        expert_adapters=section.expert_adapters,
    )
    return apply_lora(module, spec, seed=seed)


SPEC = ModelSpec(
    name="deepseek_v4",
    build=DeepseekV4Model,
    parallelize=parallelize,
    is_meta=is_meta,
    cp_splitter=CpSplitter,
    step_hooks=_step_hooks,
    add_adapters=_add_adapters,
    keep_release=keep_release_base,
)
