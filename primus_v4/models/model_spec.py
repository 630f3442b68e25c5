"""What a model folder gives the trainer: one `ModelSpec` (torchtitan's train-spec idea).

The trainer builds, cuts and loads a model only through its spec, so nothing above `models/`
names a model class: `build` makes the whole model (on the meta device for a multi-rank run),
`parallelize` cuts it to the rank's pipeline stage and expert shard and materializes it,
`cp_splitter` splits a pack over the context-parallel ranks, and `step_hooks` are the model's
own per-step updates (for DeepSeek-V4 the router bias rule), each called with
`step(apply=<the optimizer stepped>)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn


class StepHook(Protocol):
    """A model-side update after each optimizer step (no-op when its feature is off)."""

    def step(self, *, apply: bool) -> None: ...


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    name: str
    """The model family, as `model.preset` configs name it."""
    build: Callable[[Any], nn.Module]
    """config -> the whole model (call under `torch.device("meta")` to allocate nothing)."""
    parallelize: Callable[..., Any]
    """(model, ctx, *, pp_layout, packed, device, seed, weights, prepare) -> `Parallelized`."""
    is_meta: Callable[[nn.Module], bool]
    """Whether a model still holds meta (shape-only) parameters."""
    cp_splitter: Callable[..., Any]
    """(cp_axis, config, *, packed, device, seq_length) -> the splitter of packs over CP."""
    step_hooks: Callable[..., list[StepHook]]
    """(rank modules, the run's `model` section, *, group) -> the hooks the trainer steps after
    each optimizer update."""
    add_adapters: Callable[..., int]
    """(rank module, the run's `model.lora` section, *, seed) -> adapter parameters added: the
    module's own parameters frozen, LoRA adapters added and initialized."""
    keep_release: Callable[..., int]
    """(rank module, config, *, dtype) -> weights kept as the release stores them (meta: to be
    read by the loader; materialized: quantized), decoded per use (`model.lora.base: release`)."""
