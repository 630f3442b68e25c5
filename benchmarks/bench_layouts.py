"""Packed (THD) vs padded (BSHD) training steps, side by side in one process.

Both layouts run the same trainer, tiny model and corpus with the same rows per step
(seq_length tokens each): THD rows hold many samples, a BSHD row holds one sample plus padding.
Printed per layout: total / real / supervised tokens per step, real and supervised fractions,
step time, real and supervised tokens/s, and the THD/BSHD ratios.

    python benchmarks/bench_layouts.py                      # alpaca_en_demo.json at seq 4096
    python benchmarks/bench_layouts.py --steps 4 --gbs 2 --seq-length 2048
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from primus_v4.config import load_config, resolve_run
from primus_v4.training.metrics import StepMetrics
from primus_v4.training.trainer import Trainer

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca_en_demo.json"


def run_layout(layout: str, args: argparse.Namespace, out_dir: Path) -> list[StepMetrics]:
    overrides = [
        f"data.path={args.data}",
        f"data.seq_length={args.seq_length}",
        f"data.layout={layout}",
        f"train.global_batch_size={args.gbs}",
        f"train.steps={args.steps}",
        "train.warmup_steps=1",
        f"output.dir={out_dir / layout}",
        "output.progress_bar=false",
        "output.plot=false",
        *args.set,
    ]
    trainer = Trainer(resolve_run(load_config(args.config, overrides), world=1))
    return [trainer.train_step(step) for step in range(args.steps)]


def _mean(rows: list[StepMetrics], key: str) -> float:
    # The first step pays one-time allocation and kernel warm-up; it is left out when possible.
    timed = rows[1:] if len(rows) > 1 else rows
    return statistics.fmean(float(getattr(r, key)) for r in timed)


def table(results: dict[str, list[StepMetrics]]) -> str:
    metrics = {
        "total tokens / step": lambda r: _mean(r, "total_tokens"),
        "real tokens / step": lambda r: _mean(r, "real_tokens"),
        "supervised tokens / step": lambda r: _mean(r, "supervised_tokens"),
        "real fraction": lambda r: _mean(r, "real_tokens") / _mean(r, "total_tokens"),
        "supervised fraction": lambda r: _mean(r, "supervised_tokens") / _mean(r, "total_tokens"),
        "step time (s)": lambda r: _mean(r, "step_seconds"),
        "real tokens / s": lambda r: _mean(r, "real_tokens_per_s"),
        "supervised tokens / s": lambda r: _mean(r, "supervised_tokens_per_s"),
    }
    lines = [f"{'metric':<26}{'BSHD':>14}{'THD':>14}{'THD/BSHD':>12}", "-" * 66]
    for name, fn in metrics.items():
        bshd, thd = fn(results["bshd"]), fn(results["thd"])
        fmt = "{:>14.4f}" if bshd < 10 else "{:>14,.1f}"
        ratio = thd / bshd if bshd else float("inf")
        lines.append(f"{name:<26}" + fmt.format(bshd) + fmt.format(thd) + f"{ratio:>12.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--config", default=None, help="base run config (default: embedded)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--gbs", type=int, default=1, help="rows per step, both layouts")
    parser.add_argument("--steps", type=int, default=3, help="steps per layout (first = warmup)")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = {layout: run_layout(layout, args, Path(tmp)) for layout in ("bshd", "thd")}
    print(
        f"bench_layouts: {Path(args.data).name}, seq {args.seq_length}, {args.gbs} row(s)/step, "
        f"{args.steps} steps per layout (means exclude step 1), tiny model"
    )
    print(table(results))
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
