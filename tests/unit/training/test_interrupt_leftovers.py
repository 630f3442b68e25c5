"""What a killed or interrupted command leaves is removed by the next one that writes there, and
said in a line: a `latest` update's temp file, an export's partial dir; a metrics row cut short
at the resumed step is reported by step, not dropped silently."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from faults import captured_logs

from primus_v4.config import load_config
from primus_v4.durable import remove_stale
from primus_v4.training.checkpoint.lifecycle import RunCheckpoints
from primus_v4.training.metrics.history import keep_rows_through


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_killed_latest_update_is_removed_by_the_next_run(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    left = ck / f".latest.tmp.{_dead_pid()}"
    left.write_text("step_00000002\n")
    cfg = load_config(overrides=[f"checkpoint.dir={ck}"])
    with captured_logs() as logs:
        assert RunCheckpoints(cfg, world=1).resume_point() is None
    assert not left.exists()
    assert any(f"removed {left.name} in {ck}, left by an update of `latest`" in m for m in logs)


def test_only_the_leftovers_of_writers_that_no_longer_run_are_removed(tmp_path: Path) -> None:
    dead, old = tmp_path / f".out.partial-{_dead_pid()}-ab12cd34", tmp_path / ".out.partial-ab12"
    live = tmp_path / f".out.partial-{1}-ffffffff"  # pid 1 runs
    for path in (dead, old, live):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x" * 10)
    assert remove_stale(tmp_path, ".out.partial-") == sorted([dead.name, old.name])
    assert live.is_dir() and not dead.exists() and not old.exists()


def test_a_torn_row_at_the_resumed_step_is_reported_by_step(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    metrics.write_text("\n".join(rows[:2]) + "\n" + rows[2][:9] + "\n")
    with captured_logs() as logs:
        assert keep_rows_through(metrics, 3) == 2
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    [line] = [m for m in logs if "cut short" in m]
    assert f"{metrics}: line(s) 3 cut short" in line and "no row is left for step(s) 3" in line
    metrics.write_text("\n".join(rows[:2]) + "\n" + rows[2][:9] + "\n")
    with captured_logs() as logs:
        assert keep_rows_through(metrics, 2) == 2
    assert any("the steps after the resumed step 2 are redone" in m for m in logs)
