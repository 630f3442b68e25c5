"""How much of a fine-tune does the served FP8 / FP4 export keep, with and without
quantization-aware training (`train.quant_aware: release`)? Two bases, each first trained on
corpus A of benchmarks/rule_corpus.py and exported FP8 / FP4 as its "release":
  V4.1  the tiny V4.1 release (tests/fixtures/dsv41_dspark_golden: FP8 32 x 32 + FP4 experts);
  V4    the tiny DeepSeek-V4 preset (FP8 128 x 128 + FP4 experts; vocabulary cut to 512, with
        the V4.1 release's 512-id tokenizer), drawn.
Then fine-tuning on corpus B, CPU, float32, in full and with LoRA (rank 8, alpha 16, the default
targets, the base kept as released). For each base, method, learning rate and mode, side by
side, the held-out (B) loss of:

  base       that release;
  trained    the fine-tune as it trained (with the mode: its quantized forward);
  bf16       its bf16 export;
  fp8        its FP8 / FP4 export (what a server loads);

and the share of the fine-tune's gain (base - trained) that the fp8 export keeps (with LoRA, the
exports are the merged ones). Then the mean step time of the mode against the plain step, per
base and method.

    python benchmarks/bench_quant_aware.py [--steps 16] [--lrs 3e-4,3e-5] [--lora-lrs 3e-3,3e-4]
        [--families v41,v4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from rule_corpus import SEQ, RuleCorpus

from primus_v4 import load_pretrained
from primus_v4.config import load_config, resolve_run
from primus_v4.export.run import export_checkpoint, find_source
from primus_v4.training.trainer import Trainer

RELEASE = Path(__file__).resolve().parents[1] / "tests/fixtures/dsv41_dspark_golden/checkpoint"
# how each base is first built (then trained on A): the V4.1 release, the V4 tiny preset drawn
FIRST = {
    "v41": ("model.preset=null", f"model.pretrained={RELEASE}"),
    "v4": ("model.preset=tiny", "model.overrides.vocab_size=512", f"data.tokenizer={RELEASE}"),
}
NAMES = {"v41": "V4.1", "v4": "V4"}
LORA = ("model.lora.rank=8", "model.lora.alpha=16", "model.lora.base=release")


def held_out_loss(model: torch.nn.Module, corpus: RuleCorpus, trainer: Trainer) -> float:
    total, supervised = 0.0, 0
    with torch.no_grad():
        for i in range(len(corpus)):
            batch = corpus.thd_batch(i)
            inputs = trainer.model_inputs(batch)
            inputs.pop("comm")
            total += float(model(**inputs).loss_sum)
            supervised += batch.num_supervised
    return total / supervised


def run(
    model: tuple[str, ...], mode: str, lr: float, steps: int, tmp: Path, train: RuleCorpus,
    held: RuleCorpus, extra: tuple[str, ...] = (),
) -> dict:  # fmt: skip
    items = [
        *model, f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "output.plot=false",
        f"train.steps={steps}", "train.warmup_steps=2", "train.global_batch_size=2",
        f"train.lr={lr}", f"train.min_lr={lr}", f"train.quant_aware={mode}",
        f"checkpoint.dir={tmp / 'ckpt'}", f"checkpoint.interval={steps}", *extra,
    ]  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=items), world=1), corpus=train)
    rows = trainer.train().rows
    out = {"step_s": sum(r.step_seconds for r in rows[1:]) / max(len(rows) - 1, 1)}
    with trainer.quantized():
        out["trained"] = held_out_loss(trainer.model, held, trainer)
    for dtype in ("bfloat16", "fp8"):
        export_checkpoint(find_source(tmp / "ckpt"), tmp / dtype, dtype=dtype)
        model = load_pretrained(tmp / dtype, dtype=torch.float32, progress=False)
        out[dtype] = held_out_loss(model, held, trainer)
    out["trainer"] = trainer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--base-steps", type=int, default=40, help="the base's steps on A")
    parser.add_argument("--lrs", default="3e-4,3e-5", help="full fine-tuning")
    parser.add_argument("--lora-lrs", default="3e-3,3e-4")
    parser.add_argument("--families", default="v41,v4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, held = RuleCorpus("B", packs=32, seed=1), RuleCorpus("B", packs=4, seed=11)
    work = tempfile.TemporaryDirectory()
    print(f"held-out loss on B after {args.steps} steps on B, from a tiny base trained on A for "
          f"{args.base_steps} steps and exported FP8 / FP4")  # fmt: skip
    print(f"{'base':>5} {'method':>6} {'lr':>7} {'mode':>8} {'base':>8} {'trained':>8} "
          f"{'bf16':>8} {'fp8':>8} {'fp8 keeps':>10} {'step s':>7}")  # fmt: skip
    ratios = []
    for family in args.families.split(","):
        home = Path(work.name) / family
        run(FIRST[family], "none", 3e-3, args.base_steps, home, RuleCorpus("A", packs=64, seed=0),
            held)  # fmt: skip
        release = ("model.preset=null", f"model.pretrained={home / 'fp8'}", *FIRST[family][2:])
        base = None
        for method, lrs, extra in (("full", args.lrs, ()), ("lora", args.lora_lrs, LORA)):
            times: dict[str, list[float]] = {"none": [], "release": []}
            for lr in (float(x) for x in lrs.split(",")):
                for mode in ("none", "release"):
                    with tempfile.TemporaryDirectory() as tmp:
                        r = run(release, mode, lr, args.steps, Path(tmp), train, held, extra)
                    if base is None:
                        model = load_pretrained(home / "fp8", dtype=torch.float32, progress=False)
                        base = held_out_loss(model, held, r["trainer"])
                    gain = base - r["trained"]
                    keeps = (base - r["fp8"]) / gain if gain else float("nan")
                    times[mode].append(r["step_s"])
                    print(f"{NAMES[family]:>5} {method:>6} {lr:>7.0e} {mode:>8} {base:>8.4f} "
                          f"{r['trained']:>8.4f} {r['bfloat16']:>8.4f} {r['fp8']:>8.4f} "
                          f"{keeps:>10.3f} {r['step_s']:>7.3f}", flush=True)  # fmt: skip
            plain, qat = (sum(times[m]) / len(times[m]) for m in ("none", "release"))
            ratios.append(f"{NAMES[family]} {method}: {qat:.3f} s vs {plain:.3f} s "
                          f"({qat / plain:.2f}x)")  # fmt: skip
    print("step time, quant_aware=release vs none:")
    for line in ratios:
        print(f"  {line}")
    work.cleanup()


if __name__ == "__main__":
    main()
