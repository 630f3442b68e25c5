"""Released checkpoints in and out of a whole `DeepseekV4Model` (one process).

`load_release(path, dtype=)` builds the model from the directory's config.json on the meta device,
materializes it in `dtype`, fills every parameter and persistent buffer from the release tensors
through the name table (release.py) and checks that every checkpoint tensor was consumed (or is on
the documented ignore list `release.IGNORED`). `save_release(model, out, dtype=)` writes the
release layout (bf16, or the release's FP8 + FP4 experts) with the release's config.json keys.
IO (memory-mapped shards, dequantization, sharded atomic writes) is release_io.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm import tqdm

from primus_v4.models.deepseek_v4 import release
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.release_io import ReleaseReader, write_release


def read_config(path: str | os.PathLike, **overrides) -> DeepseekV4Config:
    """DeepseekV4Config from a release directory's config.json (or the file itself)."""
    import json

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise FileNotFoundError(f"{file}: no config.json; pass a release checkpoint directory")
    return release.config_from_release(json.loads(file.read_text()), source=str(file), **overrides)


def _check_consumed(reader: ReleaseReader, wanted: list[str], shapes: dict[str, tuple]) -> None:
    """Every checkpoint tensor is used (or ignored on purpose) and every wanted one exists."""
    have = set(reader.names())
    missing = [n for n in wanted if n not in have]
    unused = sorted(n for n in have - set(wanted) if not release.ignored(n))
    if missing or unused:
        lines = [
            f"  missing from the checkpoint: {n} (model wants {shapes.get(n)})" for n in missing
        ]
        lines += [
            f"  not used by the model: {n} {list(reader.shape(n))} (no parameter of this config)"
            for n in unused
        ]
        raise ValueError(
            f"{reader.directory}: the checkpoint does not match its config "
            f"({len(missing)} missing, {len(unused)} unused):\n" + "\n".join(lines[:40])
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
    model.to_empty(device=device)
    model.to(dtype)
    _restore_float32(model)
    init_buffers(model)
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state_keys = list(model.state_dict().keys())
    shapes = {n: tuple(own[n].shape) for n in state_keys}
    wanted = release.needed(cfg, state_keys)
    rel_shapes = {r.name: r.shape for r in release.release_tensors(cfg).values()}
    with ReleaseReader(path) as reader:
        _check_consumed(reader, wanted, rel_shapes)
        bar = tqdm(total=len(wanted), desc="loading", unit="tensor", disable=not progress)

        def get(name: str) -> torch.Tensor:
            return reader.read(name, dtype=_target_dtype(reader.storage(name), dtype))

        built = release.build_state(cfg, shapes, get, progress=bar.update)
        bar.close()
    for name, tensor in built.items():
        own[name].copy_(tensor)
    return model


def _target_dtype(storage: str, dtype: torch.dtype) -> torch.dtype | None:
    """int64 and float32 tensors stay as stored; everything else is read into `dtype`."""
    return None if storage in ("int64", "fp32") else dtype


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
