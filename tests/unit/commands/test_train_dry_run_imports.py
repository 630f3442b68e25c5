"""`train --dry-run` loads only what its checks need: no memory planner without --device-memory,
and the checkpoint directory listing (resume detection) without torch.distributed."""

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
