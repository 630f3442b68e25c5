"""Rows with images on data parallel: two gloo ranks, one golden image row each per step, train
as one process on both rows (loss, balance loss and grad norm over 2 steps), the image encoder
attached on every rank."""

from __future__ import annotations

from pathlib import Path

from harness import run_ranks
from image_corpus import GoldenImageCorpus, image_run

from primus_v4.training.trainer import Trainer

KEYS = ("loss", "aux_loss", "grad_norm")
SETTINGS = ("train.steps=2", "train.global_batch_size=2", "optim.grad_reduce_dtype=float64")


def _train(rank: int, world: int, out: str) -> list[dict]:
    run = image_run(Path(out) / f"rank{rank}", *SETTINGS, world=world)
    trainer = Trainer(run, corpus=GoldenImageCorpus())
    assert trainer.model.__dict__["image_encoder"] is not None
    return [{k: getattr(r, k) for k in KEYS} for r in trainer.train().rows]


def test_dp2_with_images_equals_one_process(tmp_path: Path) -> None:
    [one] = run_ranks(_train, 1, str(tmp_path / "one"), timeout_s=300)
    ranks = run_ranks(_train, 2, str(tmp_path / "dp2"), timeout_s=300)
    worst = dict.fromkeys(KEYS, 0.0)
    for rows in ranks:
        for a, b in zip(one, rows, strict=True):
            for k in KEYS:
                worst[k] = max(worst[k], abs(a[k] - b[k]) / max(abs(a[k]), 1e-30))
    print(f"\ndp2 with images vs one process, max relative difference: {worst}")
    assert len(one) == 2 and all(v <= 1e-5 for v in worst.values()), worst
