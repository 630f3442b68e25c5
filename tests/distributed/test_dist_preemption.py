"""Preemption on 2 gloo ranks: a signal that reaches only rank 1 stops both ranks after the same
step (an agreed MAX over the ranks' flags), with one checkpoint of that step."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "training"))
from test_run_checkpoints import _trainer

from primus_v4.training.checkpoint import integrity


def _rank(rank: int, world: int, tmp: str) -> tuple[int | None, list[int]]:
    settings = ("train.steps=6", f"checkpoint.dir={tmp}/ck")
    trainer = _trainer(Path(tmp) / f"rank{rank}", *settings, world=world)
    step = trainer.train_step

    def signalled_step(i: int):
        if rank == 1 and i == 2:  # during step 3, on rank 1 only
            os.kill(os.getpid(), signal.SIGTERM)
        return step(i)

    trainer.train_step = signalled_step  # type: ignore[method-assign]
    result = trainer.train()
    return result.stopped_at, [r.step for r in result.rows]


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_rank, 2, tmp, timeout_s=120)
        assert ranks == [(3, [1, 2, 3]), (3, [1, 2, 3])]
        kept = [p.name for p in integrity.complete_checkpoints(Path(tmp) / "ck")]
        assert kept[-1] == "step_00000003" and "step_00000004" not in kept
        assert integrity.verify(Path(tmp) / "ck" / "step_00000003") == []
