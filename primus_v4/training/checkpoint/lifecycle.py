"""A run's checkpoints: interval and preemption saves with the resolved config (and the model's
release config) stored beside the shards, `checkpoint.keep_last` pruning, and resume rules.

Which checkpoint a run continues is decided once, before anything is built: the newest one the
integrity check passes (training.checkpoint.integrity.problems), or none. A run with
checkpoint.resume=false refuses a dir that already holds checkpoints instead of mixing two runs.

Resume rules. The checkpoint's own config.yaml is compared with this run's:
  * a different model (preset, overrides, dtype) or pp/cp/ep size is an error listing the keys;
    an override that sets a field to the value the model already has is no change;
  * a run that would drop a part the checkpoint trained, or train one it does not hold (the
    training switches: model.draft.train, model.vision.train, model.lora, model.engram.trainable)
    is an error naming the part and the switch (training.checkpoint.trained_parts);
  * a checkpoint past this run's last step is an error (it would train nothing);
  * anything else may change and is logged. The learning-rate schedule is always this run's
    config (steps, lr, min_lr, warmup) evaluated at the resumed step, never the saved base lr.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from primus_v4.config import RunConfig, dump_yaml, to_dict
from primus_v4.config.resolve import model_config
from primus_v4.durable import remove_stale
from primus_v4.errors import CheckpointError, PrimusError, ResumeError
from primus_v4.log import get_logger
from primus_v4.training.checkpoint import integrity
from primus_v4.training.checkpoint.store import CheckpointManager, load_latest
from primus_v4.training.checkpoint.trained_parts import check_trained_parts

log = get_logger(__name__)

CONFIG_FILE = integrity.CONFIG_FILE
# The model a checkpoint holds, as the release's config.json keys: what `primus-v4 export`
# writes, independent of the preset files or the release dir the run started from.
MODEL_CONFIG_FILE = "model_config.json"
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


def model_config_text(model: Any) -> str:
    """The release config.json text of a model config (stored beside each checkpoint)."""
    from primus_v4.models import spec_of

    return json.dumps(spec_of(model).release.config_json(model), indent=1, sort_keys=True) + "\n"


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


def _effective(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _same_model_values(
    changes: dict[str, tuple[Any, Any]], cfg: RunConfig
) -> dict[str, tuple[Any, Any]]:
    """Drop `model.overrides.K` changes that only set K to the value the preset (or the release's
    config.json) already has: the model is the same either way."""
    # {} flattens to a value of its own: "no overrides" on one side, keys on the other
    changes = {
        k: v
        for k, v in changes.items()
        if not (k == "model.overrides" and all(side in (None, {}) for side in v))
    }
    keys = [k for k in changes if k.startswith("model.overrides.")]
    if not keys:
        return changes
    try:
        base = model_config(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, overrides={}))
        )
    except PrimusError:
        return changes  # e.g. the release dir is gone: compare the overrides as written
    same = []
    for key in keys:
        field = key.removeprefix("model.overrides.")
        if "." in field or not hasattr(base, field):
            continue
        base_value = _effective(getattr(base, field))
        old, new = changes[key]
        saved = base_value if old is None else _effective(old)
        current = base_value if new is None else _effective(new)
        if saved == current:
            same.append(key)
    return {k: v for k, v in changes.items() if k not in same}


def check_resumable(path: Path, cfg: RunConfig, world: int) -> None:
    """Raise ResumeError when checkpoint `path` cannot continue this run; log allowed changes.
    The checkpoint's own config.yaml (checksummed in its manifest) is what it is compared with."""
    try:
        saved = yaml.safe_load((path / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: unreadable ({exc}); the checkpoint's own "
                              "config is needed to resume it") from None  # fmt: skip
    changes = config_changes(saved if isinstance(saved, dict) else {}, to_dict(cfg))
    fatal = _same_model_values({k: v for k, v in changes.items() if k.startswith(MUST_MATCH)}, cfg)
    if fatal:
        raise ResumeError(
            f"cannot resume from {path}: the run changed in {_describe(fatal)}. Resume needs the "
            "same model and the same pp/cp/ep sizes (only the data-parallel size may change); use "
            "a new checkpoint.dir (or restore the old values)"
        )
    model = saved.get("model") if isinstance(saved, dict) else None
    check_trained_parts(str(path), model if isinstance(model, dict) else {}, to_dict(cfg)["model"])
    saved_world = integrity.read_complete(path).get("world_size", world)
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
    other = {k: v for k, v in changes.items() if k not in schedule and not k.startswith(MUST_MATCH)}
    if other:
        log.info("resuming with changed settings: %s", _describe(other))


def check_steps(path: Path, total_steps: int) -> None:
    """A checkpoint past the run's last step would train nothing and report the old run as this
    one: refuse it. At the last step exactly (a finished run started again) nothing is left."""
    step = int(integrity.read_complete(path).get("step", 0))
    if step > total_steps:
        raise ResumeError(
            f"cannot resume from {path}: it is at step {step}, past this run's {total_steps} "
            "steps (train.steps / train.epochs); raise train.steps to continue it, or use a new "
            "checkpoint.dir for a shorter run"
        )
    if step == total_steps:
        log.warning("checkpoint %s is at this run's last step %d: nothing left to train", path,
                    step)  # fmt: skip


def refuse_foreign(root: Path) -> None:
    """checkpoint.resume=false into a dir that already holds checkpoints would mix two runs there
    (and keep_last would delete one run's for the other's): refuse, naming them."""
    if not root.is_dir():
        return
    found = sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp_step_")))
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ResumeError(
            f"checkpoint.dir {root} already holds checkpoints ({shown}) and checkpoint.resume is "
            "false: this run would mix its checkpoints with theirs. Use a new checkpoint.dir, "
            "move them away, or set checkpoint.resume=true to continue them"
        )


def apply_schedule(optimizer: Any, scheduler: Any, lr: float) -> None:
    """This run's schedule at the scheduler's (resumed) position: the loaded state carries the
    saved base lr, which would otherwise be mixed into the new schedule."""
    step = scheduler.last_epoch
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(step)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


_UNSET = object()


class RunCheckpoints(CheckpointManager):
    """CheckpointManager for one run: stores the config (and the model's release config) with
    every checkpoint, picks the checkpoint to resume (or refuses), prunes."""

    def __init__(self, cfg: RunConfig, *, world: int, model: Any = None) -> None:
        ck = cfg.checkpoint
        assert ck.dir is not None
        super().__init__(ck.dir, interval=ck.interval, resume=ck.resume)
        self.cfg = cfg
        self.world = world
        self.keep_last = ck.keep_last
        self.files = {CONFIG_FILE: dump_yaml(cfg)}
        if model is not None:
            self.files[MODEL_CONFIG_FILE] = model_config_text(model)
        self.rank_files: dict[str, str] = {}  # this rank's own files in every step it saves
        self._resume_from: Any = _UNSET

    def resume_point(self) -> Path | None:
        """The verified checkpoint this run continues (None: it starts from scratch), after the
        resume rules; collective, decided once. Refuses a non-resuming run into a dir that holds
        checkpoints."""
        if self._resume_from is _UNSET:
            self._resume_from = self._choose()
        return self._resume_from

    def _choose(self) -> Path | None:
        if integrity._rank_world()[0] == 0:
            left = remove_stale(self.root, f".{integrity.LATEST}.tmp.")
            if left:
                log.warning("removed %s in %s, left by an update of `latest` that was killed",
                            ", ".join(left), self.root)  # fmt: skip
        if not self.resume:
            refuse_foreign(self.root)
            return None
        path = integrity.newest_intact(self.root, needs_config=True)
        if path is None:
            log.info("no complete checkpoint in %s; starting from scratch", self.root)
            return None
        check_resumable(path, self.cfg, self.world)
        return path

    def maybe_save(self, step: int, *, final: bool = False, **state: Any) -> Path | None:
        path = super().maybe_save(step, final=final, extra_files=self.files,
                                  rank_files=self.rank_files, **state)  # fmt: skip
        if path is not None:
            integrity.prune(self.root, self.keep_last, newest=path)
        return path

    def load_latest(self, **state: Any) -> int | None:
        path = self.resume_point()
        if path is None:
            return None
        step = load_latest(self.root, path=path, **state)
        if state.get("scheduler") is not None:
            apply_schedule(state["optimizer"], state["scheduler"], self.cfg.train.lr)
        self._last_saved = step
        return step
