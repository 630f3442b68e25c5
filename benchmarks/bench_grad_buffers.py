"""bf16 gradient buckets vs float32 ones: the tiny model's default job in bf16 (not a test).

Two runs of the default job (primus_v4/configs/runs/tiny_cpu_thd.yaml: 4096-token packs, two
packs per step, its lr) with `model.dtype: bfloat16`, one with float32 gradient buckets, one with
`optim.grad_accum_dtype: bfloat16` (the second pack's gradient rounds the running sum to bf16
once per step; reduction and AdamW stay float32). Prints both loss curves side by side, the
largest relative deviation, the step times and the gradient-buffer bytes between steps.

This CPU has no bf16 matrix units (a bf16 GEMM runs at ~0.3 GFLOP/s here: the 129280-way LM
head alone would take minutes per step), so every bf16 mm / bmm takes float32 inputs and rounds
its output to bf16 (`bench_activation_width.StepMode`, `--gemm fp32`), as a GPU's bf16 GEMM
accumulates in float32; `--gemm native` keeps torch's own.

    python benchmarks/bench_grad_buffers.py [--steps 30] [--seq 4096] [--packs 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def _gemms(gemm: str):
    import contextlib

    if gemm == "native":
        return contextlib.nullcontext()
    from bench_activation_width import StepMode

    return StepMode("fp32")


def run(tmp: Path, accum: str, steps: int, seq: int, packs: int,
        gemm: str) -> tuple[list[float], float, int]:  # fmt: skip
    from primus_v4.config import load_config, resolve_run
    from primus_v4.training.trainer import Trainer

    items = [
        "data.path=synthetic:rows=64", f"data.cache_dir={tmp / 'cache'}",
        f"data.lock_dir={tmp / 'locks'}", f"output.dir={tmp / accum}",
        "output.progress_bar=false", "output.plot=false", "model.dtype=bfloat16",
        f"optim.grad_accum_dtype={accum}", f"train.steps={steps}", f"data.seq_length={seq}",
        f"train.global_batch_size={packs}",
    ]  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=items), world=1))
    start = time.perf_counter()
    with _gemms(gemm):
        rows = trainer.train().rows
    seconds = (time.perf_counter() - start) / steps
    return [r.loss for r in rows], seconds, trainer.optimizer.state_bytes()["grad_buffers"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--packs", type=int, default=2, help="packs (micro-batches) per step")
    parser.add_argument("--gemm", choices=("fp32", "native"), default="fp32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        full = run(Path(tmp), "float32", args.steps, args.seq, args.packs, args.gemm)
        lean = run(Path(tmp), "bfloat16", args.steps, args.seq, args.packs, args.gemm)
    print(f"{'step':>4} {'fp32 buckets':>13} {'bf16 buckets':>13} {'rel. diff':>10}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(full[0], lean[0], strict=True), 1):
        diff = abs(b - a) / abs(a)
        worst = max(worst, diff)
        print(f"{i:>4} {a:>13.5f} {b:>13.5f} {diff:>10.2e}")
    print(f"largest relative deviation of the loss: {100 * worst:.3f}%")
    mib = 2**20
    print(f"s/step: {full[1]:.2f} (fp32 buckets) vs {lean[1]:.2f} (bf16 buckets); gradient "
          f"buffers between steps {full[2] / mib:.1f} MiB vs {lean[2] / mib:.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
