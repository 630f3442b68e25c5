"""Through `primus-v4 train` (single process, the real tiny model, synthetic corpus, seq 256):
optimizer offload 0.5 and 1.0 leave bit-identical parameters to 0.0 after 5 steps, and a run
stopped after its step-3 checkpoint resumes to step 6 with the same losses, grad norms and final
parameters as the uninterrupted run. Parameters are read back from each run's final checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from primus_v4.commands import train
from primus_v4.training.checkpoint.store import LATEST, step_dir
from primus_v4.training.metrics.writer import read_metrics


def _train(tmp: Path, name: str, *settings: str) -> list[dict]:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    items = [
        "data.path=synthetic:rows=24",
        "data.seq_length=256",
        f"data.cache_dir={tmp / 'cache'}",
        f"data.lock_dir={tmp / 'locks'}",
        "train.warmup_steps=1",
        "train.global_batch_size=1",
        f"output.dir={tmp / name}",
        "output.progress_bar=false",
        "output.plot=false",
        f"checkpoint.dir={tmp / name / 'ckpt'}",
        *settings,
    ]
    assert train.run(parser.parse_args([a for item in items for a in ("--set", item)])) == 0
    return read_metrics(tmp / name / "metrics.jsonl")


def _params(root: Path, step: int) -> dict[str, torch.Tensor]:
    """Model parameters stored in the checkpoint of `step` under `root`."""
    path = step_dir(root, step)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model = {k[len("model.") :]: torch.empty(m.size) for k, m in meta.items()
             if k.startswith("model.")}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming ... a single process", as intended
        dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
    return model


def test_offload_is_bit_identical_through_train(tmp_path: Path) -> None:
    runs = {f: _train(tmp_path, f"off{f}", "train.steps=5", f"optim.offload_fraction={f}")
            for f in (0.0, 0.5, 1.0)}  # fmt: skip
    base = _params(tmp_path / "off0.0" / "ckpt", 5)
    for f in (0.5, 1.0):
        assert [r["loss"] for r in runs[f]] == [r["loss"] for r in runs[0.0]]
        params = _params(tmp_path / f"off{f}" / "ckpt", 5)
        assert params.keys() == base.keys()
        assert all(torch.equal(params[k], base[k]) for k in base), f"offload {f} drifted"


def test_resume_at_3_equals_uninterrupted_6_through_train(tmp_path: Path) -> None:
    steps = ("train.steps=6", "checkpoint.interval=3", "optim.offload_fraction=0.5")
    full = _train(tmp_path, "full", *steps)
    # The same run stopped right after its step-3 save: only that checkpoint exists.
    stopped = tmp_path / "resumed" / "ckpt"
    stopped.mkdir(parents=True)
    shutil.copytree(step_dir(tmp_path / "full" / "ckpt", 3), step_dir(stopped, 3))
    (stopped / LATEST).write_text(step_dir(stopped, 3).name + "\n")
    resumed = _train(tmp_path, "resumed", *steps)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for key in ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in full[3:]], key  # exact
    want = _params(tmp_path / "full" / "ckpt", 6)
    got = _params(stopped, 6)
    assert all(torch.equal(got[k], want[k]) for k in want)
