"""DeepSeek-V4.1's `ModelSpec`: how the rest of the package builds, cuts, loads and updates it.

Shared with DeepSeek-V4: the expert-parallel and data-parallel cut, the router bias update, the
LoRA machinery (lora.py) and the base kept as released (release/kept_base.py). V4.1's own: the
pipeline stage (the shared compressed cache crosses stage boundaries) and the CP boundaries
(infra/).
"""

from __future__ import annotations

from typing import Any

import torch

from primus_v4.log import get_logger
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.deepseek_v4 import spec as v4
from primus_v4.models.deepseek_v4.config import PRESET_DIR
from primus_v4.models.deepseek_v4.infra.parallelize import is_meta
from primus_v4.models.deepseek_v41 import engram_vocab, lora, memory_terms, peft
from primus_v4.models.deepseek_v41.config import LAYER_KINDS, DeepseekV41Config, config_from_release
from primus_v4.models.deepseek_v41.engram_placement import place_for_run
from primus_v4.models.deepseek_v41.infra.cp_batch import CpSplitter, required_local_rows
from primus_v4.models.deepseek_v41.infra.parallelize import parallelize
from primus_v4.models.deepseek_v41.model import DeepseekV41Model
from primus_v4.models.deepseek_v41.params import param_counts
from primus_v4.models.deepseek_v41.release import config_json, export, load
from primus_v4.models.deepseek_v41.release import state_dict_adapter as names
from primus_v4.models.deepseek_v41.release.kept_base import keep_release_base, release_rounding
from primus_v4.models.deepseek_v41.speculate import speculate
from primus_v4.models.model_spec import MemoryTerms, ModelSpec, ReleaseFormat

log = get_logger(__name__)


def _config_json(cfg: DeepseekV41Config) -> dict[str, Any]:
    out = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": config_json.config_to_release(cfg),
    }
    if cfg.vision_config is not None:  # the image encoder's sizes, as the release gives them
        out["vision_config"] = cfg.vision_config
    return out


def _step_hooks(modules: Any, section: Any, *, group: Any = None) -> list[Any]:
    """DeepSeek-V4's router bias update; with `model.draft.train: only` on the drafter's routers
    alone (the frozen backbone's gate biases stay the release's)."""
    if section.draft.train == "only":
        modules = [m.dspark for m in modules if getattr(m, "dspark", None) is not None]
    return v4._step_hooks(modules, section, group=group)


def _use_tokenizer(module: Any, tokenizer_dir: Any) -> None:
    """The Engram token map of the run's tokenizer on a drawn model (a whole model or a
    pipeline stage: they share one `engram_rows`), as the loader of the run's export sets it;
    refused unless its size is the config's `engram_compressed_vocab_size`. A tokenizer of
    another vocabulary size than the model's cannot map its ids: token id mod the compressed
    size stays (said once in the log)."""
    target = getattr(module, "module", module)  # a wrapper's inner model
    rows = getattr(target, "engram_rows", None)
    if rows is None:
        return
    ids = engram_vocab.cached_token_map(tokenizer_dir).ids
    if ids.size == target.cfg.vocab_size:
        ids = engram_vocab.token_map_of(tokenizer_dir, target.cfg)
    else:
        log.info("Engram token map: token id mod %d (the tokenizer at %s has %d ids, the model's "
                 "vocab_size is %d)", target.cfg.engram_compressed_vocab_size, tokenizer_dir,
                 ids.size, target.cfg.vocab_size)  # fmt: skip
        return
    rows.set_token_map(torch.from_numpy(ids))


def _attach_images(module: Any, release: Any, *, device: Any) -> str:
    """The release's image encoder's frozen parts (vision tower, aligner, span vectors, less
    those the model trains itself: `vision_train`) on the backbone, in the model's dtype; its
    forward then fills image spans (`DeepseekV41Model.set_image_encoder`). Returns what trains
    and what is frozen, in words."""
    from primus_v4.models.deepseek_v41.vision import load_image_encoder

    target = getattr(module, "module", module)  # a wrapper's inner model
    held, dtype = target.cfg.vision_train, target.embedding.weight.dtype
    own = [(n, p) for n, p in target.named_parameters()
           if n.startswith(("vision.", "aligner.", "image_"))]  # fmt: skip
    adapters = sum(p.numel() for n, p in own if p.requires_grad and ".lora_" in n)
    trained = sum(p.numel() for n, p in own if p.requires_grad) - adapters
    how = (f"{trained} parameters of it train" if trained else "") + (
        f"{' and ' if trained else ''}LoRA adapters ({adapters} parameters) on it train"
        if adapters else "")  # fmt: skip
    if held != "all":
        encoder = load_image_encoder(release, dtype=dtype, tower_only=held == "aligner")
        target.set_image_encoder(encoder.to(device))
    frozen = {"frozen": "the vision tower, aligner and span vectors are frozen",
              "aligner": "the vision tower is frozen"}.get(held)  # fmt: skip
    return "; ".join(x for x in (how, frozen and f"{frozen} ({dtype})") if x)


SPEC = ModelSpec(
    name="deepseek_v41",
    title="DeepSeek-V4.1",
    preset_dir=PRESET_DIR,
    config_class=DeepseekV41Config,
    layer_kinds=LAYER_KINDS,
    param_counts=param_counts,
    build=DeepseekV41Model,
    parallelize=parallelize,
    is_meta=is_meta,
    cp_min_rows=required_local_rows,
    cp_splitter=CpSplitter,
    step_hooks=_step_hooks,
    add_adapters=lora.add_adapters,
    keep_release=keep_release_base,
    release=ReleaseFormat(
        read_config=load.read_config,
        config_json=_config_json,
        config_from_json=config_from_release,
        check=load.check,
        open=load.open_release,
        rank_loader=load.rank_loader,
        load=load.load_pretrained,
        save=export.save_pretrained,
        write_state=export.write_state,
        names=names,
        release_weights=lambda model: list(release_weights(model)),
        release_rounding=release_rounding,
        peft=peft,
        saved_as=names.saved_as,
    ),
    memory=MemoryTerms(
        layer_parts=memory_terms.layer_parts_of,
        layer_role=memory_terms.layer_role,
        stage_rows=memory_terms.stage_rows,
        image_encoder=memory_terms.image_encoder_bytes,
    ),
    speculate=speculate,
    place_tables=place_for_run,
    attach_images=_attach_images,
    use_tokenizer=_use_tokenizer,
)
