"""Sharded optimizer checkpoints resume into another data-parallel size (DCP resharding).

A float32 run saves at step 2 with dp=2 and resumes at dp=1 (and the reverse): the continued
steps equal the uninterrupted run's at the resuming size. A bf16 run saved at dp=2 hands dp=1
exactly the concatenation of the two ranks' fp32 master and moment chunks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from train_fakes import FakeCorpus, FakeLM, tiny_run

from primus_v4.config import resolve_run
from primus_v4.training.checkpoint.store import LATEST, step_dir
from primus_v4.training.trainer import Trainer

PACKS = [[100, 70, 60], [200, 40], [33, 150, 60], [90, 90, 60], [250], [120, 111], [60], [9, 9]]
KEYS = ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr")


def _trainer(world: int, out: Path, ckpt: Path, *settings: str) -> Trainer:
    run = tiny_run(out, "train.steps=4", "train.global_batch_size=4", "train.warmup_steps=1",
                   f"checkpoint.dir={ckpt}", "checkpoint.interval=2", *settings)  # fmt: skip
    return Trainer(resolve_run(run.cfg, world=world), corpus=FakeCorpus(PACKS), model=FakeLM())


def _rows(world: int, out: Path, ckpt: Path) -> list[tuple[float, ...]]:
    result = _trainer(world, out, ckpt).train()
    return [tuple(getattr(r, k) for k in KEYS) for r in result.rows]


def _rank(rank: int, world: int, out: str, ckpt: str) -> list[tuple[float, ...]]:
    return _rows(world, Path(out) / f"rank{rank}", Path(ckpt))


def _run(world: int, out: Path, ckpt: Path) -> list[tuple[float, ...]]:
    if world == 1:
        return _rows(1, out, ckpt)
    return run_ranks(_rank, world, str(out), str(ckpt), timeout_s=120)[0]


def _keep_only_step2(ckpt: Path, into: Path) -> None:
    into.mkdir(parents=True)
    shutil.copytree(step_dir(ckpt, 2), step_dir(into, 2))
    (into / LATEST).write_text(step_dir(into, 2).name + "\n")


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)], ids=["dp2to1", "dp1to2"])
def test_resume_into_another_dp_size(tmp_path: Path, saved: int, resumed: int) -> None:
    _run(saved, tmp_path / "saved", tmp_path / "saved_ckpt")
    uninterrupted = _run(resumed, tmp_path / "full", tmp_path / "full_ckpt")
    _keep_only_step2(tmp_path / "saved_ckpt", tmp_path / "resumed_ckpt")
    continued = _run(resumed, tmp_path / "resumed", tmp_path / "resumed_ckpt")
    assert len(continued) == 2  # steps 3 and 4
    for got, want in zip(continued, uninterrupted[2:], strict=True):
        # The step-2 state came from the other DP size: float32 sums in another order.
        assert got == pytest.approx(want, rel=1e-6)


def _bf16_trainer(world: int, out: Path) -> Trainer:
    run = tiny_run(out, "train.steps=2", "train.global_batch_size=4", "train.warmup_steps=1",
                   f"checkpoint.dir={out.parent / 'ckpt'}", "model.dtype=bfloat16")  # fmt: skip
    model = FakeLM().to(torch.bfloat16)
    return Trainer(resolve_run(run.cfg, world=world), corpus=FakeCorpus(PACKS), model=model)


def _chunks(trainer: Trainer) -> list[list[torch.Tensor]]:
    """Per parameter: this rank's fp32 master, exp_avg and exp_avg_sq chunks."""
    opt = trainer.optimizer
    return [[s.master.clone(), opt.state[s.master]["exp_avg"].clone(),
             opt.state[s.master]["exp_avg_sq"].clone()] for s in opt.slots]  # fmt: skip


def _bf16_rank(rank: int, world: int, out: str) -> list[list[torch.Tensor]]:
    trainer = _bf16_trainer(world, Path(out) / f"rank{rank}")
    trainer.train()
    return _chunks(trainer)


def test_bf16_masters_and_moments_reshard_exactly(tmp_path: Path) -> None:
    ranks = run_ranks(_bf16_rank, 2, str(tmp_path), timeout_s=120)
    one = _bf16_trainer(1, tmp_path / "one")
    assert one.checkpoints.load_latest(**one._state()) == 2
    for i, tensors in enumerate(_chunks(one)):
        assert tensors[0].dtype == torch.float32
        for j, full in enumerate(tensors):
            # dp=2 rank r held the flat range [r c, (r + 1) c); dp=1 holds all of it.
            assert torch.equal(full, torch.cat([ranks[0][i][j], ranks[1][i][j]])), (i, j)
    for s in one.optimizer.slots:  # and the bf16 weights are the rounded masters
        assert torch.equal(s.param.detach().view(-1), s.master.to(torch.bfloat16))
