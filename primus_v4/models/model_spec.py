"""What a model family gives the rest of the package: one `ModelSpec` (torchtitan's train-spec).

Everything above `models/` reaches a model only through its spec (an import-linter contract in
pyproject.toml says so): the trainer builds, cuts, loads and updates a model; the config layer
reads presets and release config.json files; the memory plan counts its layers' terms; the exports
rename and write tensors. A second family plugs in by adding its folder and one line in
`models/__init__.py`, without touching the trainer, the CLI or the memory plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # torch-free at import: config validation reads the registry
    from torch import nn


class StepHook(Protocol):
    """A model-side update after each optimizer step (no-op when its feature is off)."""

    def step(self, *, apply: bool) -> None: ...


@dataclass(kw_only=True, frozen=True)
class ReleaseFormat:
    """A family's released checkpoints: config.json, tensor names, load and save."""

    read_config: Callable[..., Any]
    """(directory or config.json, **overrides) -> the model config."""
    config_json: Callable[[Any], dict[str, Any]]
    """model config -> the release's config.json dict."""
    config_from_json: Callable[..., Any]
    """(config.json dict, *, source) -> the model config."""
    check: Callable[..., None]
    """(directory, model config, *, keep_release) -> None: index, shard headers and names
    against the model, reading no tensor (raises CheckpointFormatError)."""
    open: Callable[..., Any]
    """directory -> a `CheckpointReader` under the release's tensor names."""
    rank_loader: Callable[..., Callable[[nn.Module], None]]
    """(directory, *, progress) -> the `weights=` callback of `parallelize`."""
    load: Callable[..., nn.Module]
    """(directory, *, dtype, device, progress, keep_release) -> the whole model, loaded."""
    save: Callable[..., Any]
    """(model, out, *, dtype, ...) -> a release directory written from a whole model."""
    write_state: Callable[..., Any]
    """(model config, state pieces, out, *, dtype, ...) -> a release directory written from a
    stream of state-dict pieces (a training checkpoint being exported); `carry_from`: the
    release the run started from, whose untrained parts (a drafter) are copied unchanged."""
    names: Any
    """The state-dict adapter module: `name_table`, `release_tensors`, `to_release`,
    `fill_state`, `needed` (release names <-> ours)."""
    release_weights: Callable[[nn.Module], list[Any]]
    """model -> its weights kept as released (`ReleaseWeight`), empty when none are."""
    release_rounding: Callable[..., Any] | None = None
    """(rank module, model config) -> its weights the release stores quantized, each with its
    release rounding (`models/common/quant_aware.QuantAware`: `train.quant_aware: release`);
    None: the family's releases store no quantized weight."""
    peft: Any = None
    """The PEFT export's module names when they are the family's own (a module with
    `KEY_PREFIX`, `block_tensors`, `router_tensors`, `adapter_config`, as export/peft.py has);
    None: transformers' names (export/peft.py)."""
    saved_as: Callable[[Any, Any], dict[str, str | None]] | None = None
    """(model config, the run's `model` section) -> {our name: the name its training
    checkpoints store it under, or None: kept out, as the release stores it (frozen rows an
    export carries from the release unchanged)} for tensors a run may place (`place_tables`);
    None: every tensor is stored under its own name."""


@dataclass(kw_only=True, frozen=True)
class MemoryTerms:
    """A family's terms of the memory plan (`primus-v4 inspect memory`, `train --dry-run`),
    counted from its code (models/common/activations.py holds the shared counting)."""

    layer_parts: Callable[..., dict[str, float]]
    """(model config, layer, *, rows, seq, b, attention_backend) -> saved bytes by part of
    decoder layer `layer` (the parts the recompute choices drop, and the rest)."""
    layer_role: Callable[[Any, int], str]
    """(model config, layer) -> how the plan groups it (its kind, or a finer role)."""
    stage_rows: Callable[..., list[tuple[str, float]]] = lambda cfg, layers, **kw: []
    """(model config, the stage's decoder layers, *, seq, t, held) -> (name, bytes) of what a
    stage holds in the backward phase besides its layers' saved sets (shared caches, ...)."""
    image_encoder: Callable[..., ImageEncoderTerms | None] = lambda release, **kw: None
    """(release directory, *, b bytes per value, train: the run's `model.vision.train`) -> what
    a run on packs with images adds besides the parameters the model holds (`ImageEncoderTerms`),
    None without a vision tower."""


