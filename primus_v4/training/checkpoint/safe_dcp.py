"""Reading a DCP checkpoint without running code from it.

DCP stores its `.metadata` as a pickle and every non-tensor value (the step, the scheduler, the
RNG states) as a `torch.save` blob that its default planner loads with `weights_only=False`:
unpickled as they are, a checkpoint dir someone else can write is a program we run. Here the
metadata goes through an unpickler that admits only DCP's metadata classes (and the torch dtypes,
`torch.Size` and paths they hold), and the non-tensor values through `torch.load(weights_only=
True)` with the numpy array types our RNG state needs; anything else is refused with one line
naming the file and the object, before it is constructed.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from numpy._core.multiarray import _reconstruct  # numpy.core before 2.0 re-exports _core
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from primus_v4.errors import CheckpointError

METADATA = ".metadata"

# Every class DCP's metadata module defines (Metadata, the storage metadata kinds, chunk and
# index records, the memory-format enum), the filesystem reader's per-item record, and the
# helpers torch pickles dtypes, layouts and sizes through.
_ADMITTED: dict[tuple[str, str], Any] = {
    (dcp_metadata.__name__, name): obj
    for name, obj in vars(dcp_metadata).items()
    if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
}
_ADMITTED |= {
    (_StorageInfo.__module__, _StorageInfo.__name__): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): Path,
    ("pathlib", "PurePosixPath"): Path,
    ("pathlib", "Path"): Path,
}

# What the per-rank numpy RNG state (np.random.get_state()) is pickled with.
_NUMPY_GLOBALS = [np.ndarray, np.dtype, np.dtypes.UInt32DType, _reconstruct]


class RefusedObject(CheckpointError):
    """A checkpoint file names an object that is not checkpoint data."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, *, source: Path) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        admitted = _ADMITTED.get((module, name))
        if admitted is not None:
            return admitted
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedObject(
            f"{self._source}: refused to load: it names {module}.{name}, which is not DCP "
            "checkpoint metadata (a planted or foreign file; nothing in it was run)"
        )


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of checkpoint dir `path`, read with the restricted unpickler."""
    source = Path(path) / METADATA
    try:
        with source.open("rb") as f:
            meta = _MetadataUnpickler(f, source=source).load()
    except RefusedObject:
        raise
    except OSError as exc:
        raise CheckpointError(f"{source}: unreadable ({exc.strerror or exc})") from exc
    except Exception as exc:  # a truncated or garbled pickle raises many kinds
        raise CheckpointError(f"{source}: not DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, Metadata):
        raise RefusedObject(f"{source}: refused to load: holds a {type(meta).__name__}, not DCP "
                            "checkpoint metadata")  # fmt: skip
    return meta


class SafeReader(FileSystemReader):
    """DCP's file reader with the restricted metadata unpickler; keeps a refusal (DCP folds
    it into a multi-line error of its own)."""

    refused: RefusedObject | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            meta = read_metadata(self.path)
        except RefusedObject as exc:
            self.refused = exc
            raise
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor values with `weights_only=True`."""

    def __init__(self, source: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._source = source

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals(_NUMPY_GLOBALS):
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            named = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(exc))
            what = f"it names {named.group(1)}" if named else "it is not plain data"
            raise RefusedObject(
                f"{self._source}: refused to load the value {fqn!r}: {what}, which is not "
                "checkpoint data (a planted or foreign file; nothing in it was run)"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(state: dict[str, Any], path: str | Path, *, no_dist: bool = True) -> None:
    """`dcp.load(state)` from `path` in place through the restricted reader and planner; a
    refused object is raised as itself (not inside DCP's multi-rank exception)."""
    path = Path(path)
    reader = SafeReader(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's no_dist notice
            dcp.load(state, storage_reader=reader, planner=SafePlanner(path), no_dist=no_dist)
    except (CheckpointException, AssertionError) as exc:
        refused = reader.refused or _refusal(exc)
        if refused is not None:
            raise refused from None
        raise


def _refusal(exc: BaseException) -> RefusedObject | None:
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, RefusedObject):
            return error
    return None
