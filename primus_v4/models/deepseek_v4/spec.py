"""DeepSeek-V4's `ModelSpec`: how the rest of the package builds, cuts, loads and updates it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from primus_v4.models.common.activations import layer_parts
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.deepseek_v4.config import LAYER_KINDS, PRESET_DIR, DeepseekV4Config
from primus_v4.models.deepseek_v4.infra.cp_batch import CpSplitter, required_local_rows
from primus_v4.models.deepseek_v4.infra.parallelize import is_meta, parallelize
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora
from primus_v4.models.deepseek_v4.model import DeepseekV4Model
from primus_v4.models.deepseek_v4.params import param_counts
from primus_v4.models.deepseek_v4.release import config_json, load, save
from primus_v4.models.deepseek_v4.release import state_dict_adapter as names
from primus_v4.models.deepseek_v4.release.kept_base import keep_release_base, release_rounding
from primus_v4.models.deepseek_v4.router_bias import RouterBiasUpdate
from primus_v4.models.model_spec import MemoryTerms, ModelSpec, ReleaseFormat, StepHook


def _step_hooks(modules: Iterable[nn.Module], section: Any, *, group: Any = None) -> list[StepHook]:
    """The router bias update (noaux_tc balancing; off at `model.router_bias_update_rate` 0).
    `section` is the run config's `model` section."""
    return [RouterBiasUpdate(modules, rate=section.router_bias_update_rate, group=group)]


def _layer_parts(cfg: Any, layer: int, **kw: Any) -> dict[str, float]:
    """Saved bytes by part of decoder layer `layer` (its kind's; a hash-routed layer's router)."""
    return layer_parts(cfg, cfg.layer_kind(layer), hashed=layer < cfg.num_hash_layers, **kw)


def _add_adapters(module: nn.Module, section: Any, *, seed: int) -> int:
    """LoRA from the run config's `model.lora` section (lora.py)."""
    return apply_lora(module, LoraSpec.of(section), seed=seed)


SPEC = ModelSpec(
    name="deepseek_v4",
    title="DeepSeek-V4",
    preset_dir=PRESET_DIR,
    config_class=DeepseekV4Config,
    layer_kinds=LAYER_KINDS,
    param_counts=param_counts,
    build=DeepseekV4Model,
    parallelize=parallelize,
    is_meta=is_meta,
    cp_min_rows=required_local_rows,
    cp_splitter=CpSplitter,
    step_hooks=_step_hooks,
    add_adapters=_add_adapters,
    keep_release=keep_release_base,
    release=ReleaseFormat(
        read_config=load.read_config,
        config_json=config_json.config_to_release,
        config_from_json=names.config_from_release,
        check=load.check_release,
        open=load.open_release,
        rank_loader=load.rank_loader,
        load=load.load_pretrained,
        save=save.save_pretrained,
        write_state=save.write_release_state,
        names=names,
        release_weights=lambda model: list(release_weights(model)),
        release_rounding=release_rounding,
    ),
    memory=MemoryTerms(layer_parts=_layer_parts, layer_role=lambda cfg, i: cfg.layer_kind(i)),
)
