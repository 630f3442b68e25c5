"""Fail before work: every path a run will read or write is checked before data is packed or the
model is built, so a wrong path costs a second, not a packing pass or a whole run.

Writable means a file can be created there now: in the directory itself when it exists, else in
its nearest existing parent (where it will be created). The probe file is removed at once and no
directory is created, so a failed check leaves nothing behind. The probe (not `os.access`) also
catches read-only mounts and holds for root, for whom permission bits do not apply.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from primus_v4.config.schema import RunConfig
from primus_v4.data import cache
from primus_v4.data.corpus import resolve_source
from primus_v4.data.mixing import parse_sources
from primus_v4.data.tokenizer import resolve_tokenizer_dir
from primus_v4.durable import writable_problem
from primus_v4.errors import DataError, PathError

# output.tracker -> the module it imports; each is the pip extra of the same name.
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def tracker_available(tracker: str) -> bool:
    module = TRACKER_MODULES.get(tracker)
    return module is None or importlib.util.find_spec(module) is not None


def tracker_missing(tracker: str) -> str:
    """The one line a run without the chosen tracker's package fails with."""
    return (
        f"output.tracker: {tracker} needs the {TRACKER_MODULES[tracker]} package: "
        f"pip install 'primus_v4[{tracker}]', or set output.tracker=none"
    )


def tracker_broken(tracker: str) -> str | None:
    """The one line for a tracker package that is installed but fails to import (the run would
    stop there after packing and building); None when it imports (or no tracker is chosen)."""
    module = TRACKER_MODULES.get(tracker)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # whatever the broken package raises
        return (
            f"output.tracker: {tracker}: the {module} package is installed but fails to import "
            f"({type(exc).__name__}: {exc}); reinstall it (pip install 'primus_v4[{tracker}]') "
            "or set output.tracker=none"
        )
    return None


def run_directories(cfg: RunConfig) -> dict[str, Path]:
    """The directories a run writes, by the config key that sets them (defaults resolved)."""
    dirs = {"output.dir": Path(cfg.output.dir)}
    if cfg.checkpoint.dir is not None:
        dirs["checkpoint.dir"] = Path(cfg.checkpoint.dir)
    dirs["data.cache_dir"] = (
        Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache.default_cache_dir()
    )
    dirs["data.lock_dir"] = (
        Path(cfg.data.lock_dir).expanduser() if cfg.data.lock_dir else cache.default_lock_dir()
    )
    return dirs


# where each tracker library writes under output.dir (training/metrics/trackers.py opens them)
TRACKER_DIRS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}


def path_problems(cfg: RunConfig) -> list[str]:
    """One line per problem: unwritable output/checkpoint/cache/lock dirs, a missing corpus file
    or tokenizer. Reads no data and imports no torch."""
    problems = []
    for key, path in run_directories(cfg).items():
        problem = writable_problem(path)
        if problem is not None:
            problems.append(f"{key}: {problem}; choose a directory you can write to")
    corpora: list[tuple[str, Any]] = [("data.path", cfg.data.path)]
    corpora += [(key, value) for key, value in _eval_corpora(cfg)]
    for key, value in corpora:
        try:
            for source in parse_sources(value):  # one path, or a list of sources
                resolve_source(source.path, split=source.split, subset=source.subset)
        except DataError as exc:
            problems.append(f"{key}: {exc}")
    try:
        resolve_tokenizer_dir(cfg.data.tokenizer)
    except DataError as exc:
        problems.append(f"data.tokenizer: {exc}")
    if not tracker_available(cfg.output.tracker):
        problems.append(tracker_missing(cfg.output.tracker))
    elif (broken := tracker_broken(cfg.output.tracker)) is not None:
        problems.append(broken)
    tracker_dir = TRACKER_DIRS.get(cfg.output.tracker)
    if tracker_dir is not None:
        at = Path(cfg.output.dir) / tracker_dir
        if (at.exists() or at.is_symlink()) and not at.is_dir():
            problems.append(
                f"output.tracker: {cfg.output.tracker} writes into {at}, which is not a "
                "directory; move it away or choose another output.dir"
            )
    online = cfg.output.tracker_mode == "online"
    if cfg.output.tracker == "mlflow" and online and not os.environ.get("MLFLOW_TRACKING_URI"):
        problems.append(
            "output.tracker_mode: online with mlflow needs MLFLOW_TRACKING_URI (the tracking "
            "server), or set output.tracker_mode=offline for a file store under output.dir"
        )
    return problems


def _eval_corpora(cfg: RunConfig) -> list[tuple[str, Any]]:
    return [("data.eval_path", cfg.data.eval_path)] if cfg.data.eval_path else []


def check_paths(cfg: RunConfig) -> None:
    """Raise one PathError listing every path problem (the CLI prints them on one line)."""
    problems = path_problems(cfg)
    if problems:
        raise PathError("\n".join(problems))
