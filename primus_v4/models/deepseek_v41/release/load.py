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
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from primus_v4.checkpoint_formats.sharded import CheckpointReader
from primus_v4.errors import CheckpointFormatError
from primus_v4.log import get_logger
from primus_v4.models.deepseek_v4.weight_init import init_buffers
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.model import DeepseekV41Model
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release.config_json import config_from_release

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
    left = sorted(n for n in names if adapter.non_text(n))
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


def reader_get(reader: CheckpointReader, dtype: torch.dtype) -> Callable[[str, str], torch.Tensor]:
    """get(release_name, kind) -> the decoded tensor in `dtype`."""

    def get(name: str, kind: str) -> torch.Tensor:
        return reader.read(name, dtype, fmt=adapter.FORMATS.get(kind))

    return get


@torch.no_grad()
def load_rank_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill every parameter and persistent buffer of `model` (a whole model or a rank's slice,
    our names) from the release; reads only the tensors those need."""
    cfg = model.cfg
    with open_release(path) as reader:
        left = check_release(reader, cfg)
        if left:
            log.info("%s: not part of the text model, left in the release: %s", path,
                     ", ".join(left))  # fmt: skip
        state = model.state_dict()
        lo = getattr(model, "expert_offset", None)
        get = reader_get(reader, torch.float32)
        table = adapter.name_table(cfg)
        for key, dst in state.items():
            if key not in table:
                continue  # derived buffers (RoPE, token map) are not checkpoint state
            values = adapter.build_state(cfg, get, [key])[key]
            if lo is not None and values.shape != dst.shape:
                values = values[lo : lo + dst.shape[0]]
            dst.copy_(values.to(dst.dtype))
    missing = [
        k for k in state if k not in adapter.name_table(cfg) and k in dict(model.named_parameters())
    ]
    if missing:
        raise CheckpointFormatError(f"{path}: parameters without a release tensor: {missing}")


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = False,
    keep_release: bool = False,
    token_map: torch.Tensor | None = None,
) -> DeepseekV41Model:
    """The whole V4.1 text model of a release directory, in `dtype` on `device`.

    token_map: the Engram token map ([vocab] int64); default: built from the release's
    tokenizer (`engram_vocab.py`)."""
    del progress
    if keep_release:
        raise NotImplementedError("DeepSeek-V4.1 does not keep its base as released yet")
    cfg = read_config(path)
    with torch.device("meta"):
        model = DeepseekV41Model(cfg)
    model.to_empty(device="cpu")
    init_buffers(model)
    load_rank_weights(model, path)
    if cfg.engram_layer_ids:
        model.set_token_map(token_map if token_map is not None else release_token_map(path, cfg))
    return model.to(device=device, dtype=dtype)


def release_token_map(path: str | os.PathLike, cfg: DeepseekV41Config) -> torch.Tensor:
    """The Engram token map of the release's own tokenizer."""
    from primus_v4.models.deepseek_v41 import engram_vocab

    return engram_vocab.token_map_of(Path(path), cfg)
