"""Training DeepSeek-V4.1's DSpark drafter data parallel on 2 gloo processes equals 1 process (its
global batch as 2 micro-batches): the draft loss and its measures (a mean over the global batch's
target slots, counted before the forward and summed over the ranks), the drafter's gradient norm
and the trained drafter, in both modes (`joint`, `only`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from harness import run_ranks
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

REPO = Path(__file__).resolve().parents[2]
V41 = REPO / "tests" / "fixtures" / "dsv41_dspark_golden" / "checkpoint"
KEYS = ("loss", "grad_norm", "draft_loss", "draft_ce", "draft_kl", "draft_confidence",
        "draft_tau", "draft_grad_norm")  # fmt: skip


def _train(world: int, out: Path, mode: str) -> tuple[list[dict], dict[str, float]]:
    import torch

    from primus_v4.config import load_config, resolve_run
    from primus_v4.training.trainer import Trainer

    torch.set_num_threads(1)
    items = [
        "model.preset=null", f"model.pretrained={V41}", f"data.seq_length={SEQ}",
        f"output.dir={out}", "output.progress_bar=false", "output.plot=false",
        "train.shuffle=false", "train.steps=2", "train.warmup_steps=1",
        "train.global_batch_size=2", f"model.draft.train={mode}", "model.draft.anchor_rate=0.5",
    ]  # fmt: skip
    run = resolve_run(load_config(overrides=items), world=world)
    trainer = Trainer(run, corpus=FakeCorpus(RAGGED_PACKS))
    rows = [vars(r) for r in trainer.train().rows]
    drafter = {n: float(p.detach().double().sum()) for n, p in trainer.model.named_parameters()
               if n.startswith("dspark.")}  # fmt: skip
    return rows, drafter


def _rank(rank: int, world: int, out: str, mode: str) -> tuple[list[dict], dict[str, float]]:
    return _train(world, Path(out) / f"rank{rank}", mode)


@pytest.mark.parametrize("mode", ["joint", "only"])
def test_two_data_parallel_ranks_train_the_drafter_as_one_process(mode: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        single, drafter = _train(1, Path(tmp) / "single", mode)
        ranks = run_ranks(_rank, 2, tmp, mode, timeout_s=240)
    for rows, weights in ranks:
        for row, want in zip(rows, single, strict=True):
            for key in KEYS:
                if want[key] is None:  # only: no grad norm of a part apart
                    assert row[key] is None, key
                    continue
                # float sums over 2 ranks vs 2 micro-batches differ only in addition order
                assert row[key] == pytest.approx(want[key], rel=1e-5), (row["step"], key)
            assert row["draft_accept"] == pytest.approx(want["draft_accept"], abs=1e-12)
        assert weights.keys() == drafter.keys()
        for name, value in weights.items():
            assert value == pytest.approx(drafter[name], rel=1e-4, abs=1e-6), name
