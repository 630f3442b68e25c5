"""bf16 gradient buckets (`optim.grad_accum_dtype: bfloat16`) on gloo: the bf16 tiny model, 5
steps of 4 packs. dp=2 (each rank accumulates 2 packs in bf16, then one float32 reduce-scatter)
against dp=1 (4 packs in one bf16 bucket) and against float32 buckets, at a stated tolerance."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dist_zero import KEYS, PACKS
from train_fakes import SEQ, TEST_VOCAB, FakeCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.training.trainer import Trainer


def _rank(rank: int, world: int, out: str, accum: str) -> tuple[list[dict], dict[str, int]]:
    items = [f"data.seq_length={SEQ}", f"model.overrides.vocab_size={TEST_VOCAB}",
             f"output.dir={out}/rank{rank}", "output.progress_bar=false", "train.shuffle=false",
             "train.steps=5", "train.global_batch_size=4", "train.warmup_steps=1",
             "model.dtype=bfloat16", f"optim.grad_accum_dtype={accum}"]  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=items), world=world),
                      corpus=FakeCorpus(PACKS))  # fmt: skip
    try:
        rows = [{k: getattr(r, k) for k in KEYS} for r in trainer.train().rows]
        return rows, trainer.optimizer.state_bytes()
    finally:
        trainer.runtime.close()
        from primus_v4.parallel.groups import destroy_parallel

        destroy_parallel()


def _deviation(ref: list[dict], ranks: list, keys: tuple[str, ...]) -> float:
    pairs = [(a, b) for rows, _ in ranks for a, b in zip(ref, rows, strict=True)]
    return max(abs(b[k] - a[k]) / max(abs(a[k]), 1e-30) for a, b in pairs for k in keys)


def test_dp2_bf16_buckets_track_dp1_and_float32_buckets() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lean1 = run_ranks(_rank, 1, tmp + "/l1", "bfloat16", timeout_s=600)
        lean2 = run_ranks(_rank, 2, tmp + "/l2", "bfloat16", timeout_s=600)
        full2 = run_ranks(_rank, 2, tmp + "/f2", "float32", timeout_s=600)
    losses, norm = ("loss", "mtp_loss", "aux_loss"), ("grad_norm",)
    for name, ref in (("dp1", lean1), ("float32 buckets", full2)):
        worst, worst_norm = _deviation(ref[0][0], lean2, losses), _deviation(ref[0][0], lean2, norm)
        print(f"\nbf16 buckets at dp2 vs {name}: losses within {worst:.2e}, grad norm within "
              f"{worst_norm:.2e}")  # fmt: skip
        # dp=1 rounds its bf16 bucket after packs 2, 3 and 4, dp=2 after pack 2 on each rank:
        # 2^-9 roundings of the summed gradient (measured: losses 5.6e-4, grad norm 1.8e-2
        # by step 5, where AdamW's normalized steps spread them); about 3x that here.
        assert worst <= 2e-3 and worst_norm <= 5e-2
    for (_, lean), (_, full) in zip(lean2, full2, strict=True):
        # Between steps: bf16 buckets only, against float32 buckets + their reduced shards.
        assert lean["grad_buffers"] < 0.5 * full["grad_buffers"]
