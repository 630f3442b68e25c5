"""`primus-v4 train` with parallel.cp=2 under torchrun (2 gloo processes) logs the same losses,
grad norms and token counts as cp=1: the same packs, split contiguously, with token counts and
gradients summed over CP (cp 2 x dp 2 runs in test_dist_trainer_combos.py, CP2 x EP2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import train_metrics


def _train(out: Path, cache: Path, cp: int, world: int) -> list[dict]:
    return train_metrics(out, cache, world, f"parallel.cp={cp}")


def test_train_cp2_logs_the_same_metrics_as_cp1(tmp_path: Path) -> None:
    one = _train(tmp_path / "cp1", tmp_path, 1, 1)
    _same_metrics(one, _train(tmp_path / "cp2", tmp_path, 2, 2))


def _same_metrics(one: list[dict], two: list[dict]) -> None:
    assert [r["step"] for r in two] == [1, 2, 3] == [r["step"] for r in one]
    for a, b in zip(one, two, strict=True):
        for key in ("total_tokens", "real_tokens", "supervised_tokens"):
            assert a[key] == b[key], key  # counts summed over CP equal the unsplit pack's
        for key in ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr"):
            # float32 model; only summation order (chunk edges, the CP sums) differs.
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
