"""`NPROC=2 bash run_scripts/run_local.sh` trains the tiny model on CPU through torchrun (gloo):
the README's multi-process example, end to end, kept small (seq 512, 3 steps), with the shipped
config's global batch (1) following dp."""

from __future__ import annotations

import json
import math

from ports import free_port
from recipe_runner import run_recipe


def test_run_local_trains_tiny_model_on_two_cpu_processes(tmp_path):
    run = run_recipe(
        "run_local.sh",
        tmp_path,
        timeout=240,
        DRY_RUN="0",
        NPROC="2",
        PRIMUS_DEVICE="cpu",
        TRAIN_STEPS="3",
        PRIMUS_SEQ_LENGTH="512",
        # no GBS: the config's global batch of 1 follows dp (2), as the README runs it
        PRIMUS_DATA_PATH="synthetic",
        MASTER_PORT=str(free_port()),
    )
    out = tmp_path / "out"
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "train.global_batch_size follows dp: 2 for NPROC=2" in run.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows)
    # The per-node log got the run's output (tee), so a cluster run leaves it behind too.
    assert "step 3/3" in (out / "log_node0.txt").read_text()
