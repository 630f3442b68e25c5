"""Released checkpoints in and out of a whole `DeepseekV4Model` (one process).

`load_release(path, dtype=)` builds the model from the directory's config.json on the meta device
(a directory saved by transformers' `save_pretrained` reads the same: its config keys and names
are translated, release_config.hf_to_release and release.from_hf_name),
materializes it in `dtype`, fills every parameter and persistent buffer from the release tensors
through the name table (release.py) and checks that every checkpoint tensor was consumed (or is on
the documented ignore list `release.IGNORED`). `save_release(model, out, dtype=)` writes the
release layout (bf16, or the release's FP8 + FP4 experts) with the release's config.json keys.
IO (positioned reads decoded into the parameters, sharded atomic writes) is release_io.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm import tqdm

from primus_v4.log import get_logger
from primus_v4.models.deepseek_v4 import release
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.release_config import is_hf_config
from primus_v4.models.deepseek_v4.release_io import ReleaseReader, load_workers, write_release

log = get_logger(__name__)


def read_config(path: str | os.PathLike, **overrides) -> DeepseekV4Config:
    """DeepseekV4Config from a release directory's config.json (or the file itself)."""
    import json

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise FileNotFoundError(f"{file}: no config.json; pass a release checkpoint directory")
    d = json.loads(file.read_text())
    if is_hf_config(d):
        log.info(
            "%s: saved by transformers (its own config keys and 'model.' tensor names), read as "
            "the release; it holds no MTP layers (transformers' model has none), so the model "
            "has none either",
            file,
        )
    return release.config_from_release(d, source=str(file), **overrides)


def check_consumed(reader: ReleaseReader, cfg: DeepseekV4Config) -> None:
    """Every checkpoint tensor is one of the config's release tensors (or on `release.IGNORED`)
    and every release tensor of the config exists; otherwise raise naming each tensor with both
    shapes. Names and shapes only: nothing is read."""
    wanted = release.release_tensors(cfg)
    have = set(reader.names())
    missing = [n for n in wanted if n not in have]
    unused = sorted(n for n in have - set(wanted) if not release.ignored(n))
    wrong = [n for n in wanted if n in have and tuple(reader.shape(n)) != wanted[n].shape]
    if missing or unused or wrong:
        lines = [
            f"  missing from the checkpoint: {n} (model wants {wanted[n].shape})" for n in missing
        ]
        lines += [
            f"  not used by the model: {n} {list(reader.shape(n))} (no parameter of this config)"
            for n in unused
        ]
        lines += [
            f"  shape mismatch: {n} is {list(reader.shape(n))} in the checkpoint, the model "
            f"wants {list(wanted[n].shape)}"
            for n in wrong
        ]
        raise ValueError(
            f"{reader.directory}: the checkpoint does not match its config ({len(missing)} "
            f"missing, {len(unused)} unused, {len(wrong)} mismatched):\n" + "\n".join(lines[:40])
        )


@torch.no_grad()
def load_release(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    **model_kwargs,
):
    """A whole DeepseekV4Model with the release's weights (see the module docstring)."""
    from primus_v4.models.deepseek_v4.init import init_buffers
    from primus_v4.models.deepseek_v4.model import DeepseekV4Model

    cfg = read_config(path)
    with torch.device("meta"):
        model = DeepseekV4Model(cfg, **model_kwargs)
    model.to(dtype)  # still on meta: nothing is allocated twice
    _restore_float32(model)
    model.to_empty(device=device)
    init_buffers(model)
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    targets = {n: own[n] for n in model.state_dict()}
    with ReleaseReader(path) as reader:
        check_consumed(reader, cfg)
        total = len(release.needed(cfg, targets))
        bar = tqdm(total=total, desc="loading", unit="tensor", disable=not progress)

        with reader.concurrent(load_workers(), progress=bar.update) as read_into:
            release.fill_state(cfg, targets, read_into=read_into)
        bar.close()
    return model


def _restore_float32(model: torch.nn.Module) -> None:
    """Tensors the model keeps in float32 whatever its dtype (mHC, RoPE frequencies; the router
    keeps its bias float32 by itself)."""
    from primus_v4.models.deepseek_v4.hyper_connection import HyperHead, HyperMixer
    from primus_v4.models.deepseek_v4.rope import RotaryEmbedding

    for m in model.modules():
        if isinstance(m, (HyperMixer, HyperHead, RotaryEmbedding)):
            m.float()


def save_release(
    model,
    out: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    extra_files=(),
    progress: bool = True,
):
    """Write `model` (a whole DeepseekV4Model) in the release layout; returns the summary."""
    cfg = model.cfg
    kinds = {r.name: r.kind for r in release.release_tensors(cfg).values()}
    state = model.state_dict()
    names = release.needed(cfg, list(state))
    bar = tqdm(total=len(names), desc="saving", unit="tensor", disable=not progress)
    tensors = release.to_release(cfg, state)
    try:
        return write_release(
            out,
            tensors,
            kinds,
            release.config_to_release(cfg),
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            extra_files=extra_files,
            progress=bar.update,
        )
    finally:
        bar.close()