class ImageEncoderTerms(NamedTuple):
    """The image encoder's terms of the memory plan; the parts a run trains are parameters of
    the model, counted with its own (weights, gradients, optimizer state)."""

    frozen_params: int
    """Parameters of the frozen parts, attached beside the model (weights only)."""
    transient: float
    """Bytes of encoding the largest image the release plans through a frozen tower (no
    gradient: one block's activations and the attention scores at a time)."""
    saved_per_token: float
    """Bytes the trained parts save for backward per image token of a row (the aligner's
    inputs and outputs; with the tower, every block's activations of its 9 patches)."""
    saved_scores: float
    """Bytes of the trained tower's attention probabilities saved for backward for the largest
    image (heads x patches^2 per block, float32: the math kernel's worst case); 0 frozen."""


@dataclass(kw_only=True, frozen=True)
class GeometrySpec:
    """A family's model config without torch (its `geometry` module): what the answers that build
    no model read (`train --dry-run`: presets, overrides, layer kinds, parallel sizes)."""

    config_class: type
    """The geometry dataclass: the config's own fields and the megatron-core ones the presets
    set, with the config's defaults and checks (`preset(name, **overrides)`, `from_dict`)."""
    preset_dir: Path
    """Where the family's presets live (the same as `ModelSpec.preset_dir`)."""
    cp_min_rows: Callable[[Any], int]
    """config or geometry -> the fewest rows a CP rank may hold (`ModelSpec.cp_min_rows`)."""


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    name: str
    """The model family, as presets, run configs and config.json `model_type` name it."""
    title: str
    """For messages: "DeepSeek-V4"."""
    preset_dir: Path
    """Where the family's presets live (YAML of model config fields)."""
    config_class: type
    """The model config dataclass (`preset(name, **overrides)`, `from_dict`)."""
    layer_kinds: Mapping[int, str]
    """compress ratio -> layer kind name (the memory plan's per-kind rows)."""
    param_counts: Callable[[Any], Any]
    """model config -> parameter counts by part (`inspect model`)."""
    build: Callable[[Any], nn.Module]
    """config -> the whole model (call under `torch.device("meta")` to allocate nothing)."""
    parallelize: Callable[..., Any]
    """(model, ctx, *, pp_layout, packed, device, seed, weights, prepare) -> `Parallelized`."""
    is_meta: Callable[[nn.Module], bool]
    """Whether a model still holds meta (shape-only) parameters."""
    cp_min_rows: Callable[[Any], int]
    """config -> the fewest rows a CP rank may hold (the boundary rows it hands on)."""
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
    release: ReleaseFormat
    memory: MemoryTerms
    """The family's memory-plan terms."""
    speculate: Callable[..., Any] | None = None
    """(release directory, prompts [token ids], *, max_new_tokens, progress) -> a report of
    greedy speculative decoding with the release's drafter (`.as_dict()`: mean accepted draft
    tokens per block, draft share, ...); None: the family has no drafter to measure."""
    attach_images: Callable[..., Any] | None = None
    """(rank module, release directory, *, device) -> the release's image encoder (frozen)
    set on the module, for rows with images; None: the family has no vision tower."""
    place_tables: Callable[..., Any] | None = None
    """(rank module, the run's `model` section, *, ctx) after the cut and fill: where the
    family's lookup tables live (DeepSeek-V4.1's Engram, `model.engram`); None: nothing to
    place."""
    use_tokenizer: Callable[..., Any] | None = None
    """(rank module, tokenizer directory) for a model drawn from a seed: what the family derives
    from the tokenizer (DeepSeek-V4.1's Engram token map), set as a release's loader sets it from
    the release's own tokenizer, so the run's export reads back as the model that trained; None:
    nothing derives from it."""
