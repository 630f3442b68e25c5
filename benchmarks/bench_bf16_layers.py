"""Where bf16 departs from float32 in one step: per-module outputs and per-parameter gradients.

Both runs start from the same weights (float32 trained `--warm` steps, then rounded to bf16), so
the table shows only what bf16 compute adds in one forward/backward, not a drifted trajectory.
A precision defect (something kept in bf16 that a mixed-precision trainer keeps in float32) shows
as a module or gradient whose relative error is far above the ~4e-3 of one bf16 rounding while
its inputs are not. Known large entries: MoE outputs (a near-tie top-k flips for a few tokens)
and the HyperHead gradients (final_norm is scale-invariant, so their true gradient is a near-zero
difference of large terms and any rounding of the streams dominates it). The discrete-choice table
counts rows whose chosen set (router experts, indexer keys) differs from float32's: bf16 inputs
flip near-ties whatever precision the scores are computed in.

    python benchmarks/bench_bf16_layers.py [--seq 256] [--warm 0]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from bench_master_weights import _trainer

from primus_v4.training.trainer import Trainer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _probe(trainer: Trainer, rows) -> tuple[dict, dict, dict, float]:
    """Module outputs (every micro-batch), discrete choices (router experts, indexer top-k),
    fp32 main gradients, and the step's loss."""
    acts: dict[str, list[torch.Tensor]] = {}
    picks: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):
        def hook(_mod, _inp, out) -> None:
            o = out[0] if isinstance(out, tuple) else out
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                acts.setdefault(name, []).append(o.detach().float().clone())
            elif isinstance(o, torch.Tensor) and o.dim() == 2:  # [rows, k] chosen ids
                picks.setdefault(name, []).append(o.detach().sort(dim=1).values.clone())

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in trainer.model.named_modules() if n]
    trainer.optimizer.zero_grad(set_to_none=True)
    step_loss = trainer.forward_backward(rows)
    for h in handles:
        h.remove()
    grads = {n: trainer.optimizer.main_grad(p).detach().clone()
             for n, p in trainer.model.named_parameters() if p.requires_grad}  # fmt: skip
    return acts, picks, grads, step_loss.reported(group=None)["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warm", type=int, default=0, help="float32 steps before the probe")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    common = ("train.steps=30", f"data.seq_length={args.seq}")
    ref = _trainer(tmp, "ref", "model.dtype=float32", *common)
    for step in range(args.warm):
        ref.train_step(step)
    weights = {n: p.detach().to(torch.bfloat16) for n, p in ref.model.named_parameters()}
    rows = ref.source.rows(args.warm, dp_rank=0, dp_size=1)
    runs = {}
    for dtype in ("bfloat16", "float32"):
        trainer = _trainer(tmp, dtype, f"model.dtype={dtype}", *common)
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                p.copy_(weights[n])
        runs[dtype] = _probe(trainer, rows)
    (acts_b, picks_b, grads_b, loss_b) = runs["bfloat16"]
    (acts_f, picks_f, grads_f, loss_f) = runs["float32"]
    print(f"loss after {args.warm} float32 steps, seq {args.seq}: bf16 {loss_b:.6f}, float32 "
          f"{loss_f:.6f} ({abs(loss_b - loss_f) / loss_f:.2e} relative)")  # fmt: skip
    print(f"{'module output':48s} {'rel err':>9}")
    for n, outs in acts_f.items():
        if len(acts_b.get(n, [])) == len(outs):
            err = max(_rel(a, b) for a, b in zip(acts_b[n], outs, strict=True))
            print(f"{n:48s} {err:9.2e}")
    print(f"\n{'discrete choice (rows whose set differs)':48s} {'rows':>9} {'differ':>9}")
    for n, outs in picks_f.items():
        pairs = list(zip(picks_b.get(n, []), outs, strict=False))
        total = sum(b.shape[0] for _, b in pairs)
        differ = sum(int((a != b).any(1).sum()) for a, b in pairs)
        print(f"{n:48s} {total:9d} {differ:9d}")
    print(f"\n{'parameter gradient':48s} {'rel err':>9} {'cosine':>9} {'|g| f32':>10}")
    for n, g in grads_f.items():
        a, b = grads_b[n].double().flatten(), g.double().flatten()
        cos = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))
        print(f"{n:48s} {_rel(a, b):9.2e} {cos:9.6f} {float(b.norm()):10.3e}")
    all_b = torch.cat([g.flatten() for g in grads_b.values()])
    all_f = torch.cat([g.flatten() for g in grads_f.values()])
    print(
        f"all gradients: rel err {_rel(all_b, all_f):.2e}, norm bf16 "
        f"{float(all_b.double().norm()):.6f} float32 {float(all_f.double().norm()):.6f}"
    )


if __name__ == "__main__":
    main()
