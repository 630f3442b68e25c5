"""A V4.1 release directory in: the config, the whole text model, or one rank's slice of it.

Every text-backbone tensor is read through the name table and decoded exactly into the
parameter's dtype: FP8 with 32 x 32 e8m0 blocks, FP4 experts (two e2m1 codes per int8 byte, an
e8m0 scale per 32 inputs), Engram tables as FP8 rows with an e8m0 scale per 32 values, bf16 and
fp32 as stored. A rank asks only for its own state-dict keys (its stage, its expert rows), so it
reads only those tensors. Tensors of the release that are not the text model (vision tower,
`aligner.*`, `image_*`, DSpark `mtp.*`, image routing biases) are named in one log line and left
in the release; any other unconsumed tensor is an error naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from primus_v4.checkpoint_formats.sharded import CheckpointReader
from primus_v4.errors import CheckpointFormatError
from primus_v4.log import get_logger
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.deepseek_v4.release.load import _restore_float32
from primus_v4.models.deepseek_v4.weight_init import init_buffers
from primus_v4.models.deepseek_v41.config import DeepseekV41Config, config_from_release
from primus_v4.models.deepseek_v41.model import DeepseekV41Model
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release import tensors
from primus_v4.models.deepseek_v41.release.kept_base import KEPT, keep_release_base

log = get_logger(__name__)


def read_config(path: str | os.PathLike, **overrides) -> DeepseekV41Config:
    """DeepseekV41Config from a release directory's config.json (or the file itself)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise FileNotFoundError(f"{file}: no config.json; pass a release checkpoint directory")
    return config_from_release(json.loads(file.read_text()), source=str(file), **overrides)


def open_release(path: str | os.PathLike) -> CheckpointReader:
    return CheckpointReader(path)


def check_release(reader: CheckpointReader, cfg: DeepseekV41Config) -> list[str]:
    """Names and shapes of the release against the model (no tensor read); returns the
    non-text tensors left in the release. Raises naming every unknown or missing tensor."""
    expected = adapter.release_tensors(cfg)
    names = set(reader.names())
    left = sorted(n for n in names if tensors.not_text(n))
    unknown = sorted(names - set(expected) - set(left))
    missing = sorted(set(expected) - names)
    if unknown or missing:
        raise CheckpointFormatError(
            f"{reader.directory}: not this model's checkpoint: unknown tensors {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}, missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    for name, (shape, _) in expected.items():
        reader.read_check(name, shape)
    return left


def _expert_range(model: nn.Module, key: str) -> tuple[int, int] | None:
    """The global expert rows [lo, hi) a rank's expert weight `key` holds (None: not experts)."""
    if not key.endswith((".moe.w_gate_up", ".moe.w_down")):
        return None
    moe, attr = model.get_submodule(key.rsplit(".", 1)[0]), key.rsplit(".", 1)[1]
    lo = getattr(moe, "expert_offset", 0)
    held = getattr(moe, f"{attr}_release", None)  # kept as released (release/kept_base.py)
    return lo, lo + (held if held is not None else getattr(moe, attr)).shape[0]


@torch.no_grad()
def load_rank_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    progress: bool = False,
    token_map: torch.Tensor | None = None,
) -> None:
    """Fill every parameter and persistent buffer of `model` (a whole model or a rank's expert
    slice; our names) from the release, reading only the tensors those hold; then the Engram
    token map (`token_map`, default the release tokenizer's)."""
    del progress
    cfg = model.cfg
    table = adapter.name_table(cfg, drafter=getattr(model, "dspark", None) is not None)
    state = model.state_dict()
    read = {name for entry in table.values() for name in entry.release}
    with open_release(path) as reader:
        left = [name for name in check_release(reader, cfg) if name not in read]
        if left:
            log.info("%s: not part of the text model, left in the release: %s", path,
                     tensors.parts_summary(left))  # fmt: skip
        for key, dst in state.items():
            if key not in table:
                continue  # config-derived buffers (RoPE, the token map) are no checkpoint state
            entry = table[key]
            experts = _expert_range(model, key)
            if experts is not None:
                entry = adapter.expert_slice(entry, *experts)
            parts = [reader.read(n, dst.dtype, fmt=tensors.FORMATS.get(entry.kind))
                     for n in entry.release]  # fmt: skip
            dst.copy_(adapter.join(entry, parts))
        for kept in release_weights(model):  # the stored bytes, undecoded
            entry = table[kept.ours]
            experts = _expert_range(model, kept.ours)
            if experts is not None:
                entry = adapter.expert_slice(entry, *experts)
            for name, (codes, scales) in zip(entry.release, kept.stored_parts(), strict=True):
                tensors.check_stored(reader, name, entry.kind)
                reader.read_stored_into(name, codes, scales)
        placed = _read_placed_rows(model, reader, table)
        _read_image_routing(model, reader)
    unfilled = sorted(n for n, _ in model.named_parameters() if n not in table and n not in placed)
    if unfilled:
        raise CheckpointFormatError(f"{path}: parameters without a release tensor: {unfilled}")
    if cfg.engram_layer_ids:
        model.set_token_map(release_token_map(path, cfg) if token_map is None else token_map)


