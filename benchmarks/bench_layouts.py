"""Packed (THD) vs padded (BSHD) training steps, side by side in one process.

Both layouts run the same trainer, tiny model and corpus with the same rows per step
(seq_length tokens each): THD rows hold many samples, a BSHD row holds one sample plus padding.
Each layout runs twice:
  - LM head on all rows: the head + CE run on every row (masked), as a conventional trainer
    computes them, so every row of seq_length tokens costs about the same;
  - LM head on supervised rows (the default): rows without a loss skip the head.
The loss and gradients are the same either way; only the work differs. Padding is never routed
to experts in any run (the THD contract). Printed: one epoch of the corpus from the pack
statistics (exact), then per run total / real / supervised tokens per step, real and supervised
fractions, step time, real and supervised tokens/s, an epoch-time estimate, and the THD/BSHD
ratios.

    python benchmarks/bench_layouts.py                   # examples/data/alpaca_demo.json, seq 4096
    python benchmarks/bench_layouts.py --steps 4 --gbs 2 --seq-length 2048
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from primus_v4.config import load_config, resolve_run
from primus_v4.training.metrics.writer import StepMetrics
from primus_v4.training.trainer import Trainer

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "alpaca_demo.json"
LAYOUTS = ("bshd", "thd")
HEAD_ROWS = {
    "all": "LM head on all rows (a conventional trainer's work: every row costs the same)",
    "supervised": "LM head on supervised rows only (the default)",
}


def run_layout(
    layout: str, head_rows: str, args: argparse.Namespace, out_dir: Path
) -> tuple[list[StepMetrics], dict, int]:
    """(step metrics, pack statistics, rows per epoch) of `args.steps` steps of one layout."""
    overrides = [
        f"data.path={args.data}",
        f"data.seq_length={args.seq_length}",
        f"data.layout={layout}",
        f"model.lm_head_rows={head_rows}",
        f"train.global_batch_size={args.gbs}",
        f"train.steps={args.steps}",
        "train.warmup_steps=1",
        f"output.dir={out_dir / f'{layout}_{head_rows}'}",
        "output.progress_bar=false",
        "output.plot=false",
        *args.set,
    ]
    trainer = Trainer(resolve_run(load_config(args.config, overrides), world=1))
    rows = [trainer.train_step(step) for step in range(args.steps)]
    return rows, trainer.corpus.stats, trainer.source.rows_per_epoch


def _mean(rows: list[StepMetrics], key: str) -> float:
    # The first step pays one-time allocation and kernel warm-up; it is left out when possible.
    timed = rows[1:] if len(rows) > 1 else rows
    return statistics.fmean(float(getattr(r, key)) for r in timed)


def _fmt(value: float) -> str:
    return f"{value:>14.4f}" if abs(value) < 10 else f"{value:>14,.1f}"


def _table(rows: dict[str, Callable[[str], float]]) -> str:
    lines = [f"{'':<34}{'BSHD':>14}{'THD':>14}{'THD/BSHD':>10}", "-" * 72]
    for name, fn in rows.items():
        bshd, thd = fn("bshd"), fn("thd")
        ratio = thd / bshd if bshd else float("inf")
        lines.append(f"{name:<34}{_fmt(bshd)}{_fmt(thd)}{ratio:>10.2f}")
    return "\n".join(lines)


def corpus_fractions(stats: dict, rows_per_epoch: dict[str, int], seq: int) -> dict[str, dict]:
    """One epoch of the corpus per layout, exact: rows, real and supervised fractions."""
    out = {}
    for layout, n_rows in rows_per_epoch.items():
        total = n_rows * seq
        out[layout] = {
            "rows": n_rows,
            "real_fraction": stats["real_tokens"] / total,
            "supervised_fraction": stats["supervised_tokens"] / total,
        }
    return out


def step_table(runs: dict[str, list[StepMetrics]], epoch_rows: dict[str, int], gbs: int) -> str:
    def frac(key: str) -> Callable[[str], float]:
        return lambda lay: _mean(runs[lay], key) / _mean(runs[lay], "total_tokens")

    return _table(
        {
            "total tokens / step": lambda lay: _mean(runs[lay], "total_tokens"),
            "real tokens / step": lambda lay: _mean(runs[lay], "real_tokens"),
            "supervised tokens / step": lambda lay: _mean(runs[lay], "supervised_tokens"),
            "real fraction": frac("real_tokens"),
            "supervised fraction": frac("supervised_tokens"),
            "step time (s)": lambda lay: _mean(runs[lay], "step_seconds"),
            "real tokens / s": lambda lay: _mean(runs[lay], "real_tokens_per_s"),
            "supervised tokens / s": lambda lay: _mean(runs[lay], "supervised_tokens_per_s"),
            "epoch time estimate (s)": lambda lay: (
                epoch_rows[lay] / gbs * _mean(runs[lay], "step_seconds")
            ),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--config", default=None, help="base run config (default: embedded)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--gbs", type=int, default=1, help="rows per step, both layouts")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (first = warmup)")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    start = time.perf_counter()
    runs: dict[str, dict[str, list[StepMetrics]]] = {h: {} for h in HEAD_ROWS}
    epoch_rows: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for head_rows in HEAD_ROWS:
            for layout in LAYOUTS:
                rows, stats, epoch_rows[layout] = run_layout(layout, head_rows, args, Path(tmp))
                runs[head_rows][layout] = rows
    corpus = corpus_fractions(stats, epoch_rows, args.seq_length)

    print(
        f"bench_layouts: {Path(args.data).name}, seq {args.seq_length}, {args.gbs} row(s)/step, "
        f"{args.steps} steps per run (means exclude step 1), tiny model"
    )
    print(f"\nOne epoch of the corpus ({stats['num_samples']} samples), exact")
    print(
        _table(
            {
                "rows": lambda lay: corpus[lay]["rows"],
                "real fraction": lambda lay: corpus[lay]["real_fraction"],
                "supervised fraction": lambda lay: corpus[lay]["supervised_fraction"],
            }
        )
    )
    for head_rows, title in HEAD_ROWS.items():
        print(f"\n{title}")
        print(step_table(runs[head_rows], epoch_rows, args.gbs))

    def step_ratio(head_rows: str) -> float:
        r = runs[head_rows]
        return _mean(r["thd"], "step_seconds") / _mean(r["bshd"], "step_seconds")

    print("\nchecks")
    print(
        f"  real fraction over one epoch: BSHD {corpus['bshd']['real_fraction']:.4f} "
        f"(expected near 0.05), THD {corpus['thd']['real_fraction']:.4f} (expected > 0.97)"
    )
    print(
        f"  step time THD/BSHD, head on all rows: {step_ratio('all'):.2f} "
        "(expected within 25%: same work per row)"
    )
    print(
        f"  step time THD/BSHD, head on supervised rows: {step_ratio('supervised'):.2f} "
        "(a padded row skips the head and the experts, so it is cheaper)"
    )
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
