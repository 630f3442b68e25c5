"""Released checkpoints in: a whole `DeepseekV4Model`, or one rank's slice of it.

`load_pretrained(path, dtype=)` builds the model from the directory's config.json on the meta
device (a directory saved by transformers' `save_pretrained` reads the same: its config keys and
names are translated, config_json.hf_to_release and state_dict_adapter.from_hf_name),
materializes it in `dtype`, fills every parameter and persistent buffer from the release tensors
through the name table and checks that every checkpoint tensor was consumed (or is on the
documented ignore list `state_dict_adapter.IGNORED`).

`load_rank_weights(model, path)` fills a model the trainer has already cut to the rank's
pipeline stage and expert shard (models/deepseek_v4/infra/parallelize.py): our tensor names carry
global layer indices and an expert shard knows its global rows (`MoE.expert_offset`), so the
name table turns the rank's state-dict keys into exactly the release tensors it needs; each is
read from its shard with positioned reads and decoded straight into the parameter (in its
dtype). Weights kept as released (`model.lora.base: release`, release_base.ReleaseWeight) are
read undecoded into their byte buffers instead. Before reading, every rank checks the
checkpoint's names against the whole model's (names only): a checkpoint of another model fails
on every rank with the same message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from primus_v4.checkpoint_formats.sharded import CheckpointReader, load_workers
from primus_v4.errors import CheckpointFormatError
from primus_v4.log import get_logger
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.hyper_connection import HyperHead, HyperMixer
from primus_v4.models.deepseek_v4.model import DeepseekV4Model
from primus_v4.models.deepseek_v4.moe import MoE
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v4.release.config_json import is_hf_config
from primus_v4.models.deepseek_v4.release.kept_base import keep_release_base
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding
from primus_v4.models.deepseek_v4.weight_init import init_buffers

log = get_logger(__name__)


def read_config(path: str | os.PathLike, **overrides) -> DeepseekV4Config:
    """DeepseekV4Config from a release directory's config.json (or the file itself); keyword
    overrides set our own training fields (see config_json.py)."""
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
    cfg = adapter.config_from_release(d, source=str(file), **overrides)
    if cfg.dspark and str(file) not in _TOLD:
        _TOLD.add(str(file))
        log.info(
            "%s: a DSpark drafter (mtp.*, keys %s) in place of a classic MTP block: it is not "
            "trained (the MTP loss is off) and exports carry it byte for byte",
            file,
            sorted(k for k in cfg.dspark if k.startswith("dspark_")),
        )
    return cfg


_TOLD: set[str] = set()  # releases whose drafter the log has named (once per process)


def open_release(path: str | os.PathLike) -> CheckpointReader:
    """A reader of a release directory under the release's tensor names (a transformers-saved
    directory's names are translated)."""
    return CheckpointReader(path, rename=adapter.stored_name_map)


def check_consumed(reader: CheckpointReader, cfg: DeepseekV4Config) -> None:
    """Every checkpoint tensor is one of the config's release tensors (or on `adapter.IGNORED`)
    and every release tensor of the config exists; otherwise raise naming each tensor with both
    shapes. Names and shapes only: nothing is read."""
    wanted = adapter.release_tensors(cfg)
    have = set(reader.names())
    missing = [n for n in wanted if n not in have]
    carried = set(adapter.carried(cfg, have))
    unused = sorted(n for n in have - set(wanted) - carried if not adapter.ignored(n))
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
        raise CheckpointFormatError(
            f"{reader.directory}: the checkpoint does not match its config ({len(missing)} "
            f"missing, {len(unused)} unused, {len(wrong)} mismatched):\n" + "\n".join(lines[:40])
        )


def check_release(
    directory: str | os.PathLike, cfg: DeepseekV4Config, *, keep_release: bool = False
) -> None:
    """A release directory a run can load: its index, every shard's header and byte ranges
    (a missing or truncated shard), and its tensor names and shapes against `cfg`; with
    `keep_release`, that every weight the release format quantizes is stored FP8 / FP4. Reads no
    tensor, so a run (and `--dry-run`) refuses a broken release in seconds, not after start-up."""
    with open_release(directory) as reader:
        check_consumed(reader, cfg)
        if keep_release:
            for name, r in adapter.release_tensors(cfg).items():
                stored = reader.storage(name)
                if r.kind in ("fp8", "fp4") and stored not in ("fp8", "fp4"):
                    raise CheckpointFormatError(
                        f"'{name}' is stored as {stored}, not FP8 / FP4, so model.lora.base: "
                        "release has no release bytes to keep; use model.lora.base: bfloat16 "
                        "(or an FP8 release)"
                    )


