"""Checkpoints with torch.distributed.checkpoint (DCP): write to a temp dir, then publish.

Layout under `checkpoint.dir`:
    step_00000003/      a published checkpoint (DCP shards + .metadata + COMPLETE)
    .tmp_step_00000006/ a save in progress (or one killed midway): never loaded
    latest              text file naming the newest published step dir

Publishing: every rank writes its shard into the temp dir (DCP fsyncs each file), all ranks
meet at a barrier, then rank 0 writes COMPLETE (fsynced), renames the temp dir to its final name
(atomic on one filesystem) and replaces `latest` via a temp file + os.replace. A process killed
at any point leaves either no step dir or a complete one, so resume never sees a partial save.
The directory must be on a filesystem every rank sees (shared storage for multi-node runs).

Per-rank values (RNG states, data position) are stored under a `rank{r}` key, because DCP saves
one copy of every key it believes replicated. Resume expects the same pipeline and expert layout;
the sharded optimizer's state (training.zero_state) also resumes into another DP size.

Expert-parallel shards (parameters tagged by `parallel.expert_parallel.shard_moe`) have the same
local name on every EP rank but different rows; they are saved as DTensors sharded on dim 0 over
the EP group (their optimizer chunks too, by zero_state), so the checkpoint holds each global
[E, ...] tensor once (EP replicas over expert-DP are deduplicated like any replicated key) and a
load hands every rank its own rows back. Pipeline stages need nothing special: their parameter
names are disjoint except the MTP copy of the embedding, which is identical on both stages.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from primus_v4.durable import fsync_dir, write_durable
from primus_v4.errors import (
    CheckpointError,
    ConfigError,
    DiskFullError,
    Interrupted,
    PrimusError,
    describe_os_error,
    is_disk_full,
    nearly_full,
    os_error_cause,
    over_size_limit,
)
from primus_v4.log import get_logger
from primus_v4.training.checkpoint import integrity, safe_dcp
from primus_v4.training.checkpoint.integrity import COMPLETE, LATEST, MODEL_LAYOUT, newest_intact
from primus_v4.training.optim.zero import ShardedAdamW
from primus_v4.training.optim.zero_state import load_optimizer_state, optimizer_state
from primus_v4.training.run_dirs import refuse_link

if TYPE_CHECKING:
    from primus_v4.training.optim.zero import ShardedAdamW

log = get_logger(__name__)


def check_layout(path: Path) -> None:
    """Raise unless checkpoint `path` holds this version's model layout."""
    try:
        info = integrity.read_complete(path)
    except ValueError:
        return  # a missing / unreadable COMPLETE: the integrity checks name it
    problem = integrity.layout_problem(path, info)
    if problem is not None:
        raise CheckpointError(problem)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process: exactly our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _train_state(
    step: int,
    model: nn.Module,
    optimizer: ShardedAdamW | None,
    scheduler: Any | None,
    data: Stateful | None,
) -> dict[str, Any]:
    """The DCP state dict: model/optimizer keyed by parameter name, plus per-rank extras."""
    with warnings.catch_warnings():
        # DCP warns about features (e.g. sharded tensors) this code does not use.
        warnings.simplefilter("ignore")
        model_sd = get_model_state_dict(model, options=_model_options(model))
    part = getattr(model, "checkpoint_prefixes", None)  # a model that trains one part only
    if part:
        model_sd = {k: v for k, v in model_sd.items() if k.startswith(tuple(part))}
    _experts_as_dtensors(model, model_sd)
    optim_sd: dict[str, Any] = {}
    if optimizer is not None:
        optim_sd = optimizer_state(_sharded(optimizer))  # its chunks are DTensors already
    per_rank: dict[str, Any] = {"rng": _rng_state()}
    if data is not None:
        per_rank["data"] = data.state_dict()
    return {
        "step": step,
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        f"rank{_rank()}": per_rank,
    }


def _model_options(model: nn.Module) -> StateDictOptions:
    """A model that trains a part only: its checkpoint holds the trained parameters and buffers
    (LoRA adapters: `checkpoint_trainable_only`), or only the names under its
    `checkpoint_prefixes` (a drafter on a frozen backbone); the frozen rest comes from
    model.pretrained (or the seed) again on resume."""
    part = bool(getattr(model, "checkpoint_trainable_only", False)) or bool(
        getattr(model, "checkpoint_prefixes", None)
    )
    return StateDictOptions(ignore_frozen_params=part, strict=not part)


