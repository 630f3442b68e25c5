"""Training DeepSeek-V4.1's DSpark drafter with the fine-tune (`model.draft.train: joint`) or alone
on a frozen backbone (`only`): what each mode trains, the draft loss's denominator, the draft
metrics in every place a run reports, and the runs refused before any work.

The release: the golden tiny V4.1 with three DSpark stages (tests/fixtures/dsv41_dspark_golden)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from release_0731 import write_release_0731
from threads import one_thread  # noqa: F401 (the fixture)
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ConfigError
from primus_v4.training.metrics.trackers import scalars
from primus_v4.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
V41 = REPO / "tests" / "fixtures" / "dsv41_dspark_golden" / "checkpoint"
BLOCK = 5  # the golden release's dspark_block_size


def _items(tmp: Path, mode: str, *extra: str, release: Path = V41) -> list[str]:
    return [
        "model.preset=null", f"model.pretrained={release}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        "train.steps=2", "train.warmup_steps=1", "train.global_batch_size=1",
        f"model.draft.train={mode}", "model.draft.anchor_rate=0.5", *extra,
    ]  # fmt: skip


def _trainer(tmp: Path, mode: str, *extra: str) -> Trainer:
    run = resolve_run(load_config(overrides=_items(tmp, mode, *extra)), world=1)
    return Trainer(run, corpus=FakeCorpus(RAGGED_PACKS))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_only_trains_the_drafter_and_checkpoints_only_it(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "only", f"checkpoint.dir={tmp_path / 'ckpt'}",
                       "checkpoint.interval=1")  # fmt: skip
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("dspark.") for n in trained)
    assert all(s.name.startswith("dspark.") for s in trainer.optimizer.slots)
    before = _state(trainer.model)
    trainer.train()
    after = _state(trainer.model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the drafter did not move"
    assert all(k.startswith("dspark.") for k in changed), sorted(changed)[:5]
    meta = torch.distributed.checkpoint.FileSystemReader(
        str(tmp_path / "ckpt" / "step_00000002")
    ).read_metadata()
    model_keys = {k.split(".", 1)[1] for k in meta.state_dict_metadata if k.startswith("model.")}
    assert model_keys and all(k.startswith("dspark.") for k in model_keys), sorted(model_keys)[:5]


def test_joint_draft_gradients_reach_only_the_drafter(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "joint")
    rows = trainer.source.rows(0, dp_rank=0, dp_size=1)
    counts = trainer.token_counts(rows)
    out = trainer.model(**trainer.model_inputs(rows[0]))
    # the denominator counted before the forward is what the forward drafts
    assert counts.draft == out.draft.slots > 0
    trainer.optimizer.zero_grad()
    trainer.optimizer.begin(1)
    out.draft.objective.backward()  # the optimizer's hooks move each gradient into its bucket
    main = trainer.optimizer.main_grad
    moved = {n for n, p in trainer.model.named_parameters()
             if p.requires_grad and bool(main(p).abs().sum() > 0)}  # fmt: skip
    assert {n for n in moved if n.startswith("dspark.stages.2.markov_head")}
    assert all(n.startswith("dspark.") for n in moved), sorted(moved)[:5]


def test_joint_leaves_the_backbone_forward_as_it_is(tmp_path: Path) -> None:
    """The drafter reads the backbone; it changes nothing the backbone computes."""
    plain = _trainer(tmp_path / "off", "off")
    joint = _trainer(tmp_path / "joint", "joint")
    row = plain.source.rows(0, dp_rank=0, dp_size=1)[0]
    a = plain.model(**plain.model_inputs(row))
    b = joint.model(**joint.model_inputs(row))
    assert torch.equal(a.loss_sum, b.loss_sum)
    assert not hasattr(a, "draft") or a.draft is None


def test_draft_metrics_reach_jsonl_log_summary_and_trackers(tmp_path: Path, caplog) -> None:
    caplog.set_level("INFO", logger="primus_v4")
    result = _trainer(tmp_path, "joint").train()
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["draft_loss"] == pytest.approx(
            row["draft_ce"] + row["draft_kl"] + 0.1 * row["draft_confidence"]
        )
        assert len(row["draft_accept"]) == BLOCK
        assert all(0.0 <= a <= 1.0 for a in row["draft_accept"])
        assert 0.0 <= row["draft_tau"] <= BLOCK
    assert "draft_loss_last_1" in result.summary and "draft_tau_first_1" in result.summary
    lines = [r.message for r in caplog.records if r.message.startswith("step 2/2")]
    assert lines and " | draft " in lines[0] and " tau " in lines[0], lines
    flat = scalars(result.rows[-1])
    assert [f"draft_accept_{i}" for i in range(BLOCK)] == [k for k in flat if "accept" in k]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0


def test_a_run_without_a_drafter_in_training_reports_none(tmp_path: Path) -> None:
    result = _trainer(tmp_path, "off").train()
    assert result.rows[-1].draft_loss is None and "draft_loss_last_1" not in result.summary
    assert not any(k.startswith("draft") for k in scalars(result.rows[-1]))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("parallel.pp=2",),
            "model.draft.train=joint runs with data parallelism only for now (parallel.pp=2)",
        ),
        (("parallel.cp=2",), "(parallel.cp=2)"),
        (("parallel.ep=2",), "(parallel.ep=2)"),
        (("data.layout=bshd", "train.micro_batch_size=1"), "needs data.layout=thd"),
        (("model.lora.rank=4",), "a LoRA run carries the drafter as released"),
    ],
)
def test_draft_training_outside_this_step_is_refused_in_one_line(
    tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        items = _items(tmp_path, "joint", "train.global_batch_size=2", *extra)
        resolve_run(load_config(overrides=items), world=2)


def test_0731_drafter_is_carried_not_trained(tmp_path: Path) -> None:
    release = write_release_0731(tmp_path / "0731")[0]
    with pytest.raises(ConfigError) as err:
        resolve_run(load_config(overrides=_items(tmp_path, "only", release=release)), world=1)
    assert "DeepSeek-V4-Flash-0731's DSpark stages" in str(err.value)
    assert "no public reference" in str(err.value)


def test_a_family_without_a_drafter_is_refused(tmp_path: Path) -> None:
    items = [i for i in _items(tmp_path, "joint") if not i.startswith("model.pretrained")]
    with pytest.raises(ConfigError, match="the deepseek_v4 family has no DSpark drafter"):
        resolve_run(load_config(overrides=[*items, "model.preset=tiny"]), world=1)


def test_a_v41_model_without_stages_is_refused(tmp_path: Path) -> None:
    items = [i for i in _items(tmp_path, "joint") if not i.startswith("model.pretrained")]
    with pytest.raises(ConfigError, match="the model has no DSpark draft stages"):
        items += ["model.preset=tiny_v41", "model.overrides.dspark_stages=0"]
        resolve_run(load_config(overrides=items), world=1)


def test_joint_trains_the_backbone_as_plain_sft_does(tmp_path: Path) -> None:
    """The drafter's gradients are clipped on their own norm: the backbone's trajectory (loss,
    grad norm) is plain SFT's bit for bit, and the drafter's norm is logged apart."""
    plain = _trainer(tmp_path / "off", "off", "train.clip_grad=0.5").train().rows
    joint = _trainer(tmp_path / "joint", "joint", "train.clip_grad=0.5").train().rows
    assert [(r.loss, r.grad_norm) for r in joint] == [(r.loss, r.grad_norm) for r in plain]
    assert all(r.draft_grad_norm is not None and r.draft_grad_norm > 0.5 for r in joint)
    assert plain[-1].draft_grad_norm is None


def test_evaluation_reports_the_drafter_on_held_out_packs(tmp_path: Path, caplog) -> None:
    caplog.set_level("INFO", logger="primus_v4")
    run = resolve_run(load_config(overrides=_items(tmp_path, "joint", "train.eval_interval=1")),
                      world=1)  # fmt: skip
    held_out = FakeCorpus([[120, 100], [200]], seed=7)
    trainer = Trainer(run, corpus=FakeCorpus(RAGGED_PACKS), eval_corpus=held_out)
    result = trainer.train()
    for row in result.rows:
        assert row.eval_draft_loss is not None and row.eval_draft_loss > 0
        assert 0.0 <= row.eval_draft_tau <= BLOCK and len(row.eval_draft_accept) == BLOCK
    assert result.rows[0].eval_draft_loss != result.rows[1].eval_draft_loss  # the drafter moved
    assert result.summary["eval_draft_loss"] == result.rows[-1].eval_draft_loss
    lines = [r.message for r in caplog.records if r.message.startswith("step 2/2")]
    assert " | eval loss " in lines[0] and lines[0].split(" | eval loss ")[1].count(" tau ") == 1
