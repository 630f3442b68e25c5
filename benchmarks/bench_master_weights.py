"""bf16 with fp32 master weights vs float32, the tiny model on CPU (one process).

1. lr 1e-6, 20 steps in bf16: the share of fp32 master weights that changed, and whether every
   bf16 weight equals its master rounded to bf16 (without masters, a plain bf16 AdamW changes
   about 2% of the weights at this lr: most updates are below half a bf16 ulp).
2. The default lr, 30 steps: bf16 and float32 loss curves side by side, max relative deviation.

    python benchmarks/bench_master_weights.py [--steps 30] [--seq 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from primus_v4.config import load_config, resolve_run
from primus_v4.training.trainer import Trainer


def _trainer(tmp: Path, name: str, *settings: str) -> Trainer:
    items = [
        "data.path=synthetic:rows=64",
        f"data.cache_dir={tmp / 'cache'}",
        f"data.lock_dir={tmp / 'locks'}",
        f"output.dir={tmp / name}",
        "output.progress_bar=false",
        "output.plot=false",
        *settings,
    ]
    return Trainer(resolve_run(load_config(overrides=items), world=1))


def masters_changed(tmp: Path, seq: int) -> None:
    trainer = _trainer(tmp, "lr1e-6", "model.dtype=bfloat16", "train.lr=1e-6",
                       "train.min_lr=1e-7", "train.steps=20", f"data.seq_length={seq}")  # fmt: skip
    slots = trainer.optimizer.slots
    before = [s.master.clone() for s in slots]
    start = time.perf_counter()
    trainer.train()
    changed = sum(int((s.master != b).sum()) for s, b in zip(slots, before, strict=True))
    total = sum(s.master.numel() for s in slots)
    rounded = all(
        torch.equal(s.param.detach().view(-1), s.master.to(torch.bfloat16)) for s in slots
    )
    print(f"bf16 lr 1e-6, 20 steps ({time.perf_counter() - start:.1f} s): "
          f"{changed:,} / {total:,} master weights changed ({100 * changed / total:.2f}%); "
          f"bf16 weights == rounded masters: {rounded}")  # fmt: skip


def loss_curves(tmp: Path, steps: int, seq: int) -> None:
    curves = {}
    for dtype in ("float32", "bfloat16"):
        trainer = _trainer(tmp, dtype, f"model.dtype={dtype}", f"train.steps={steps}",
                           f"data.seq_length={seq}")  # fmt: skip
        curves[dtype] = [r.loss for r in trainer.train().rows]
    print(f"{'step':>4} {'float32':>10} {'bfloat16':>10} {'rel dev':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(curves["float32"], curves["bfloat16"], strict=True)):
        dev = abs(b - a) / abs(a)
        worst = max(worst, dev)
        print(f"{i + 1:>4} {a:>10.4f} {b:>10.4f} {100 * dev:>8.3f}%")
    print(f"max relative deviation of the bf16 loss from float32 over {steps} steps: "
          f"{100 * worst:.3f}%")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        masters_changed(Path(tmp), args.seq)
        loss_curves(Path(tmp), args.steps, args.seq)


if __name__ == "__main__":
    main()
