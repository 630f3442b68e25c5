"""Fail before work: unwritable output/checkpoint/cache/lock dirs, a missing corpus or tokenizer
are one clear line each, from `train` and `train --dry-run` alike, before torch is imported (so
within a second), and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primus_v4.config.preflight import writable_problem
from primus_v4.errors import ExitCode

REPO = Path(__file__).resolve().parents[3]
# The CLI in a fresh interpreter, reporting whether the command got as far as importing torch.
PROBE = """
import sys
from primus_v4.cli import main
code = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


def _unwritable(tmp_path: Path) -> Path:
    """A directory no file can be created in, for this user (root ignores permission bits)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked
    if writable_problem("/sys") is None:
        pytest.skip("running as root and /sys is writable: no unwritable directory to test with")
    return Path("/sys")


def _train(tmp_path: Path, *sets: str, dry_run: bool) -> tuple[subprocess.CompletedProcess, float]:
    base = [
        f"output.dir={tmp_path / 'run' / 'out'}",
        f"data.cache_dir={tmp_path / 'run' / 'packs'}",
        f"data.lock_dir={tmp_path / 'run' / 'locks'}",
        "train.steps=1",
        "train.warmup_steps=0",
    ]
    argv = ["train", *(a for s in (*base, *sets) for a in ("--set", s))]
    argv += ["--dry-run"] if dry_run else []
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, time.perf_counter() - start


def _cases(tmp_path: Path) -> dict[str, tuple[str, str]]:
    blocked = _unwritable(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return {  # case -> (--set item, expected text of the one error line)
        "output.dir": (f"output.dir={blocked / 'out'}", "output.dir: "),
        "output.dir under a file": (f"output.dir={a_file / 'out'}", f"is under the file {a_file}"),
        "checkpoint.dir": (f"checkpoint.dir={blocked / 'ck'}", "checkpoint.dir: "),
        "data.cache_dir": (f"data.cache_dir={blocked / 'packs'}", "data.cache_dir: "),
        "data.lock_dir": (f"data.lock_dir={blocked / 'locks'}", "data.lock_dir: "),
        "data.path": (f"data.path={tmp_path / 'no.jsonl'}", "data.path: corpus file"),
        "data.tokenizer": (f"data.tokenizer={tmp_path / 'no_tok'}", "data.tokenizer: tokenizer"),
    }


CASES = [
    "output.dir",
    "output.dir under a file",
    "checkpoint.dir",
    "data.cache_dir",
    "data.lock_dir",
    "data.path",
    "data.tokenizer",
]


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
@pytest.mark.parametrize("case", CASES)
def test_each_path_problem_is_one_line_before_any_work(
    tmp_path: Path, case: str, dry_run: bool
) -> None:
    item, expected = _cases(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    proc, seconds = _train(tmp_path, item, dry_run=dry_run)
    assert proc.returncode == ExitCode.PATH, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("primus-v4 train: error: "), proc.stderr
    assert expected in lines[0]
    assert "torch imported: False" in proc.stdout  # failed before the model config was built
    # Interpreter start + config load only; the bound leaves room for a loaded 2-core machine.
    assert seconds < 5.0, f"took {seconds:.2f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created, no probe left
    if case != "output.dir under a file" and os.geteuid() == 0:
        assert not any(p.name.startswith(".primus-v4-write-probe") for p in Path("/sys").iterdir())


def test_writable_problem_accepts_new_and_existing_dirs(tmp_path: Path) -> None:
    assert writable_problem(tmp_path) is None
    assert writable_problem(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()
    (tmp_path / "f").write_text("")
    assert writable_problem(tmp_path / "f") == f"{tmp_path / 'f'} exists and is not a directory"


def test_recipe_dry_run_checks_paths(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from recipe_runner import run_recipe

    run = run_recipe("run_local.sh", tmp_path, PRIMUS_DATA_PATH=str(tmp_path / "missing.json"))
    assert run.returncode != 0 and run.stdout == ""
    assert f"data.path: corpus file {tmp_path / 'missing.json'} does not exist" in run.stderr
