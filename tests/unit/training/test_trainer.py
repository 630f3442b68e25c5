"""Trainer mechanics (artifacts, determinism, NaN policies) on a stand-in model with the
DeepseekV4Model output contract (the real model runs in test_loss_invariance.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_fakes import RAGGED_PACKS, FakeCorpus, FakeLM, fake_trainer, tiny_run

from primus_v4.config import load_config
from primus_v4.errors import ConfigError
from primus_v4.training.metrics.writer import read_metrics
from primus_v4.training.trainer import NonFiniteError, Trainer

METRIC_KEYS = {
    "step", "loss", "mtp_loss", "aux_loss", "grad_norm", "lr", "real_tokens",
    "supervised_tokens", "tokens_per_s", "real_tokens_per_s", "supervised_tokens_per_s",
    "step_seconds", "peak_memory_bytes", "nan",
}  # fmt: skip
STEPS = ("train.steps=4", "train.global_batch_size=2", "train.warmup_steps=2")


def test_run_writes_config_metrics_and_plot_and_is_deterministic(tmp_path: Path) -> None:
    trainer = fake_trainer(tmp_path / "a", *STEPS, "train.shuffle=true")
    first = trainer.train()
    out = tmp_path / "a" / "run"
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0].keys() >= METRIC_KEYS
    assert all(r["nan"] is False and math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (out / "loss.png").stat().st_size > 0
    assert load_config(out / "config.yaml") == trainer.cfg
    second = fake_trainer(tmp_path / "b", *STEPS, "train.shuffle=true").train()
    assert [r.loss for r in first.rows] == [r.loss for r in second.rows]
    assert [r.grad_norm for r in first.rows] == [r.grad_norm for r in second.rows]


def test_token_numbers_per_step(tmp_path: Path) -> None:
    result = fake_trainer(tmp_path, *STEPS).train()
    first = result.rows[0]  # packs 0 and 1 (shuffle off)
    assert first.total_tokens == 2 * 256 and first.real_tokens == 230 + 240
    corpus = FakeCorpus(RAGGED_PACKS[:4])
    assert first.supervised_tokens == sum(corpus.thd_batch(i).num_supervised for i in (0, 1))


def _poison(trainer: Trainer, step: int) -> None:
    """Make the forward passes of optimizer step `step` (2 micro-batches) return a NaN loss."""
    original, calls = trainer.model.forward, [0]

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if 2 * (step - 1) <= calls[0] < 2 * step:
            out.loss_sum = out.loss_sum * float("nan")
        calls[0] += 1
        return out

    trainer.model.forward = forward


def test_nan_error_stops_naming_the_step_after_writing_metrics(tmp_path: Path) -> None:
    trainer = fake_trainer(tmp_path, *STEPS)
    _poison(trainer, step=2)
    with pytest.raises(NonFiniteError, match="step 2: non-finite"):
        trainer.train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["nan"] for r in rows] == [False, True]


def test_nan_skip_counts_and_continues(tmp_path: Path) -> None:
    trainer = fake_trainer(tmp_path, *STEPS, "train.nan_policy=skip")
    _poison(trainer, step=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train()
    assert [r.nan for r in result.rows] == [False, True, False, False]
    assert result.summary["skipped_steps"] == 1 and trainer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(
        not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)
    )


class _IdleParamLM(FakeLM):
    """FakeLM plus a trainable parameter that no loss term ever reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = torch.nn.Parameter(torch.ones(4))


def test_parameter_without_gradient_checkpoints_and_resumes(tmp_path: Path) -> None:
    from train_fakes import tiny_run

    settings = (*STEPS, f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=2")
    first = Trainer(tiny_run(tmp_path, *settings), corpus=FakeCorpus(RAGGED_PACKS[:4]),
                    model=_IdleParamLM())  # fmt: skip
    first.train()
    # A zero gradient leaves the idle parameter where it was (AdamW update 0 / (0 + eps)).
    assert torch.equal(first.model.idle.detach(), torch.ones(4))
    second = Trainer(tiny_run(tmp_path, *settings), corpus=FakeCorpus(RAGGED_PACKS[:4]),
                     model=_IdleParamLM())  # fmt: skip
    second.train()  # loads the step-4 checkpoint, optimizer state of `idle` included
    assert torch.equal(second.model.idle.detach(), torch.ones(4))
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_epochs_set_the_number_of_steps(tmp_path: Path) -> None:
    """train.epochs instead of train.steps: ceil(epochs x packs / global batch) steps."""
    overrides = ("train.steps=null", "train.epochs=1.5", "train.global_batch_size=2")
    trainer = fake_trainer(tmp_path, *overrides, "train.warmup_steps=1")  # 4 packs
    assert trainer.total_steps == 3  # ceil(1.5 x 4 / 2)
    assert [r.step for r in trainer.train().rows] == [1, 2, 3]
    held_out = FakeCorpus([[120, 60]])  # the final evaluation follows the derived step count
    run = tiny_run(tmp_path / "eval", *overrides, "train.warmup_steps=1")
    with_eval = Trainer(
        run, corpus=FakeCorpus(RAGGED_PACKS[:4]), model=FakeLM(), eval_corpus=held_out
    )
    assert with_eval.evaluator.total_steps == 3
    with pytest.raises(ConfigError, match=r"exactly one of train\.steps and train\.epochs"):
        fake_trainer(tmp_path, "train.epochs=2")  # steps still 30 from the config
    with pytest.raises(ConfigError, match=r"warmup_steps=3 exceeds the 2 steps of train\.epochs=1"):
        fake_trainer(tmp_path, "train.steps=null", "train.epochs=1", "train.global_batch_size=2")
