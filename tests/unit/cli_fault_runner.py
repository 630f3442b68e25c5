"""The machinery of the fault-injection table (tests/unit/test_cli_faults.py): a case's
workspace, the registry of cases, the real checkpoint and release every case may copy, and how a
case runs (in process, or in a child with a file size limit where no tmpfs can be mounted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# run as a script too: the shared helpers are not on its path then
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from faults import limited_writes
from release_checkpoint import random_release_tensors, release_config
from train_fakes import RAGGED_PACKS, FakeCorpus, tiny_run

from primus_v4 import cli
from primus_v4.errors import ExitCode

REPO = Path(__file__).resolve().parents[2]
LEFTOVERS = (".tmp", ".partial", ".trash", "write-probe")
ROWS = "synthetic:rows=40,seed=3"


@dataclass(kw_only=True)
class Limited:
    """Run this argv in a child whose files cannot grow past `max_bytes` (no tmpfs here)."""

    argv: list[str]
    max_bytes: int


@dataclass(kw_only=True)
class Ws:
    """One case's directory, with the shared fixtures copied in when a case asks for them."""

    tmp: Path
    trained: Path
    release_dir: Path

    @property
    def cache(self) -> list[str]:
        return ["--cache-dir", str(self.tmp / "cache"), "--lock-dir", str(self.tmp / "locks")]

    def ck(self) -> Path:
        """A copy of a real checkpoint dir (the tiny model, vocab 512, steps 1 and 2)."""
        return Path(shutil.copytree(self.trained / "ck", self.tmp / "ck"))

    def release(self) -> Path:
        return Path(shutil.copytree(self.release_dir, self.tmp / "release"))

    def file(self, name: str, body: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(body.encode() if isinstance(body, str) else body)
        return path

    def train_sets(self, *items: str) -> list[str]:
        """`train` with the settings of the trained checkpoint's run (see `trained`)."""
        base = ["data.seq_length=256", "model.overrides.vocab_size=512",
                f"output.dir={self.tmp / 'run'}", "output.progress_bar=false",
                "train.shuffle=false", *TRAINED, f"data.cache_dir={self.tmp / 'cache'}",
                f"data.lock_dir={self.tmp / 'locks'}"]  # fmt: skip
        return ["train", *(a for i in [*base, *items] for a in ("--set", i))]


Case = Callable[[Ws], Iterator[list[str] | Limited]]
CASES: dict[str, tuple[Case, ExitCode, str]] = {}


def case(name: str, code: ExitCode, says: str) -> Callable[[Case], Case]:
    """Register a case: a generator that sets the fault up, yields the argv, then undoes it."""

    def register(fn: Case) -> Case:
        CASES[name] = (fn, code, says)
        return fn

    return register


def pack_argv(ws: Ws, *args: str) -> list[str]:
    return ["pack", "--seq-length", "512", "--no-progress", *ws.cache, *args]


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


GOOD_ROW = '{"instruction": "a", "output": "b"}\n'

TRAINED = ("train.steps=2", "train.warmup_steps=1", "train.global_batch_size=1",
           "checkpoint.interval=1", "output.plot=false")  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real tiny model (vocab 512) trained 2 steps on the fake corpus, checkpoints 1 and 2."""
    from primus_v4.training.trainer import Trainer

    tmp = tmp_path_factory.mktemp("faults_trained")
    run = tiny_run(tmp, *TRAINED, f"checkpoint.dir={tmp / 'ck'}")
    Trainer(run, corpus=FakeCorpus(RAGGED_PACKS[:2])).train()
    return tmp


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("faults_release")
    config = {**release_config("a"), "vocab_size": 129280}  # the bundled tokenizer's ids fit
    save_file(random_release_tensors(config, seed=1), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def run_case(argv: list[str] | Limited, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    if isinstance(argv, Limited):  # a child process with a file size limit
        proc = subprocess.run([sys.executable, "-m", "primus_v4", *argv.argv], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, text=True,
                              capture_output=True, preexec_fn=limited_writes(argv.max_bytes),
                              timeout=600)  # fmt: skip
        return proc.returncode, proc.stdout, proc.stderr
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def leftovers(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if any(m in p.name for m in LEFTOVERS))


def snapshot(root: Path) -> dict[str, bytes]:
    if not (root / "ck").is_dir():
        return {}
    return {str(p): p.read_bytes() for p in (root / "ck").rglob("*") if p.is_file()}


def record(name: str, code: int, line: str) -> None:
    table = os.environ.get("PRIMUS_FAULT_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(json.dumps({"case": name, "exit": code, "message": line}) + "\n")
