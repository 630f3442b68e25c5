"""tests/gpu/run_device_checks.sh: without a GPU it skips in seconds with one line and exit 0,
writing nothing; its summary reads the suite's JUnit XML, bench_kernels' --json rows and the
training run's metrics.jsonl, and fails unless every part passed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recipe_runner import REPO
from train_fakes import fake_trainer

from primus_v4.training.metrics.history import read_history
from primus_v4.training.metrics.writer import summarize

SCRIPT = REPO / "tests" / "gpu" / "run_device_checks.sh"
SUMMARY = REPO / "tests" / "gpu" / "device_summary.py"
# What pytest --junitxml writes for a run with 5 passed, 1 failed, 2 skipped tests.
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="0" failures="1" skipped="2" tests="8" time="3.1"></testsuite>
</testsuites>"""


def test_without_a_gpu_it_skips_in_seconds_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "",
           "PRIMUS_PYTHON": sys.executable, "DEVICE_CHECK_DIR": str(tmp_path / "dc")}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "run_device_checks.sh: skipped: no GPU (torch.cuda.is_available() is False); run it on "
        "a gfx942/gfx950 or NVIDIA machine\n"
    )
    assert proc.stderr == ""
    assert not (tmp_path / "dc").exists()
    assert seconds < 60, f"the skip took {seconds:.1f} s"


def test_script_is_shellcheck_clean() -> None:
    shellcheck = Path(sys.executable).parent / "shellcheck"
    proc = subprocess.run([str(shellcheck), str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _summary(tmp_path: Path, capsys, *parts: str) -> tuple[int, str, dict]:
    """device_summary.py's main, in this process: (exit status, what it printed, the file)."""
    spec = importlib.util.spec_from_file_location("device_summary", SUMMARY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "summary.json"
    args = ["--out", str(out), "--arch", "gfx942",
            "--junit", str(tmp_path / "suite.xml"), "--bench", str(tmp_path / "bench.json"),
            "--metrics", str(tmp_path / "run" / "metrics.jsonl")]  # fmt: skip
    for part in parts:
        args += ["--part", part]
    status = module.main(args)
    return status, capsys.readouterr().out, json.loads(out.read_text())


def test_summary_holds_counts_kernel_rates_and_tokens_per_s(tmp_path: Path, capsys) -> None:
    (tmp_path / "suite.xml").write_text(JUNIT)
    bench = [sys.executable, str(REPO / "benchmarks" / "bench_kernels.py"), "--ops",
             "compressor_pool", "--rows", "64", "--no-interpret", "--json",
             str(tmp_path / "bench.json")]  # fmt: skip
    subprocess.run(bench, check=True, capture_output=True, timeout=120)
    fake_trainer(tmp_path, "train.steps=3", "train.warmup_steps=1").train()
    expected = summarize(read_history(tmp_path / "run" / "metrics.jsonl"))

    status, printed, s = _summary(tmp_path, capsys, "gpu_suite=failed:12",
                                  "bench_kernels=passed:30", "train=timed_out:90")  # fmt: skip
    assert status == 1  # a part failed, one timed out
    assert s["gpu_suite"] == {"passed": 5, "failed": 1, "errors": 0, "skipped": 2, "total": 8}
    assert s["parts"]["train"] == {"status": "timed_out", "seconds": 90}
    assert s["seconds"] == 132 and s["arch"] == "gfx942"
    (row,) = s["kernels"]["rows"]
    assert (row["op"], row["rows"], row["backend"], row["vs_torch"]) == (
        "compressor_pool", 64, "torch", 1.0)  # fmt: skip
    assert row["fwd_tflops"] > 0 and row["bwd_tflops"] > 0
    assert s["train"]["steps"] == 3
    assert s["train"]["tokens_per_s"] == pytest.approx(expected["tokens_per_s"])
    assert "gpu suite: 5 passed, 1 failed, 0 errors, 2 skipped of 8" in printed
    assert "compressor_pool" in printed and "tokens/s" in printed

    parts = ("gpu_suite=passed:12", "bench_kernels=passed:30", "train=passed:20")
    assert _summary(tmp_path, capsys, *parts)[0] == 0


def test_a_part_that_left_nothing_is_reported_as_missing(tmp_path: Path, capsys) -> None:
    status, _, s = _summary(tmp_path, capsys, "gpu_suite=timed_out:240")
    assert status == 1
    assert s["gpu_suite"] is None and s["kernels"] is None and s["train"] is None