def _sharded(optimizer: Any) -> ShardedAdamW:
    """The trainer's optimizer (training.optim.zero), whose state zero_state keys and shards."""
    if not isinstance(optimizer, ShardedAdamW):
        raise TypeError(
            f"checkpoints hold the state of training.optim.zero.ShardedAdamW, not of "
            f"{type(optimizer).__name__}: build the optimizer with build_sharded_optimizer"
        )
    return optimizer


def _experts_as_dtensors(model: nn.Module, model_sd: dict[str, Any]) -> None:
    """Wrap expert-parallel shards (and rows sharded over DP x CP, e.g. a trainable sharded
    Engram table) as dim-0 DTensor shards."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    meshes: dict[int, DeviceMesh] = {}
    for name, p in model.named_parameters():
        group = getattr(p, "expert_group", None)
        if group is None or name not in model_sd:
            continue
        if id(group) not in meshes:
            meshes[id(group)] = DeviceMesh.from_group(group, p.device.type)
        mesh = meshes[id(group)]

        # rows of an uneven split (torch.chunk's: ceil(R / n) per rank) name their global shape
        shape = getattr(p, "global_shape", None)
        extra = {} if shape is None else {"shape": shape, "stride": (shape[1], 1)}
        model_sd[name] = DTensor.from_local(model_sd[name], mesh, [Shard(0)], run_check=False,
                                            **extra)  # fmt: skip


def _local_tensors(tree: Any) -> Any:
    """DTensor shards back to this rank's plain tensors (what set_model_state_dict expects)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _local_tensors(v) for k, v in tree.items()}
    return tree


def save(
    root: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: ShardedAdamW | None = None,
    scheduler: Any | None = None,
    data: Stateful | None = None,
    extra_files: dict[str, str] | None = None,
    rank_files: dict[str, str] | None = None,
) -> Path:
    """Save a checkpoint of `step` and publish it; collective over all ranks. Returns its dir.
    `extra_files`: {name: text} written beside the shards by rank 0 (e.g. the run's config);
    `rank_files`: {name: text} each rank writes beside its shards (its own names, e.g. the
    record of what the rank read of the release); both are in the manifest.
    A save that fails (a full disk, say) removes its temp dir on every rank and raises the same
    one-line error there: a failed save leaves nothing, and the previous checkpoint is intact.
    Ctrl-C mid-save removes the temp dir too and raises Interrupted (exit 130) naming the
    checkpoint a rerun resumes from."""
    if optimizer is not None:
        _sharded(optimizer)  # a caller's mistake, refused before anything is written
    root = Path(root)
    final, tmp = step_dir(root, step), root / f".tmp_step_{step:08d}"
    with _noting_sigint() as sigint:
        try:
            return _save(root, final, tmp, step, model, optimizer, scheduler, data,
                         extra_files, rank_files)  # fmt: skip
        except BaseException as exc:
            if sigint or isinstance(exc, KeyboardInterrupt):
                raise _interrupted(root, tmp, final) from None
            raise


def _save(
    root: Path,
    final: Path,
    tmp: Path,
    step: int,
    model: nn.Module,
    optimizer: ShardedAdamW | None,
    scheduler: Any | None,
    data: Stateful | None,
    extra_files: dict[str, str] | None,
    rank_files: dict[str, str] | None,
) -> Path:
    start = time.perf_counter()
    _on_rank0(lambda: _fresh_dir(root, tmp), root, tmp, final)
    try:
        state = _train_state(step, model, optimizer, scheduler, data)
        with _single_process_ok():
            dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        _write_files(tmp, rank_files or {})  # every rank its own, with its shards
    except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
        error = _save_error(exc, root, tmp, final)
        _barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error from exc
    # dcp.save returns on every rank after the coordinator wrote .metadata; the barrier makes
    # sure no rank is still flushing before the checkpoint is declared complete.
    _barrier()
    _on_rank0(lambda: _write_files(tmp, extra_files or {}), root, tmp, final)
    files = integrity.checksums(tmp)  # collective: each rank hashes its share of the files
    _on_rank0(lambda: _manifest_and_publish(root, tmp, final, step, files), root, tmp, final)
    _barrier()
    log.info("saved checkpoint %s (%.1f s)", final, time.perf_counter() - start)
    return final


