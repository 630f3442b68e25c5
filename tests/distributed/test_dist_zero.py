"""ZeRO-1 (training.zero) on gloo: the real tiny model, 5 steps, float32.

dp=2 with the optimizer state sharded over the replicas logs the losses and grad norms of one
process, alone and combined with pp=2, cp=2 and cp=2 x ep=2 (experts sharded over expert-DP 2) on
4 processes; and each rank of dp=2 holds about half the optimizer bytes of dp=1 (printed).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "training"))
from train_fakes import SEQ, TEST_VOCAB, FakeCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.training.trainer import Trainer

PACKS = [[100, 70, 60], [200, 40], [33, 150, 60], [90, 90, 60], [250], [120, 111], [60], [9, 9]]
SETTINGS = ("train.steps=5", "train.global_batch_size=4", "train.warmup_steps=1")
KEYS = ("loss", "mtp_loss", "aux_loss", "grad_norm")


def _train(world: int, out: Path, *parallel: str) -> tuple[list[dict], dict[str, int]]:
    base = (f"data.seq_length={SEQ}", f"model.overrides.vocab_size={TEST_VOCAB}",
            f"output.dir={out}", "output.progress_bar=false", "train.shuffle=false")  # fmt: skip
    run = resolve_run(load_config(overrides=[*base, *SETTINGS, *parallel]), world=world)
    trainer = Trainer(run, corpus=FakeCorpus(PACKS))
    try:
        rows = [{k: getattr(r, k) for k in KEYS} for r in trainer.train().rows]
        return rows, trainer.optimizer.state_bytes()
    finally:
        trainer.runtime.close()
        from primus_v4.parallel.groups import destroy_parallel

        destroy_parallel()


def _rank(rank: int, world: int, out: str, parallel: tuple[str, ...]):
    return _train(world, Path(out) / f"rank{rank}", *parallel)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict[str, int]]:
    return _train(1, tmp_path_factory.mktemp("zero1"))


def _opt_bytes(b: dict[str, int]) -> int:
    return b["master_device"] + b["master_host"] + b["moments_device"] + b["moments_host"]


@pytest.mark.parametrize(
    ("world", "parallel"),
    [(2, ()), (4, ("parallel.pp=2",)), (4, ("parallel.cp=2",)),
     (4, ("parallel.cp=2", "parallel.ep=2"))],
    ids=["dp2", "dp2xpp2", "dp2xcp2", "dp2xcp2xep2"],
)  # fmt: skip
def test_sharded_optimizer_matches_one_process(single, world, parallel) -> None:
    one, one_bytes = single
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_rank, world, tmp, parallel, timeout_s=400)
    worst = 0.0
    for rows, _ in ranks:
        for a, b in zip(one, rows, strict=True):
            for key in KEYS:
                worst = max(worst, abs(b[key] - a[key]) / max(abs(a[key]), 1e-30))
    per_rank = [_opt_bytes(b) for _, b in ranks]
    print(f"\n{'x'.join(parallel) or 'dp2'}: max relative deviation {worst:.2e}; optimizer bytes "
          f"per rank {per_rank} vs one process {_opt_bytes(one_bytes)}")  # fmt: skip
    # float32: the same math, only summation order over ranks differs (~1e-7 per step).
    assert worst <= 1e-6
    if world == 2:
        # Chunks are ceil(N / 2): half of the state, plus at most one element per parameter.
        assert all(abs(b / _opt_bytes(one_bytes) - 0.5) < 0.01 for b in per_rank)
