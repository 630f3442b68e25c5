"""A run's checkpoints: interval and preemption saves with the resolved config stored beside the
shards, `checkpoint.keep_last` pruning, and resume rules.

Resume rules. The stored config is compared with this run's:
  * a different model (preset, overrides, dtype) or world size is an error listing the keys;
  * anything else may change and is logged. The learning-rate schedule is always this run's
    config (steps, lr, min_lr, warmup) evaluated at the resumed step, never the saved base lr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from primus_v4.config import RunConfig, dump_yaml, to_dict
from primus_v4.errors import ConfigError
from primus_v4.log import get_logger
from primus_v4.training import checkpoint_integrity as integrity
from primus_v4.training.checkpoint import CheckpointManager, load_latest

log = get_logger(__name__)

CONFIG_FILE = "config.yaml"
# Keys whose change makes the saved weights and optimizer state meaningless for this run. The
# data-parallel size may change (the sharded optimizer state is resharded by DCP); the other axes
# decide which layers and experts a rank holds, so they must stay.
MUST_MATCH = (
    "model.preset",
    "model.overrides",
    "model.dtype",
    "parallel.pp",
    "parallel.pp_layout",
    "parallel.cp",
    "parallel.ep",
)
SCHEDULE = ("train.steps", "train.epochs", "train.lr", "train.min_lr", "train.warmup_steps")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; empty mappings stay as values (so `{}` differs from one
    holding keys)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved, current)} for every key whose value differs."""
    a, b = flatten(saved), flatten(current)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def check_resumable(path: Path, cfg: RunConfig, world: int) -> None:
    """Raise ConfigError when checkpoint `path` cannot continue this run; log allowed changes."""
    try:
        saved = yaml.safe_load((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        log.warning("checkpoint %s stores no run config; resume rules not checked", path)
        return
    changes = config_changes(saved, to_dict(cfg))
    fatal = {k: v for k, v in changes.items() if k.startswith(MUST_MATCH)}
    if fatal:
        raise ConfigError(
            f"cannot resume from {path}: the run changed in {_describe(fatal)}. Resume needs the "
            "same model and the same pp/cp/ep sizes (only the data-parallel size may change); use "
            "a new checkpoint.dir (or restore the old values)"
        )
    saved_world = json.loads((path / "COMPLETE").read_text()).get("world_size", world)
    if saved_world != world:
        log.info(
            "resuming a checkpoint saved by %d ranks on %d ranks: the data-parallel size changed, "
            "the sharded optimizer state is resharded",
            saved_world,
            world,
        )
    schedule = {k: v for k, v in changes.items() if k in SCHEDULE}
    if schedule:
        log.info(
            "resuming with a changed schedule (%s): the new schedule is evaluated from the resumed "
            "step",
            _describe(schedule),
        )
    other = {k: v for k, v in changes.items() if k not in schedule}
    if other:
        log.info("resuming with changed settings: %s", _describe(other))


def apply_schedule(optimizer: Any, scheduler: Any, lr: float) -> None:
    """This run's schedule at the scheduler's (resumed) position: the loaded state carries the
    saved base lr, which would otherwise be mixed into the new schedule."""
    step = scheduler.last_epoch
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(step)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class RunCheckpoints(CheckpointManager):
    """CheckpointManager for one run: stores the config, prunes, checks resume rules."""

    def __init__(self, cfg: RunConfig, *, world: int) -> None:
        ck = cfg.checkpoint
        assert ck.dir is not None
        super().__init__(ck.dir, interval=ck.interval, resume=ck.resume)
        self.cfg = cfg
        self.world = world
        self.keep_last = ck.keep_last

    def maybe_save(self, step: int, *, final: bool = False, **state: Any) -> Path | None:
        path = super().maybe_save(
            step, final=final, extra_files={CONFIG_FILE: dump_yaml(self.cfg)}, **state
        )
        if path is not None:
            integrity.prune(self.root, self.keep_last)
        return path

    def load_latest(self, **state: Any) -> int | None:
        if not self.resume:
            return None
        path = integrity.newest_intact(self.root)
        if path is None:
            log.info("no complete checkpoint in %s; starting from scratch", self.root)
            return None
        check_resumable(path, self.cfg, self.world)
        step = load_latest(self.root, path=path, **state)
        if state.get("scheduler") is not None:
            apply_schedule(state["optimizer"], state["scheduler"], self.cfg.train.lr)
        self._last_saved = step
        return step