@dataclass(kw_only=True, frozen=True)
class RankLoad:
    """What one rank read: tensors filled, stored bytes read, the checkpoint's total bytes."""

    tensors: int
    bytes_read: int
    checkpoint_bytes: int


def expert_range(model: nn.Module) -> tuple[int, int] | None:
    """Global experts [lo, hi) this rank's MoE layers hold (all of them alike), None if no MoE."""
    ranges = set()
    for m in model.modules():
        if isinstance(m, MoE):
            rows = (m.w_gate_up if m.w_gate_up_release is None else m.w_gate_up_release).shape[0]
            lo = getattr(m, "expert_offset", 0)
            ranges.add((lo, lo + rows))
    if len(ranges) > 1:
        raise ValueError(f"MoE layers of one rank hold different experts: {sorted(ranges)}")
    return ranges.pop() if ranges else None


@torch.no_grad()
def load_rank_weights(
    model: nn.Module, directory: str | os.PathLike, *, progress: bool = False
) -> RankLoad:
    """Fill every parameter and persistent buffer of `model` (a whole model, a pipeline stage,
    an expert shard) from the release at `directory`, reading only the tensors it keeps."""
    cfg = model.cfg  # type: ignore[attr-defined]
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    targets = {name: own[name] for name in model.state_dict()}
    experts = expert_range(model)
    with open_release(directory) as reader:
        check_consumed(reader, cfg)
        wanted = adapter.needed(cfg, list(targets), expert_range=experts)
        kept = list(release_weights(model))
        stored = [(n, part) for w in kept for n, part in _stored_parts(cfg, w, experts)]
        wanted += [n for n, _ in stored]
        bar = tqdm(total=len(wanted), desc="loading", unit="tensor", disable=not progress)

        with bar, reader.concurrent(load_workers(), progress=bar.update) as read_into:
            adapter.fill_state(cfg, targets, expert_range=experts, read_into=read_into)
        for name, (codes, scales) in stored:
            reader.read_stored_into(name, codes, scales)
            bar.update(1)
        done = RankLoad(
            tensors=len(wanted), bytes_read=reader.bytes_read, checkpoint_bytes=reader.total_bytes()
        )
    log.info(
        "loaded %d tensors from %s: %.1f MiB of its %.1f MiB (experts %s)",
        done.tensors, Path(directory), done.bytes_read / 2**20, done.checkpoint_bytes / 2**20,
        experts,
    )  # fmt: skip
    return done


def _stored_parts(cfg: DeepseekV4Config, weight: nn.Module, experts: tuple[int, int] | None):
    """(release name, (codes, scales) buffers) of a weight kept as released."""
    entry = adapter.name_table(cfg)[weight.ours]
    return zip(entry.release_names(experts), weight.stored_parts(), strict=True)


def rank_loader(
    directory: str | os.PathLike, *, progress: bool = False
) -> Callable[[nn.Module], None]:
    """The `weights=` callback of `parallelize`: load this rank's slice of `directory`."""

    def load(model: nn.Module) -> None:
        load_rank_weights(model, directory, progress=progress)

    return load


def _restore_float32(model: nn.Module) -> None:
    """Tensors the model keeps in float32 whatever its dtype (mHC, RoPE frequencies; the router
    keeps its bias float32 by itself)."""
    for m in model.modules():
        if isinstance(m, (HyperMixer, HyperHead, RotaryEmbedding)):
            m.float()


@torch.no_grad()
def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    keep_release: bool = False,
    **model_kwargs,
) -> DeepseekV4Model:
    """The model of a release directory (config.json + safetensors shards), every parameter
    and persistent buffer loaded, FP8/FP4 decoded into `dtype` (see the module docstring), or
    with `keep_release` kept as stored and decoded per use (models/common/kept_base.py)."""
    cfg = read_config(path)
    with torch.device("meta"):
        model = DeepseekV4Model(cfg, **model_kwargs)
    model.to(dtype)  # still on meta: nothing is allocated twice
    _restore_float32(model)
    if keep_release:
        keep_release_base(model, cfg, dtype=dtype)
    model.to_empty(device=device)
    init_buffers(model)
    load_rank_weights(model, path, progress=progress)
    model.release_dir = Path(path)  # what save_pretrained carries a DSpark drafter from
    return model
