"""`train --dry-run` loads only what its checks need: no memory planner without --device-memory,
the checkpoint directory listing (resume detection) without torch.distributed, and the model as
its geometry (no torch, no megatron-core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
import primus_v4.training.checkpoint.integrity
integrity_torch = "torch" in sys.modules
from primus_v4.cli import main
code = main(["train", "--dry-run", "--set", "checkpoint.dir=ck"])
loaded = [m for m in ("primus_v4.memory.gate", "primus_v4.memory.plan") if m in sys.modules]
print(json.dumps({"code": code, "integrity_torch": integrity_torch, "loaded": loaded}))
"""


def test_dry_run_skips_the_planner_and_integrity_is_torch_free(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe == {"code": 0, "integrity_torch": False, "loaded": []}


GEOMETRY_PROBE = """
import json, os, sys
from primus_v4.cli import main
codes = [main(["train", "--dry-run"])]
codes.append(main(["train", "--dry-run", "--set", "model.preset=tiny_v41"]))
os.environ["WORLD_SIZE"] = "3"  # three pipeline stages: the stage plan is checked too
codes.append(main(["train", "--dry-run", "--set", "parallel.pp=3", "--set", "train.steps=5"]))
os.environ["WORLD_SIZE"] = "1"  # the recipes' recompute choices are geometry too
codes.append(main(["train", "--dry-run", "--set", "model.recompute=selective",
                   "--set", "model.recompute_modules=[layernorm,moe]"]))
codes.append(main(["train", "--dry-run", "--set", "model.recompute=full",
                   "--set", "model.dtype=bfloat16"]))
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "megatron", "safetensors"})
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_dry_run_reads_the_model_geometry_without_torch_or_megatron(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", GEOMETRY_PROBE], cwd=tmp_path, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    derived = [json.loads(line)["derived"] for line in lines[:5]]
    assert [d["num_layers"] for d in derived] == [3, 6, 3, 3, 3]
    assert [d["world_size"] for d in derived] == [1, 1, 3, 1, 1]
    assert json.loads(lines[-1]) == {"codes": [0, 0, 0, 0, 0], "heavy": []}
