"""Full fine-tuning vs LoRA on the tiny model, side by side in one run (not a test).

First a base: the tiny model trained from its random init on the Alpaca demo corpus
(examples/data/alpaca_demo.json, full fine-tuning, `--base-steps`), exported as a release in
bf16 and in FP8 / FP4. Then four runs fine-tune that base on the same packs of another corpus
(the chat demo corpus, examples/data/chat_demo.jsonl), float32 on CPU: full fine-tuning, LoRA
rank 8 and rank 64 (alpha = 2 x rank, the default targets: attention projections, shared and
routed experts, one adapter per expert) on the bf16 base, and LoRA rank 8 on the FP8 / FP4 base
kept as released (model.lora.base: release), beside the base's own loss on each step's packs
(`base only`: nothing moves). Printed: the loss curves, trainable parameters,
optimizer bytes (fp32 moments and masters) and gradient buffers, seconds per step. Then how much
of each trained adapter's update survives the release's FP8 / FP4 quantization of a merged
export: the base rounded to the release format first (as a released checkpoint is), W + D
quantized again, and |Q(W + D) - W| / |D| (1: the update arrives whole, 0: it is rounded away),
with the relative error of what arrives.

On this model the embedding and LM head are ~98% of the parameters (a 129280-token vocabulary at
width 64) and LoRA keeps them frozen, so full fine-tuning moves far more of it than any adapter
can; the adapters' gain is read against `base only`, step by step on the same packs.

    python benchmarks/bench_lora.py [--steps 30] [--base-steps 40] [--seq 1024] [--packs 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
FROM = ["model.preset=null"]  # the release brings its own config.json


def run(tmp: Path, name: str, steps: int, seq: int, packs: int, lr: float, rank: int,
        *extra: str):  # fmt: skip
    from primus_v4.config import load_config, resolve_run
    from primus_v4.training.trainer import Trainer

    items = [
        f"data.path={DATA / 'chat_demo.jsonl'}", f"data.cache_dir={tmp / 'cache'}",
        f"data.lock_dir={tmp / 'locks'}", f"output.dir={tmp / name}", "output.progress_bar=false",
        "output.plot=false", f"train.steps={steps}", f"data.seq_length={seq}",
        f"train.global_batch_size={packs}", f"train.lr={lr}", "train.warmup_steps=2",
        "model.dtype=float32", *extra,
    ]  # fmt: skip
    if rank:
        items += [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}",
                  "model.lora.allow_random_base=true"]  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=items), world=1))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    state = trainer.optimizer.state_bytes()
    start = time.perf_counter()
    rows = trainer.train().rows
    seconds = (time.perf_counter() - start) / steps
    opt_bytes = sum(v for k, v in state.items() if k != "grad_buffers")
    return trainer, [r.loss for r in rows], trainable, opt_bytes, state["grad_buffers"], seconds


def base(tmp: Path, args: argparse.Namespace) -> tuple[Path, Path, list[float]]:
    """The tiny model trained `--base-steps` on the Alpaca demo corpus, exported as a bf16 and an
    FP8 / FP4 release (with the bundled tokenizer's files)."""
    from primus_v4.export.run import export_checkpoint, find_source

    trainer, curve, *_ = run(
        tmp, "base", args.base_steps, args.seq, args.packs, args.base_lr, 0,
        f"data.path={DATA / 'alpaca_demo.json'}", f"checkpoint.dir={tmp / 'base' / 'ckpt'}",
        f"checkpoint.interval={args.base_steps}",
    )  # fmt: skip
    del trainer
    source = find_source(tmp / "base" / "ckpt")
    for dtype in ("bfloat16", "fp8"):
        export_checkpoint(source, tmp / f"base_{dtype}", dtype=dtype)
    return tmp / "base_bfloat16", tmp / "base_fp8", curve


@torch.no_grad()
def survival(model) -> dict[str, tuple[float, float, int]]:
    """Per format (fp8: the 2-D attention / shared weights, fp4: the routed experts): the share
    of the merged update's norm that survives quantization, and the relative error of it."""
    from primus_v4.checkpoint_formats import fp8_fp4 as q
    from primus_v4.models.common.kept_base import release_weights
    from primus_v4.models.deepseek_v4.lora import merged_weights

    state = model.state_dict()
    state.update({w.ours: w() for w in release_weights(model)})  # a base kept as released
    out: dict[str, list[float]] = {"fp8": [0.0, 0.0, 0.0, 0], "fp4": [0.0, 0.0, 0.0, 0]}
    for name, merged in merged_weights(model).items():
        w = state[name].float()
        delta = merged - w
        fmt = "fp4" if name.endswith(("w_gate_up", "w_down")) else "fp8"
        for i in range(w.shape[0] if w.dim() == 3 else 1):
            wi, di = (w[i], delta[i]) if w.dim() == 3 else (w, delta)
            if fmt == "fp8":
                base = q.dequantize_fp8(*q.quantize_fp8(wi), torch.float32)
                got = q.dequantize_fp8(*q.quantize_fp8(base + di), torch.float32) - base
            else:
                base = q.dequantize_fp4(*q.quantize_fp4(wi), torch.float32)
                got = q.dequantize_fp4(*q.quantize_fp4(base + di), torch.float32) - base
            acc = out[fmt]
            acc[0] += float((got * di).sum())  # projection of what arrived on the update
            acc[1] += float(di.square().sum())
            acc[2] += float((got - di).square().sum())
            acc[3] += 1
    return {f: (a[0] / a[1], (a[2] / a[1]) ** 0.5, int(a[3])) for f, a in out.items() if a[1] > 0}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--base-steps", type=int, default=40, help="training the base")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--packs", type=int, default=2)
    parser.add_argument("--base-lr", type=float, default=5e-3, help="training the base")
    parser.add_argument("--lr", type=float, default=1e-3, help="full fine-tuning")
    parser.add_argument("--lora-lr", type=float, default=5e-3, help="LoRA runs")
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        bf16, fp8, curve = base(Path(tmp), args)
        print(
            f"base: {args.base_steps} full fine-tuning steps on the Alpaca demo corpus, loss "
            f"{curve[0]:.4f} -> {curve[-1]:.4f}; exported bf16 and FP8 / FP4",
            flush=True,
        )
        for name, rank, lr, extra in (
            # the base's own loss on each step's packs (adapters with B = 0 that do not move)
            ("base only", 8, 1e-12, [*FROM, f"model.pretrained={bf16}", "train.min_lr=0"]),
            ("full", 0, args.lr, [*FROM, f"model.pretrained={bf16}"]),
            ("lora r8", 8, args.lora_lr, [*FROM, f"model.pretrained={bf16}"]),
            ("lora r64", 64, args.lora_lr, [*FROM, f"model.pretrained={bf16}"]),
            ("r8 fp8 base", 8, args.lora_lr,
             [*FROM, f"model.pretrained={fp8}", "model.lora.base=release"]),
        ):  # fmt: skip
            runs[name] = run(Path(tmp), name.replace(" ", "_"), args.steps, args.seq,
                             args.packs, lr, rank, *extra)  # fmt: skip
    names = list(runs)
    print(f"{'step':>4} " + " ".join(f"{n:>10}" for n in names))
    for i in range(args.steps):
        print(f"{i + 1:>4} " + " ".join(f"{runs[n][1][i]:>10.4f}" for n in names))
    base_curve = runs["base only"][1]
    mib = 2**20
    print(f"{'':>22}" + "".join(f"{n:>14}" for n in names))
    rows = (
        ("trainable parameters", lambda r: f"{r[2]:,}"),
        ("optimizer state, MiB", lambda r: f"{r[3] / mib:.2f}"),
        ("gradient buffers, MiB", lambda r: f"{r[4] / mib:.2f}"),
        ("seconds per step", lambda r: f"{r[5]:.2f}"),
        ("loss, last 10 steps", lambda r: f"{_mean(r[1][-10:]):.4f}"),
        # the same packs through the base alone: what the run has learned on them
        ("  minus the base's", lambda r: f"{_mean(r[1][-10:]) - _mean(base_curve[-10:]):+.4f}"),
    )
    for label, fmt in rows:
        print(f"{label:<22}" + "".join(f"{fmt(runs[n]):>14}" for n in names))
    for name in ("lora r8", "lora r64", "r8 fp8 base"):
        for fmt, (kept, err, n) in survival(runs[name][0].model).items():
            print(f"{name}: {fmt} merge of {n} matrices keeps {100 * kept:.1f}% of the update "
                  f"(relative error of what arrives {100 * err:.1f}%)")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