def _read_image_routing(model: nn.Module, reader: CheckpointReader) -> None:
    """Each routed layer's `ffn.gate.bias_vl` (the expert-selection bias of image positions)
    into its router, where the release has one (a buffer outside checkpoints: the release is
    read again on resume)."""
    names = set(reader.names())
    for i, block in enumerate(getattr(model, "layers", ())):
        router = block.moe.router
        name = f"layers.{getattr(block, 'layer_idx', i)}.ffn.gate.bias_vl"
        if getattr(router, "bias_vl", None) is not None and name in names:
            router.bias_vl.copy_(
                reader.read(name, torch.float32, shape=tuple(router.bias_vl.shape))
            )


def _read_placed_rows(model: nn.Module, reader: CheckpointReader, table: dict) -> set[str]:
    """Engram tables placed already (engram_placement): only the rows this rank holds are read,
    in their FP8 encoding (decoded into a trainable shard, kept as codes when frozen). Returns
    the parameter names filled."""
    from primus_v4.models.deepseek_v41.engram_placement import engram_modules

    filled = set()
    for name, module in engram_modules(model):
        store = getattr(module, "placed", None)
        if store is None:
            continue
        (release,) = table[f"{name}.table"].release
        store.fill_encoded(*reader.read_stored_rows(release, store.lo, store.hi))
        filled.update(f"{name}.placed.{n}" for n, _ in store.named_parameters())
    return filled


def rank_loader(directory: str | os.PathLike, *, progress: bool = False):
    """The `weights=` callback of `parallelize`: load this rank's slice of `directory`."""

    def load(model: nn.Module) -> None:
        load_rank_weights(model, directory, progress=progress)

    return load


def check(directory: str | os.PathLike, cfg: DeepseekV41Config, *, keep_release: bool = False):
    """Index, shard headers and names of `directory` against the model config (no tensor read);
    with `keep_release`, that every weight kept as released is stored FP8 / FP4; and that the
    release's tokenizer makes the Engram token map the config sizes (`release_token_map`, which
    the load builds from the same file; a release without one is refused by the load, naming
    the file)."""
    if (Path(directory) / "tokenizer.json").is_file():
        release_token_map(directory, cfg)
    with open_release(directory) as reader:
        check_release(reader, cfg)
        if keep_release:
            for name, (_, kind) in adapter.release_tensors(cfg).items():
                if kind in KEPT:
                    tensors.check_stored(reader, name, kind)


@torch.no_grad()
def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
    keep_release: bool = False,
    token_map: torch.Tensor | None = None,
    drafter: bool = False,
    vision: str = "frozen",
) -> DeepseekV41Model:
    """The whole V4.1 text model of a release directory, every parameter decoded into `dtype`.

    token_map: the Engram token map ([vocab] int64); default: the one of the release's own
    tokenizer (`engram_vocab.token_map_of`, checked against the config's compressed size).
    keep_release: the FP8 / FP4 weights kept as stored, decoded per use (release/kept_base.py).
    drafter: the release's DSpark draft stages (`mtp.*`) too, as `model.dspark` (dspark.py).
    vision: the image encoder's parts held (and trainable) as parameters of the model
    (`vision_train`: `aligner`, `all`); the frozen rest is attached by `set_image_encoder`."""
    cfg = read_config(path, **({} if vision == "frozen" else {"vision_train": vision}))
    with torch.device("meta"):
        model = DeepseekV41Model(cfg, drafter=drafter)
    model.to(dtype)  # still on meta: nothing is allocated twice
    _restore_float32(model)
    if keep_release:
        keep_release_base(model, cfg, dtype=dtype)
    model.to_empty(device=device)
    init_buffers(model)
    load_rank_weights(model, path, progress=progress, token_map=token_map)
    model.release_source = Path(path)  # where an export finds the tensors it carries over
    return model


def release_token_map(path: str | os.PathLike, cfg: DeepseekV41Config) -> torch.Tensor:
    """The Engram token map of the release's own tokenizer (refused unless its size is the
    config's `engram_compressed_vocab_size`)."""
    from primus_v4.models.deepseek_v41 import engram_vocab

    return torch.from_numpy(engram_vocab.token_map_of(Path(path), cfg)).to(torch.int64)
