"""The one model-assembly path: meta build -> dtype -> (cut and materialize) -> kept release
base -> adapters. The trainer, the memory plan and the LoRA export all assemble through here,
so a rule about the base (kept as released, frozen under adapters) is written once.

Three ends of the same path:
  * meta (the memory plan): shapes only, nothing allocated or drawn;
  * parallelized (the trainer): the rank's pipeline stage and expert shard, materialized from
    the release or drawn from `seed`;
  * drawn whole (an export's random-init base): every weight drawn from `seed` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from primus_v4.log import get_logger
from primus_v4.models import spec_of

log = get_logger(__name__)


def param_dtype(section: Any) -> torch.dtype:
    """The run's parameter dtype from its `model` section."""
    return torch.bfloat16 if section.dtype == "bfloat16" else torch.float32


def meta_model(model_cfg: Any, section: Any) -> nn.Module:
    """The whole model on the meta device in the run's dtype: shapes only."""
    with torch.device("meta"):
        model = spec_of(model_cfg).build(model_cfg)
    return model.to(dtype=param_dtype(section))


@dataclass(kw_only=True)
class Assembled:
    model: nn.Module
    pipeline: Any = None
    """The pipeline schedule's stage (pp > 1), else None."""
    drawn: bool = False
    """The weights were drawn from the seed (no release was read)."""
    kept: int = 0
    """Base weights kept as the release stores them."""


def assemble(
    model_cfg: Any,
    section: Any,
    *,
    seed: int,
    model: nn.Module | None = None,
    parallel: dict[str, Any] | None = None,
    weights: Callable[[nn.Module], None] | None = None,
    draw_on: str | torch.device | None = None,
    adapters: bool = True,
) -> Assembled:
    """Assemble the model of `model_cfg` for a run whose `model` section is `section`.

    `parallel` (the trainer): keyword arguments of the spec's `parallelize` (ctx, pp_layout,
    packed, device): the rank's stage is cut and materialized, from `weights` (a release
    loader) or drawn from `seed`. `draw_on` (no `parallel`): the whole model drawn there.
    Neither: the model stays on the meta device (the memory plan). `model`: a meta model
    built already (tests pass their own)."""
    spec = spec_of(model_cfg)
    dtype = param_dtype(section)
    model = meta_model(model_cfg, section) if model is None else model
    keep = section.lora.keeps_release
    out = Assembled(model=model)

    def keep_release(rank_model: nn.Module) -> None:
        out.kept = spec.keep_release(rank_model, model_cfg, dtype=dtype)
        log.info("model.lora.base=release: %d base weights kept as FP8 / FP4 bytes", out.kept)

    def prepare(rank_model: nn.Module) -> None:
        if keep:
            keep_release(rank_model)
        if spec.place_tables is not None:  # before the fill: the loader reads the rank's rows
            spec.place_tables(rank_model, section, ctx=parallel["ctx"])

    if parallel is not None:
        out.drawn = weights is None and spec.is_meta(model)
        done = spec.parallelize(
            model,
            seed=seed,
            weights=weights,
            prepare=prepare if weights is not None else None,
            **parallel,
        )
        out.model, out.pipeline = done.model, done.pipeline
        if weights is None and spec.place_tables is not None:  # from the drawn tables
            spec.place_tables(out.model, section, ctx=parallel["ctx"])
        if keep and weights is None:  # a drawn base: quantized as a release would store it
            keep_release(out.model)
    elif draw_on is not None:
        out.model = model.to_empty(device=draw_on)
        out.model.init_weights(seed)
        out.drawn = True
        if keep:  # it trained against the quantized draw
            keep_release(out.model)
    elif keep:  # meta: FP8 / FP4 buffers in place of those parameters
        out.kept = spec.keep_release(model, model_cfg, dtype=dtype)
    if adapters and section.lora.rank:
        frozen = sum(p.numel() for p in out.model.parameters())
        added = spec.add_adapters(out.model, section.lora, seed=seed)
        if parallel is not None:
            lora = section.lora
            log.info(
                "LoRA rank %d alpha %g on %s: %d adapter parameters train, %d base parameters "
                "frozen (%.3f%%)", lora.rank, lora.alpha, ",".join(lora.targets), added, frozen,
                100 * added / max(frozen, 1),
            )  # fmt: skip
    return out