@contextlib.contextmanager
def _noting_sigint() -> Iterator[list[bool]]:
    """Ctrl-C during a save still raises KeyboardInterrupt, but torch's writers may turn it into
    another error (a RuntimeError "unexpected pos"): the flag says that it was Ctrl-C."""
    hit: list[bool] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # fmt: skip
        yield hit
        return

    def handle(_signum: int, _frame: Any) -> None:
        hit.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handle)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(root: Path, tmp: Path, final: Path) -> Interrupted:
    """Ctrl-C mid-save: the partial save removed, and the step a rerun resumes from."""
    partial = tmp.exists() or not integrity.is_complete(final)  # else it was published
    shutil.rmtree(tmp, ignore_errors=True)
    removed = f"removed the partial {tmp.name}; " if partial else ""
    done = integrity.complete_checkpoints(root)
    again = (
        f"a rerun of the same command resumes from {done[-1].name}"
        if done
        else "no checkpoint is saved yet: a rerun starts from step 0"
    )
    return Interrupted(f"interrupted while saving checkpoint {final.name} into {root}: {removed}"
                       f"{again}")  # fmt: skip


def _fresh_dir(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    refuse_link(tmp, "checkpoint.dir")  # a planted link: DCP would write where it points
    if tmp.exists():  # left by a save that was killed midway
        shutil.rmtree(tmp)
    tmp.mkdir()


def _write_files(tmp: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        write_durable(tmp / name, text)


def _manifest_and_publish(
    root: Path, tmp: Path, final: Path, step: int, files: dict[str, Any]
) -> None:
    integrity.write_manifest(tmp, files)
    _publish(root, tmp, final, step)


def _on_rank0(work: Any, root: Path, tmp: Path, final: Path) -> None:
    """Run `work` on rank 0; if it fails, remove the temp dir and raise its error on every
    rank (the others would otherwise wait for rank 0 at the next collective)."""
    error: str | None = None
    kind: type[PrimusError] = CheckpointError
    if _rank() == 0:
        try:
            work()
        except Exception as exc:
            failure = _save_error(exc, root, tmp, final)
            shutil.rmtree(tmp, ignore_errors=True)
            error, kind = str(failure), type(failure)
    error, kind = integrity._broadcast((error, kind)) if dist.is_initialized() else (error, kind)
    if error is not None:
        raise kind(error)


def _failures(exc: BaseException) -> list[BaseException]:
    """`exc` and the per-rank exceptions a DCP CheckpointException wraps."""
    inner = [v[0] if isinstance(v, tuple) else v for v in getattr(exc, "failures", {}).values()]
    return [exc, *(e for e in inner if isinstance(e, BaseException))]


def _cause(exc: BaseException) -> str:
    """What went wrong, without a traceback: a DCP CheckpointException's message is each rank's
    whole traceback; its wrapped exceptions' own messages say it."""
    inner = _failures(exc)[1:]
    if not inner:
        return str(exc)
    said = dict.fromkeys(f"{type(e).__name__}: {str(e).strip().rstrip('.')}" for e in inner)
    return "; ".join(" ".join(text.split()) for text in said)


def _disk_full(errors: list[BaseException], directory: Path) -> str | None:
    """Why a failed save is a full disk (None: it is not). Checked before the temp dir goes."""
    causes = [c.errno for e in errors if (c := os_error_cause(e)) is not None]
    if errno.EFBIG in causes or over_size_limit(directory):
        return "a file reached the file size limit (ulimit -f)"
    if errno.EDQUOT in causes:
        return "over the disk quota"
    if any(is_disk_full(e) for e in errors) or nearly_full(directory):
        return "disk full"
    return None


def _save_error(exc: BaseException, root: Path, tmp: Path, final: Path) -> PrimusError:
    """One line for a failed save: what (the step), where (the dir), why, and what is left."""
    errors = _failures(exc)
    previous = integrity.latest_named(root)
    kept = (
        f"; the previous checkpoint {previous.name} is intact"
        if previous is not None and previous.is_dir()
        else ""
    )
    what = f"cannot save checkpoint {final.name} into {root}"
    full = _disk_full(errors, tmp)
    if full is not None:
        return DiskFullError(f"{what}: {full}; removed the partial {tmp.name}{kept}. Free space "
                             "there or point checkpoint.dir elsewhere")  # fmt: skip
    cause = next((c for e in errors if (c := os_error_cause(e)) is not None), None)
    if cause is not None:
        error = describe_os_error(cause, "cannot write")
        return type(error)(f"{what}: {error}; removed the partial {tmp.name}{kept}")
    reason = str(errors[-1]).strip().splitlines()[0] if str(errors[-1]).strip() else ""
    return CheckpointError(f"{what}: {type(errors[-1]).__name__}: {reason}; removed the partial "
                           f"{tmp.name}{kept}")  # fmt: skip


def _publish(root: Path, tmp: Path, final: Path, step: int) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    info = {"step": step, "world_size": world, "model_layout": MODEL_LAYOUT}
    write_durable(tmp / COMPLETE, json.dumps(info) + "\n")
    fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a rerun without resume)
        trash = root / f".trash_{final.name}_{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        if trash.is_symlink():  # a link's target is not this checkpoint dir's to delete
            trash.unlink()
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_durable(root / LATEST, final.name + "\n")


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / ".metadata").is_file()


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint dir under `root` (the `latest` pointer if it is valid)."""
    root = Path(root)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        newer = [p for p in root.glob("step_*") if p.name > named.name and _is_complete(p)]
        if _is_complete(named) and not newer:
            return named
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and _is_complete(p))
    return complete[-1] if complete else None


def _agreed_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint whose checksums match, the same on every rank (rank 0
    lists; damaged ones are reported by file and skipped)."""
    return newest_intact(root)


