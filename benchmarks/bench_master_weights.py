"""bf16 with fp32 master weights vs float32, the tiny model on CPU (one process).

1. lr 1e-6, 20 steps in bf16: the share of fp32 master weights that changed, and whether every
   bf16 weight equals its master rounded to bf16 (without masters, a plain bf16 AdamW changes
   about 2% of the weights at this lr: most updates are below half a bf16 ulp); beside it the
   same run in float32, and in bf16 with weight decay 0.1 (whose per-step decay reaches every
   decayed weight, also embedding rows no gradient reaches).
2. The default job (its lr, 4096-token packs), 30 steps: bf16 and float32 loss curves side by
   side, max relative deviation, beside two float32 controls: started from the bf16-rounded
   initial weights, and from initial weights perturbed by a relative 2^-17 (uniform, fixed
   seed; 256 times finer than a bf16 rounding). The controls measure how far this run's curve
   moves under a perturbation alone: router and indexer top-k choices are discrete, and past
   the stable lr (`--lr 1e-2`) a tiny perturbation flips a near-tie or sets off a gradient
   spike, and from then on the trajectories differ by the spread of the loss across runs.

    python benchmarks/bench_master_weights.py [--steps 30] [--seq 4096] [--masters-seq 256]
        [--lr LR] [--part masters|curves]
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


def masters_changed(tmp: Path, seq: int, dtype: str, weight_decay: float) -> None:
    """One lr 1e-6 run of 20 steps: which master weights moved, counted against the weights a
    gradient ever reached (embedding rows of tokens absent from the corpus get none: at weight
    decay 0 no optimizer moves them; decoupled decay moves every decayed weight by ~1e-7 of
    itself per step, far under half a bf16 ulp, 2^-9)."""
    name = f"lr1e-6-{dtype}-wd{weight_decay}"
    trainer = _trainer(tmp, name, f"model.dtype={dtype}", "train.lr=1e-6", "train.min_lr=1e-7",
                       "train.steps=20", f"data.seq_length={seq}",
                       f"train.weight_decay={weight_decay}")  # fmt: skip
    opt = trainer.optimizer
    slots = opt.slots
    before = [s.master.clone() for s in slots]
    touched = [torch.zeros_like(s.master, dtype=torch.bool) for s in slots]
    clip = opt.clip_grad_norm

    def recording_clip(max_norm: float) -> float:
        for t, s in zip(touched, slots, strict=True):
            t |= s.grad != 0
        return clip(max_norm)

    opt.clip_grad_norm = recording_clip
    start = time.perf_counter()
    trainer.train()
    changed_mask = [s.master != b for s, b in zip(slots, before, strict=True)]
    changed = sum(int(m.sum()) for m in changed_mask)
    with_grad = sum(int(t.sum()) for t in touched)
    changed_with_grad = sum(int((m & t).sum()) for m, t in zip(changed_mask, touched, strict=True))
    total = sum(s.master.numel() for s in slots)
    untouched_embedding = sum(int((~t).sum()) for t, s in zip(touched, slots, strict=True)
                              if "embed" in s.name)  # fmt: skip
    line = (f"{dtype} lr 1e-6 weight decay {weight_decay}, 20 steps "
            f"({time.perf_counter() - start:.1f} s): {changed:,} / {total:,} master weights "
            f"changed ({100 * changed / total:.2f}%); of the {with_grad:,} with a nonzero "
            f"gradient: {changed_with_grad:,} changed "
            f"({100 * changed_with_grad / max(with_grad, 1):.2f}%); never given a gradient: "
            f"{total - with_grad:,}, of them {untouched_embedding:,} embedding rows of tokens "
            "absent from the corpus")  # fmt: skip
    if dtype == "bfloat16":
        moved = sum(int((s.param.detach().view(-1) != b.to(torch.bfloat16)).sum())
                    for s, b in zip(slots, before, strict=True))  # fmt: skip
        rounded = all(
            torch.equal(s.param.detach().view(-1), s.master.to(torch.bfloat16)) for s in slots
        )
        line += (f"; bf16 weights that moved: {100 * moved / total:.2f}%; bf16 weights == "
                 f"rounded masters: {rounded}")  # fmt: skip
    print(line, flush=True)


@torch.no_grad()
def _perturb(model: torch.nn.Module, kind: str) -> None:
    """control: weights rounded to bf16; jitter: weights x (1 + 2^-17 u), u ~ U(-1, 1)."""
    gen = torch.Generator().manual_seed(1234)
    for p in model.parameters():
        if kind == "control":
            p.copy_(p.to(torch.bfloat16))
        else:
            p.mul_(1 + 2**-17 * (2 * torch.rand(p.shape, generator=gen) - 1))


def loss_curves(tmp: Path, steps: int, seq: int, lr: float | None) -> None:
    """float32, bf16, and two float32 controls from perturbed initial weights (module doc)."""
    runs = (("float32", "float32"), ("bfloat16", "bfloat16"), ("control", "float32"),
            ("jitter", "float32"))  # fmt: skip
    curves = {}
    for name, dtype in runs:
        lrs = () if lr is None else (f"train.lr={lr}", f"train.min_lr={lr / 10}")
        trainer = _trainer(tmp, name, f"model.dtype={dtype}", f"train.steps={steps}",
                           f"data.seq_length={seq}", *lrs)  # fmt: skip
        if name in ("control", "jitter"):
            _perturb(trainer.model, name)
        curves[name] = [(r.loss, r.grad_norm) for r in trainer.train().rows]
    ref = curves["float32"]
    others = ("bfloat16", "control", "jitter")
    # gnorm: the step's gradient norm before clipping (clip_grad 1): a spike marks a step whose
    # update clipping shrinks, where two runs that spike differently part ways.
    print(f"{'step':>4} {'float32':>8} {'gnorm':>6}"
          + "".join(f" {k:>8} {'dev':>7} {'gnorm':>6}" for k in others))  # fmt: skip
    worst = dict.fromkeys(others, (0.0, 0))
    for i, (a, g) in enumerate(ref):
        dev = {k: abs(curves[k][i][0] - a) / abs(a) for k in others}
        worst = {k: max(worst[k], (dev[k], i + 1)) for k in others}
        cols = "".join(f" {curves[k][i][0]:>8.4f} {100 * dev[k]:>6.3f}% {curves[k][i][1]:>6.3f}"
                       for k in others)  # fmt: skip
        print(f"{i + 1:>4} {a:>8.4f} {g:>6.3f}{cols}")
    (b, bs), (c, cs), (j, js) = (worst[k] for k in others)
    print(f"max relative deviation from float32 over {steps} steps: bf16 {100 * b:.3f}% (step "
          f"{bs}); float32 from bf16-rounded weights {100 * c:.3f}% (step {cs}); float32 from "
          f"weights x (1 + 2^-17 u) {100 * j:.3f}% (step {js})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=4096, help="curves: the default job's 4096")
    parser.add_argument("--masters-seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=None, help="curves: peak lr (min_lr lr/10)")
    parser.add_argument("--part", choices=("all", "masters", "curves"), default="all")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("all", "masters"):
            for dtype, weight_decay in (("bfloat16", 0.0), ("float32", 0.0), ("bfloat16", 0.1)):
                masters_changed(Path(tmp), args.masters_seq, dtype, weight_decay)
        if args.part in ("all", "curves"):
            loss_curves(Path(tmp), args.steps, args.seq, args.lr)


if __name__ == "__main__":
    main()
