"""Metrics rows, summary and plot."""

from __future__ import annotations

import json
from pathlib import Path

from primus_v4.training.metrics.writer import (
    MetricsWriter,
    format_table,
    make_step_metrics,
    plot_loss,
    read_metrics,
    summarize,
)


def _row(step: int, loss: float):
    return make_step_metrics(
        step=step,
        losses={"loss": loss, "mtp_loss": loss, "aux_loss": 0.001},
        grad_norm=1.0,
        lr=1e-3,
        tokens=(1000, 900, 400),
        seconds=0.5,
    )


def test_throughput_summary_and_nan_rows(tmp_path: Path) -> None:
    rows = [_row(i + 1, 10.0 - i) for i in range(10)] + [_row(11, float("nan"))]
    assert rows[0].tokens_per_s == 2000 and rows[0].supervised_tokens_per_s == 800
    assert rows[-1].nan and not rows[0].nan
    summary = summarize(rows)
    assert summary["loss_first_5"] == 8.0 and summary["loss_last_5"] == 3.0
    # Under 10 steps the windows shrink so they never overlap (3 steps: first 1 vs last 1).
    short = summarize(rows[:3])
    assert short["loss_first_1"] == 10.0 and short["loss_last_1"] == 8.0
    assert short["loss_drop"] == 2.0
    assert abs(summary["real_fraction"] - 0.9) < 1e-12
    assert "loss_drop" in format_table(summary)
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for r in rows:
        writer.write(r)
    writer.close()
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert len(back) == 11 and back[-1]["loss"] == "nan" and back[-1]["nan"] is True
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert plot_loss(rows, tmp_path / "loss.png").stat().st_size > 0
