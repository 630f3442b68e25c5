"""`primus-v4 train` evaluation under torchrun: the held-out loss and MTP loss at cp=2 and at
dp=2 equal cp=1 / dp=1 on the same weights (a negligible lr keeps the one training step from
moving them differently), with the global token normalization."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import train_metrics

# Synthetic corpus with 10% held out: a few eval packs of 512 tokens, one training step.
EVAL = (
    "data.path=synthetic:rows=200",
    "data.eval_fraction=0.1",
    "train.steps=1",
    "train.warmup_steps=0",
    "train.lr=1e-12",
    "train.min_lr=0",
)


def _eval(tmp: Path, name: str, world: int, *settings: str) -> dict:
    rows = train_metrics(tmp / name, tmp, world, *EVAL, *settings)
    assert len(rows) == 1 and rows[0]["eval_loss"] is not None
    return rows[0]


def test_eval_loss_is_the_same_under_cp2_and_dp2(tmp_path: Path) -> None:
    one = _eval(tmp_path, "one", 1)
    for name, world, settings in (("cp2", 2, ("parallel.cp=2",)), ("dp2", 2, ())):
        got = _eval(tmp_path, name, world, *settings)
        for key in ("eval_loss", "eval_mtp_loss"):
            # float32 model; only summation order (the CP / DP sums, chunk edges) differs.
            assert got[key] == pytest.approx(one[key], rel=1e-6), (name, key)
