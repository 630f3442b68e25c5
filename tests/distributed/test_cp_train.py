"""`primus-v4 train` with parallel.cp=2 under torchrun (2 gloo processes, and 4 = cp 2 x dp 2) logs
the same losses and grad norms as cp=1: the same packs, split contiguously, with token counts and
gradients summed over DP x CP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "runs" / "tiny_cpu_thd.yaml"
# The tiny run at seq 512 (256 rows per rank >= the 128 boundary rows), 2 packs, 3 steps, quiet.
SETTINGS = [
    "data.seq_length=512",
    "train.global_batch_size=2",
    "train.steps=3",
    "output.progress_bar=false",
    "output.plot=false",
]


def _train(out: Path, cache: Path, cp: int, world: int) -> list[dict]:
    settings = [*SETTINGS, f"parallel.cp={cp}", f"output.dir={out}"]
    args = [a for s in settings for a in ("--set", s)]
    module = ["-m", "primus_v4", "train", "--config", str(CONFIG), *args]
    if world == 1:
        cmd = [sys.executable, *module]
    else:
        launcher = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world)]
        cmd = [sys.executable, *launcher, "--master_port", str(free_port()), *module]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # 2 ranks share 2 cores with other test runs
        "PRIMUS_PACK_CACHE_DIR": str(cache / "packs"),
        "PRIMUS_PACK_LOCK_DIR": str(cache / "locks"),
    }
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_train_cp2_logs_the_same_metrics_as_cp1(tmp_path: Path) -> None:
    one = _train(tmp_path / "cp1", tmp_path, 1, 1)
    # cp 2 alone, then cp 2 x dp 2 (each DP replica trains one of the step's 2 packs).
    for cp, world in ((2, 2), (2, 4)):
        got = _train(tmp_path / f"cp{cp}w{world}", tmp_path, cp, world)
        _same_metrics(one, got)


def _same_metrics(one: list[dict], two: list[dict]) -> None:
    assert [r["step"] for r in two] == [1, 2, 3] == [r["step"] for r in one]
    for a, b in zip(one, two, strict=True):
        for key in ("total_tokens", "real_tokens", "supervised_tokens"):
            assert a[key] == b[key], key  # counts summed over CP equal the unsplit pack's
        for key in ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr"):
            # float32 model; only summation order (chunk edges, the CP sums) differs.
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
