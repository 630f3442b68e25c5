"""An export copies what its run did not train from the run's release byte for byte (the vision
tower of a text-only run, the image tokens' routing bias), so it checks those tensors against the
digests the run recorded when it started (training/checkpoint/release_reads.py): a release
changed since, or a `--release` copy that differs, is refused before anything is written, naming
the tensor and `--release`; an unchanged copy exports; a step saved without a record (an older
version) exports with a warning. The refusals of a checkpoint that cannot be read are worded for
the command (`cannot export`, `cannot evaluate`)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from image_corpus import tiny_image_script
from train_fakes import FakeCorpus

from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import CheckpointError, ExitCode
from primus_v4.training.checkpoint import integrity
from primus_v4.training.checkpoint.release_reads import STEP_RECORD
from primus_v4.training.checkpoint.store import step_dir
from primus_v4.training.trainer import Trainer

SEQ = 64
RECORD = STEP_RECORD.format(0)
UNREAD = "vision.blocks.1.mlp.w1.weight"  # a text-only run never reads the vision tower
READ = "layers.0.ffn.gate.bias_vl"  # read by the run (the routers' image bias), then carried


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step of a text-only run from the tiny image release (examples/images), checkpointed:
    its output dir, beside `release` (the release) and `ckpt` (its checkpoint.dir)."""
    script = tiny_image_script()
    tmp = tmp_path_factory.mktemp("carried")
    script.write_release(tmp / "release")
    # fused_linear_ce=false: the CPU step takes ~1 s instead of ~10 s
    items = ["model.preset=null", f"model.pretrained={tmp / 'release'}",
             f"data.seq_length={SEQ}", "model.fused_linear_ce=false", "output.plot=false",
             "output.progress_bar=false", "train.shuffle=false", f"output.dir={tmp / 'run'}",
             "train.steps=1", "train.warmup_steps=0", "train.global_batch_size=1",
             f"checkpoint.dir={tmp / 'ckpt'}"]  # fmt: skip
    resolved = resolve_run(load_config(overrides=items), world=1)
    Trainer(resolved, corpus=FakeCorpus([[30, 20]], seq_length=SEQ)).train()
    return tmp / "run"


def _span(run: Path, tensor: str) -> tuple[str, dict]:
    """(which digest the step's record holds of `tensor`: "carried" or "tensors", its span)."""
    body = json.loads((step_dir(run.parent / "ckpt", 1) / RECORD).read_text())
    key = "carried" if tensor in body["carried"] else "tensors"
    return key, body[key][tensor]


@contextlib.contextmanager
def _changed(release: Path, span: dict) -> Iterator[None]:
    """One byte of the tensor at `span` of `release` flipped (its shape and dtype kept), put
    back after."""
    path = release / span["shard"]
    data = bytearray(path.read_bytes())
    data[span["lo"] + 1] ^= 0x10
    path.write_bytes(bytes(data))
    try:
        yield
    finally:
        data[span["lo"] + 1] ^= 0x10
        path.write_bytes(bytes(data))


def _export(capsys: pytest.CaptureFixture[str], run: Path, out: Path, *more: str) -> tuple:
    """(exit status, the `primus-v4` lines of stderr) of `export --run run --out out`."""
    capsys.readouterr()
    code = main(["export", "--run", str(run), "--out", str(out), "--no-progress", *more])
    err = capsys.readouterr().err.splitlines()
    return code, [line for line in err if line.startswith("primus-v4")]


