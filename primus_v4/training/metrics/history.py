"""metrics.jsonl across resumes: one row per step for the whole run.

A resumed run redoes the steps after its checkpoint, so the rows after the resumed step (written
by the interrupted run after its last save) are dropped before new rows are appended; the
summary and the plot are then computed from the file, covering every step of the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from primus_v4.training.metrics.writer import StepMetrics

_FIELDS = {f.name: f.type for f in dataclasses.fields(StepMetrics)}


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill mid-write; its step is redone
    return rows


def keep_rows_through(path: str | Path, step: int) -> int:
    """Rewrite metrics.jsonl with the rows of steps <= `step` only (atomically); rows kept."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept = [row for row in _rows(path) if int(row.get("step", 0)) <= step]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(tmp, path)
    return len(kept)


def _as_metrics(row: dict) -> StepMetrics:
    # Non-finite floats are written as strings ("nan"); float() reads them back.
    values = {k: (float(v) if isinstance(v, str) else v) for k, v in row.items() if k in _FIELDS}
    return StepMetrics(**values)


def read_history(path: str | Path) -> list[StepMetrics]:
    """Every step's row in metrics.jsonl (the last row wins if a step appears twice)."""
    by_step = {int(row["step"]): row for row in _rows(Path(path)) if "step" in row}
    return [_as_metrics(by_step[s]) for s in sorted(by_step)]
