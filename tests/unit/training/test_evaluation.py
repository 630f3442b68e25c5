"""Evaluation: the held-out split is disjoint from training and fixed; eval rows carry the token
mean of the whole evaluation corpus (checked against a direct computation), at the interval and
after the last step, in metrics.jsonl, the log line and the summary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_fakes import RAGGED_PACKS, FakeCorpus, FakeLM, tiny_run

from primus_v4.config import load_config, resolve_run
from primus_v4.data import holdout
from primus_v4.errors import ConfigError
from primus_v4.training.metrics.writer import read_metrics
from primus_v4.training.trainer import Trainer

EVAL_PACKS = [[120, 60], [200], [90, 90, 70]]


def test_holdout_split_is_disjoint_complete_and_fixed() -> None:
    rows = list(range(1000))
    train = holdout.select(rows, fraction=0.1, split="train", where="test")
    held = holdout.select(rows, fraction=0.1, split="eval", where="test")
    assert sorted(train + held) == rows and not set(train) & set(held)
    assert 70 < len(held) < 130  # ~10% of 1000 (binomial sd ~9.5)
    assert held == holdout.select(rows, fraction=0.1, split="eval", where="test")
    with pytest.raises(Exception, match=r"leaves no eval rows of the 3 rows"):
        holdout.select(rows[:3], fraction=0.01, split="eval", where="test")


def test_eval_specs_and_rules(tmp_path: Path) -> None:
    run = resolve_run(load_config(overrides=["data.eval_fraction=0.2"]), world=1)
    assert (run.data.split, run.eval_data.split) == ("train", "eval")
    assert run.data.holdout_fraction == run.eval_data.holdout_fraction == 0.2
    own = resolve_run(load_config(overrides=[f"data.eval_path={tmp_path}/e.jsonl"]), world=1)
    assert (own.data.split, own.eval_data.data) == ("all", f"{tmp_path}/e.jsonl")
    assert resolve_run(load_config(), world=1).eval_data is None
    both = ["data.eval_fraction=0.2", "data.eval_path=x.jsonl"]
    with pytest.raises(ConfigError, match=r"either data.eval_path or data.eval_fraction"):
        load_config(overrides=both)
    piped = resolve_run(load_config(overrides=["data.eval_fraction=0.2", "parallel.pp=2"]), world=2)
    assert piped.eval_data is not None  # pipeline parallelism evaluates too


@torch.no_grad()
def _direct_eval(trainer: Trainer, corpus: FakeCorpus) -> tuple[float, float]:
    """Sum of CE over every eval pack / their supervised tokens (and the same for MTP)."""
    loss = tokens = mtp = mtp_tokens = 0.0
    for i in range(len(corpus)):
        out = trainer.model(**trainer.model_inputs(corpus.thd_batch(i)))
        loss += float(out.loss_sum)
        tokens += float(out.num_tokens)
        mtp += float(out.mtp_loss_sums[0])
        mtp_tokens += float(out.mtp_num_tokens[0])
    return loss / tokens, mtp / mtp_tokens


def test_eval_at_interval_and_end_is_the_corpus_token_mean(tmp_path: Path) -> None:
    settings = ("train.steps=5", "train.warmup_steps=1", "train.eval_interval=2")
    eval_corpus = FakeCorpus(EVAL_PACKS, seed=7)
    trainer = Trainer(tiny_run(tmp_path, *settings), corpus=FakeCorpus(RAGGED_PACKS[:4]),
                      model=FakeLM(), eval_corpus=eval_corpus)  # fmt: skip
    result = trainer.train()
    evaluated = [r.step for r in result.rows if r.eval_loss is not None]
    assert evaluated == [2, 4, 5]  # the interval, and after the last step
    loss, mtp = _direct_eval(trainer, eval_corpus)
    last = result.rows[-1]
    # float64 sums of the same float32 per-pack sums in the same order: exact.
    assert (last.eval_loss, last.eval_mtp_loss) == (loss, mtp)
    assert result.summary["eval_loss"] == loss and result.summary["eval_step"] == 5
    assert "eval loss" in last.log_line(5)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["eval_loss"] is not None for r in rows] == [False, True, False, True, True]


def test_held_out_rows_are_packed_apart_from_the_training_rows(tmp_path: Path) -> None:
    from primus_v4.config.resolve import pack_spec
    from primus_v4.data.pipeline import build_or_load

    base = [
        "data.path=synthetic:rows=60",
        "data.seq_length=512",
        f"data.cache_dir={tmp_path / 'packs'}",
        f"data.lock_dir={tmp_path / 'locks'}",
    ]
    cfg = load_config(overrides=[*base, "data.eval_fraction=0.2"])
    train = build_or_load(pack_spec(cfg), progress=False)
    held = build_or_load(pack_spec(cfg, split="eval"), progress=False)
    whole = build_or_load(pack_spec(load_config(overrides=base)), progress=False)
    assert len({train.stats["cache_key"], held.stats["cache_key"], whole.stats["cache_key"]}) == 3
    expected = int(holdout.held_out(60, 0.2).sum())
    assert held.num_samples == expected and train.num_samples == 60 - expected
    assert (
        train.stats["supervised_tokens"] + held.stats["supervised_tokens"]
        == (whole.stats["supervised_tokens"])
    )
