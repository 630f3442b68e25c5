"""metrics.jsonl across resumes: one row per step for the whole run.

A resumed run redoes the steps after its checkpoint, so the rows after the resumed step (written
by the interrupted run after its last save) are dropped before new rows are appended; the
summary and the plot are then computed from the file, covering every step of the run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from primus_v4.durable import write_durable
from primus_v4.log import get_logger
from primus_v4.training.metrics.writer import StepMetrics

log = get_logger(__name__)

_FIELDS = {f.name: f.type for f in dataclasses.fields(StepMetrics)}


def _rows(path: Path, torn: list[int] | None = None) -> list[dict]:
    """The rows of metrics.jsonl; the numbers of lines cut short (a kill mid-write) go to
    `torn`."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif torn is not None:
            torn.append(number)
    return rows


def keep_rows_through(path: str | Path, step: int) -> int:
    """Rewrite metrics.jsonl with the rows of steps <= `step` only (atomically); rows kept. A
    line cut short is reported: its step is redone when it lies past `step`, else its row is
    missing from the run's history (said by step)."""
    path = Path(path)
    if not path.is_file():
        return 0
    torn: list[int] = []
    kept = [row for row in _rows(path, torn) if int(row.get("step", 0)) <= step]
    if torn:
        have = {int(row.get("step", 0)) for row in kept}
        missing = [s for s in range(1, step + 1) if s not in have]
        lost = (
            f"no row is left for step(s) {', '.join(map(str, missing))}, at or before the "
            f"resumed step {step}: they are not redone, so the history and plot lack them"
            if missing
            else f"the steps after the resumed step {step} are redone"
        )
        log.warning("%s: line(s) %s cut short (a run killed mid-write) removed; %s", path,
                    ", ".join(map(str, torn)), lost)  # fmt: skip
    write_durable(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(kept)


def _as_metrics(row: dict) -> StepMetrics:
    # Non-finite floats are written as strings ("nan"); float() reads them back.
    values = {k: (float(v) if isinstance(v, str) else v) for k, v in row.items() if k in _FIELDS}
    return StepMetrics(**values)


def read_history(path: str | Path) -> list[StepMetrics]:
    """Every step's row in metrics.jsonl (the last row wins if a step appears twice)."""
    by_step = {int(row["step"]): row for row in _rows(Path(path)) if "step" in row}
    return [_as_metrics(by_step[s]) for s in sorted(by_step)]
