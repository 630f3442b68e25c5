"""Checkpoint metadata and values are read without running code: the S1 probe (a `.metadata`
rewritten to run code, its MANIFEST updated so checksums pass) and a planted non-tensor value
are refused with one line naming the object, and the planted code never runs; DCP's own reader
runs it (which is why the restricted one exists). Our own checkpoints load as before."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from planted import Planted, plant_metadata

from primus_v4.errors import CheckpointError
from primus_v4.training.checkpoint import safe_dcp
from primus_v4.training.checkpoint.integrity import MANIFEST, file_digest


def _save(path: Path, state: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    files = {p.name: file_digest(p) for p in path.iterdir() if p.is_file()}
    (path / MANIFEST).write_text(__import__("json").dumps({"files": files}))
    return path


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "step": 7,
        "model": {"w": torch.randn(4, 3), "b": torch.arange(5)},
        "scheduler": {"last_epoch": 7, "base_lrs": [0.001]},
        "rank0": {"rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                          "numpy": np.random.get_state()}},
    }  # fmt: skip


def _empty_like(state: dict) -> dict:
    return {
        "step": 0,
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "scheduler": {"last_epoch": 0, "base_lrs": [0.0]},
        "rank0": {"rng": {"torch": torch.zeros_like(state["rank0"]["rng"]["torch"]),
                          "python": None, "numpy": None}},
    }  # fmt: skip


def test_our_checkpoint_loads_as_dcp_loads_it(tmp_path: Path) -> None:
    saved = _state()
    path = _save(tmp_path / "ck", saved)
    loaded = _empty_like(saved)
    safe_dcp.load(loaded, path)
    assert loaded["step"] == 7 and loaded["scheduler"] == saved["scheduler"]
    for k, v in saved["model"].items():
        assert torch.equal(loaded["model"][k], v)
    rng = loaded["rank0"]["rng"]
    assert torch.equal(rng["torch"], saved["rank0"]["rng"]["torch"])
    assert rng["python"] == saved["rank0"]["rng"]["python"]
    numpy_saved = saved["rank0"]["rng"]["numpy"]
    assert rng["numpy"][0] == numpy_saved[0]
    np.testing.assert_array_equal(rng["numpy"][1], numpy_saved[1])
    meta = safe_dcp.read_metadata(path)
    assert set(meta.state_dict_metadata) == set(dcp.FileSystemReader(path).read_metadata()
                                                .state_dict_metadata)  # fmt: skip


def test_planted_metadata_is_refused_and_its_code_never_runs(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    marker = tmp_path / "ran"
    plant_metadata(path, marker)
    with pytest.raises(CheckpointError) as refused:
        safe_dcp.read_metadata(path)
    line = str(refused.value)
    assert "\n" not in line
    assert f"{path}/.metadata: refused to load: it names posix.mkdir" in line
    with pytest.raises(CheckpointError, match=r"refused to load: it names posix\.mkdir"):
        safe_dcp.load(_empty_like(_state()), path)
    assert not marker.exists()
    dcp.FileSystemReader(path).read_metadata()  # the plain reader: the planted code runs
    assert marker.is_dir()


def test_a_planted_value_is_refused_and_its_code_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    state = {**_state(), "step": Planted(marker)}
    path = _save(tmp_path / "ck", state)
    with pytest.raises(CheckpointError) as refused:
        safe_dcp.load(_empty_like(_state()), path)
    assert "refused to load the value 'step': it names posix.mkdir" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(_empty_like(_state()), checkpoint_id=path, no_dist=True)
    assert marker.is_dir()  # DCP's default planner unpickles it


def test_a_garbled_metadata_is_one_checkpoint_error(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    (path / ".metadata").write_bytes(b"\x80\x05not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata: not DCP metadata"):
        safe_dcp.read_metadata(path)