def test_an_unchanged_release_exports_checked(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog
) -> None:
    with caplog.at_level(logging.INFO, logger="primus_v4"):
        code, lines = _export(capsys, run, tmp_path / "out")
    assert code == 0 and lines == [] and (tmp_path / "out" / "config.json").is_file()
    checked = [r.message for r in caplog.records if "copies byte for byte match" in r.message]
    assert len(checked) == 1, checked
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("tensor,key", [(UNREAD, "carried"), (READ, "tensors")])
def test_a_changed_carried_tensor_is_refused_naming_it_and_the_option(
    run: Path, tensor: str, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Digested whole (no rank read it) or as the span the run read: either way compared."""
    release = run.parent / "release"
    recorded, span = _span(run, tensor)
    assert recorded == key
    out = tmp_path / "out"
    with _changed(release, span):
        code, lines = _export(capsys, run, out)
    assert code == CheckpointError.exit_code == ExitCode.CHECKPOINT
    assert len(lines) == 1, lines
    assert f"{release}: tensor '{tensor}' (bytes {span['lo']}-{span['hi']}" in lines[0]
    assert "differs from the release the run started from" in lines[0]
    assert "--release DIR" in lines[0] and "nothing was written" in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_release_names_an_unchanged_copy_and_a_changed_copy_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    release = run.parent / "release"
    pristine = tmp_path / "pristine"
    shutil.copytree(release, pristine)
    _, span = _span(run, UNREAD)
    with _changed(release, span):  # the recorded release changed: its copy exports
        code, lines = _export(capsys, run, tmp_path / "out", "--release", str(pristine))
    assert code == 0 and lines == [] and (tmp_path / "out" / "config.json").is_file()
    with _changed(pristine, span):
        code, lines = _export(capsys, run, tmp_path / "again", "--release", str(pristine))
    assert code == ExitCode.CHECKPOINT and len(lines) == 1, lines
    assert f"{pristine}: tensor '{UNREAD}'" in lines[0] and "--release DIR" in lines[0]
    assert not (tmp_path / "again").exists()


def _old_step(run: Path, root: Path) -> Path:
    """The run's step copied into checkpoint.dir `root`, its record left out (in neither the
    step nor its manifest), as a step saved by an older version."""
    step = step_dir(root, 1)
    shutil.copytree(step_dir(run.parent / "ckpt", 1), step)
    (step / RECORD).unlink()
    files = integrity.read_manifest(step)
    del files[RECORD]
    integrity.write_manifest(step, files)
    return step


def test_a_step_without_a_record_exports_with_a_warning(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog
) -> None:
    step = _old_step(run, tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="primus_v4"):
        code, lines = _export(capsys, step, tmp_path / "out")
    assert code == 0 and lines == [] and (tmp_path / "out" / "config.json").is_file(), lines
    warned = [r.message for r in caplog.records if "no record of the release" in r.message]
    assert len(warned) == 1 and warned[0].startswith(f"{step}:"), warned
    assert "copied unchecked" in warned[0]


def test_a_step_without_a_record_is_checked_against_its_checkpoint_dirs(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a resume reads it: the record the run's first start wrote in checkpoint.dir."""
    root = tmp_path / "ckpt"
    step = _old_step(run, root)
    shutil.copytree(run.parent / "ckpt" / "release_reads", root / "release_reads")
    _, span = _span(run, UNREAD)
    with _changed(run.parent / "release", span):
        code, lines = _export(capsys, step, tmp_path / "out")
    assert code == ExitCode.CHECKPOINT and len(lines) == 1, lines
    assert f"recorded in {root / 'release_reads' / 'rank00000.json'}" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command,verb", [("export", "export"), ("eval", "evaluate")])
def test_a_dir_without_a_checkpoint_is_refused_in_the_commands_words(
    command: str, verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = step_dir(tmp_path / "ckpt", 3)
    empty.mkdir(parents=True)
    more = ["--out", str(tmp_path / "out")] if command == "export" else []
    capsys.readouterr()
    assert main([command, "--run", str(empty), *more]) == ExitCode.CHECKPOINT
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("primus-v4")]
    assert len(lines) == 1, lines
    assert f"cannot {verb} {empty}: " in lines[0], lines
    assert f"{verb.capitalize()} another step with --step (present: step_00000003)" in lines[0]