def load_latest(
    root: str | Path,
    *,
    model: nn.Module,
    optimizer: ShardedAdamW | None = None,
    scheduler: Any | None = None,
    data: Stateful | None = None,
    path: Path | None = None,
) -> int | None:
    """Load the newest intact checkpoint under `root` (or `path`, chosen by the caller on every
    rank) in place; its step, or None if none."""
    path = path if path is not None else _agreed_latest(root)
    skipped = sorted(p.name for p in Path(root).glob(".tmp_step_*")) if Path(root).is_dir() else []
    if skipped and _rank() == 0:
        log.warning(
            "ignoring incomplete checkpoint(s) %s in %s (a save did not finish)", skipped, root
        )
    if path is None:
        log.info("no complete checkpoint in %s; starting from scratch", root)
        return None
    check_layout(path)
    state = _train_state(0, model, optimizer, scheduler, data)
    key = f"rank{_rank()}"
    saved = safe_dcp.read_metadata(path).state_dict_metadata
    if not any(k.startswith(f"{key}.") for k in saved):
        # Saved by fewer ranks (a different DP size): this rank keeps its own RNG streams and
        # data position; the trainer's data position is the step itself.
        log.warning("checkpoint %s has no per-rank state for rank %d (saved by %s ranks)", path,
                    _rank(), _saved_world(path))  # fmt: skip
        del state[key]
    try:
        safe_dcp.load(state, path, no_dist=not dist.is_initialized())
    except safe_dcp.RefusedObject:
        raise
    except (Exception, CheckpointException) as err:  # name the checkpoint and the likely cause
        raise CheckpointError(
            f"cannot load checkpoint {path} on rank {_rank()}: {_cause(err)}. It was written by "
            f"{_saved_world(path)} ranks; resume needs the same model, pipeline and expert "
            "layout (the trainer's data-parallel size may differ)"
        ) from err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        set_model_state_dict(model, _local_tensors(state["model"]), options=_model_options(model))
    if optimizer is not None:
        load_optimizer_state(_sharded(optimizer), state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if data is not None and key in state:
        data.load_state_dict(state[key]["data"])
    if key in state:
        _set_rng_state(state[key]["rng"])
    step = int(state["step"])
    what = "resumed from" if optimizer is not None else "loaded the model weights of"
    log.info("%s checkpoint %s (step %d)", what, path, step)
    return step


def _saved_world(path: Path) -> str:
    try:
        return str(json.loads((path / COMPLETE).read_text())["world_size"])
    except (OSError, ValueError, KeyError):
        return "an unknown number of"


class CheckpointManager:
    """Interval saving + resume for a training loop.

    interval: save when step % interval == 0 (0 = only the final save).
    resume: `load_latest` returns None without looking when False.
    """

    def __init__(self, root: str | Path, *, interval: int, resume: bool = True) -> None:
        if interval < 0:
            raise ConfigError(f"checkpoint.interval must be >= 0, got {interval}")
        self.root = Path(root)
        self.interval = interval
        self.resume = resume
        self._last_saved: int | None = None

    def maybe_save(self, step: int, *, final: bool = False, **state: Any) -> Path | None:
        """Save after optimizer step `step` when due (or `final`); state = model=..., etc."""
        due = final or (self.interval > 0 and step % self.interval == 0)
        if not due or step == self._last_saved:
            return None
        self._last_saved = step
        return save(self.root, step=step, **state)

    def load_latest(self, **state: Any) -> int | None:
        if not self.resume:
            return None
        step = load_latest(self.root, **state)
        self._last_saved = step
        return step
