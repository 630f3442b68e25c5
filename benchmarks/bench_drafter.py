"""Does training the DSpark drafter with the fine-tune keep speculation fast? On the tiny V4.1
release with three DSpark stages (tests/fixtures/dsv41_dspark_golden, vocabulary 512), CPU:

  base     the release fine-tuned on corpus A with its drafter (`model.draft.train: joint`);
  (a)      base fine-tuned on corpus B, the drafter carried as it was (`off`);
  (b)      base fine-tuned on corpus B with the drafter trained beside it (`joint`);
  (c)      (a)'s export, its drafter then trained alone on B (`only`: the cheap refresh).

Each export (FP8 / FP4 as released) is measured by greedy speculative decoding of held-out
prompts (`primus-v4 inspect draft`'s measure): mean accepted draft tokens per block; base on A
prompts beside every model on B prompts. The corpora are token streams of two different
rules (A: t -> 5 t + 11, B: t -> 7 t + 3, mod 509, with 10% noise), so "what follows" differs
between them and a fine-tune on B moves the backbone's greedy continuation away from A's.
Also printed: the mean step time of `joint` and `only` against plain SFT on the same packs.

    python benchmarks/bench_drafter.py [--steps 40] [--drafter-steps 60]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rule_corpus import SEQ, RuleCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.export.run import export_checkpoint, find_source
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.speculate import speculate_model
from primus_v4.training.trainer import Trainer

RELEASE = Path(__file__).resolve().parents[1] / "tests/fixtures/dsv41_dspark_golden/checkpoint"


def train(
    release: Path, corpus: RuleCorpus, mode: str, steps: int, out: Path
) -> tuple[Path, float]:
    """Train from `release` on `corpus` (`model.draft.train=mode`), export as released: (the
    export, mean step seconds after the first)."""
    items = [
        "model.preset=null", f"model.pretrained={release}", f"data.seq_length={SEQ}",
        f"output.dir={out / 'run'}", "output.progress_bar=false", "output.plot=false",
        f"train.steps={steps}", "train.warmup_steps=2", "train.global_batch_size=2",
        "train.lr=3e-3", "train.min_lr=3e-3", f"model.draft.train={mode}",
        "model.draft.anchor_rate=0.25", f"checkpoint.dir={out / 'ckpt'}",
        f"checkpoint.interval={steps}",
    ]  # fmt: skip
    rows = Trainer(resolve_run(load_config(overrides=items), world=1), corpus=corpus).train().rows
    export_checkpoint(find_source(out / "ckpt"), out / "export", dtype="fp8")
    seconds = [r.step_seconds for r in rows[1:]] or [rows[0].step_seconds]
    return out / "export", sum(seconds) / len(seconds)


def accepted(release: Path, prompts: list[list[int]], new: int) -> float:
    model = load_pretrained(release, drafter=True, progress=False)
    return speculate_model(model, prompts, max_new_tokens=new).mean_accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="fine-tuning steps on B")
    parser.add_argument("--drafter-steps", type=int, default=80,
                        help="steps of the base on A and of (c)'s drafter-only run")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    a_train, b_train = RuleCorpus("A", packs=64, seed=0), RuleCorpus("B", packs=64, seed=1)
    a_held, b_held = RuleCorpus("A", packs=4, seed=10), RuleCorpus("B", packs=4, seed=11)
    pa, pb = a_held.prompts(args.prompts), b_held.prompts(args.prompts)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        base, _ = train(RELEASE, a_train, "joint", args.drafter_steps, t / "base")
        carried, plain_s = train(base, b_train, "off", args.steps, t / "a")
        joint, joint_s = train(base, b_train, "joint", args.steps, t / "b")
        refreshed, only_s = train(carried, b_train, "only", args.drafter_steps, t / "c")
        rows = [
            ("base (tuned on A, drafter joint), A prompts", accepted(base, pa, args.new_tokens)),
            ("base, B prompts", accepted(base, pb, args.new_tokens)),
            ("(a) fine-tuned on B, drafter carried", accepted(carried, pb, args.new_tokens)),
            ("(b) fine-tuned on B, drafter joint", accepted(joint, pb, args.new_tokens)),
            ("(c) (a), then drafter only on B", accepted(refreshed, pb, args.new_tokens)),
        ]
    block = 5
    print(f"greedy speculative decoding, {args.prompts} held-out prompts x {args.new_tokens} "
          f"new tokens, blocks of {block} (mean accepted draft tokens per block)")  # fmt: skip
    for name, value in rows:
        print(f"  {name:<42} {value:6.3f}   ({1 + value:.2f} tokens per backbone pass)")
    print(f"step time on B, mean of steps 2..: plain SFT {plain_s:.3f} s, joint {joint_s:.3f} s "
          f"({joint_s / plain_s:.2f}x), only {only_s:.3f} s ({only_s / plain_s:.2f}x)")  # fmt: skip
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
