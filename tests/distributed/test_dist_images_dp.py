"""Rows with images on data parallel: two gloo ranks, one golden image row each per step, train
as one process on both rows (loss, balance loss and grad norm over 2 steps), the image encoder
attached on every rank; with `model.vision.train=all` the tower's and aligner's gradients are
reduced over the ranks too (the weights after step 1 decide step 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_ranks
from image_corpus import GoldenImageCorpus, image_run

from primus_v4.training.trainer import Trainer

KEYS = ("loss", "aux_loss", "grad_norm")
SETTINGS = ("train.steps=2", "train.global_batch_size=2", "optim.grad_reduce_dtype=float64")


def _train(rank: int, world: int, out: str, vision: str) -> list[dict]:
    run = image_run(Path(out) / f"rank{rank}", *SETTINGS, f"model.vision.train={vision}",
                    "train.lr=1e-3", world=world)  # fmt: skip
    trainer = Trainer(run, corpus=GoldenImageCorpus())
    tower = trainer.model._image_part("vision")
    assert tower is not None and any(p.requires_grad for p in tower.parameters()) == (
        vision == "all"
    )
    return [{k: getattr(r, k) for k in KEYS} for r in trainer.train().rows]


@pytest.mark.parametrize("vision", ["frozen", "all"])
def test_dp2_with_images_equals_one_process(tmp_path: Path, vision: str) -> None:
    [one] = run_ranks(_train, 1, str(tmp_path / "one"), vision, timeout_s=300)
    ranks = run_ranks(_train, 2, str(tmp_path / "dp2"), vision, timeout_s=300)
    worst = dict.fromkeys(KEYS, 0.0)
    for rows in ranks:
        for a, b in zip(one, rows, strict=True):
            for k in KEYS:
                worst[k] = max(worst[k], abs(a[k] - b[k]) / max(abs(a[k]), 1e-30))
    print(f"\ndp2 with images (vision.train={vision}) vs one process, max relative "
          f"difference: {worst}")  # fmt: skip
    assert len(one) == 2 and all(v <= 1e-5 for v in worst.values()), worst
