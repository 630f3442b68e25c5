"""`primus-v4 train` evaluation under torchrun: the held-out loss and MTP loss at cp=2 and at
pp=2 x dp=2 (the DP replicas' sums and the pipeline's last stage at once) equal one rank on the
same weights (a negligible lr keeps the one training step from moving them differently), with the
global token normalization."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import train_metrics

# Synthetic corpus with 8% held out: 5 eval packs of 512 tokens (odd, so at dp=2 one replica
# runs the uncounted padding forward, also through the pipeline), one training step.
EVAL = (
    "data.path=synthetic:rows=200",
    "data.eval_fraction=0.08",
    "train.steps=1",
    "train.warmup_steps=0",
    "train.lr=1e-12",
    "train.min_lr=0",
)


def _eval(tmp: Path, name: str, world: int, *settings: str) -> dict:
    rows = train_metrics(tmp / name, tmp, world, *EVAL, *settings)
    assert len(rows) == 1 and rows[0]["eval_loss"] is not None
    return rows[0]


LAYOUTS = (
    ("cp2", 2, ("parallel.cp=2",)),
    ("pp2dp2", 4, ("parallel.pp=2",)),
)


def test_eval_loss_is_the_same_under_cp_dp_and_pp(tmp_path: Path) -> None:
    one = _eval(tmp_path, "one", 1)
    for name, world, settings in LAYOUTS:
        got = _eval(tmp_path, name, world, *settings)
        for key in ("eval_loss", "eval_mtp_loss"):
            # float32 model; only summation order (the CP / DP / PP sums, chunk edges) differs.
            assert got[key] == pytest.approx(one[key], rel=1e-6), (name, key)
