"""A resume never drops a part its checkpoint trained, and never trains one it does not hold:
each training switch's narrower and wider change is refused before any work, naming the part
and the switch (training/checkpoint/trained_parts.py; docs/checkpoints.md, the resume matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest
from threads import one_thread  # noqa: F401 (the fixture)
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ResumeError
from primus_v4.training.checkpoint.trained_parts import check_trained_parts, trained_parts
from primus_v4.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
V41 = REPO / "tests" / "fixtures" / "dsv41_dspark_golden" / "checkpoint"

LORA8 = {"rank": 8, "targets": ["wq_a", "wkv"], "expert_adapters": "per_expert"}

# (switch, saved model section, this run's, the part named, narrower or wider)
MATRIX = [
    ("draft", {"draft": {"train": "joint"}}, {"draft": {"train": "off"}}, "the DSpark drafter"),
    ("draft", {"draft": {"train": "only"}}, {"draft": {"train": "off"}}, "the DSpark drafter"),
    ("draft", {"draft": {"train": "joint"}}, {"draft": {"train": "only"}},
     "the language model's weights"),
    ("draft", {"draft": {"train": "off"}}, {"draft": {"train": "joint"}}, "the DSpark drafter"),
    ("draft", {"draft": {"train": "only"}}, {"draft": {"train": "joint"}},
     "the language model's weights"),
    ("vision", {"vision": {"train": "all"}}, {"vision": {"train": "frozen"}},
     "the image encoder's aligner, the image encoder's tower"),
    ("vision", {"vision": {"train": "all"}}, {"vision": {"train": "aligner"}},
     "the image encoder's tower"),
    ("vision", {"vision": {"train": "aligner"}}, {"vision": {"train": "frozen"}},
     "the image encoder's aligner"),
    ("vision", {"vision": {"train": "frozen"}}, {"vision": {"train": "all"}},
     "the image encoder's aligner, the image encoder's tower"),
    ("vision", {"vision": {"train": "aligner"}}, {"vision": {"train": "all"}},
     "the image encoder's tower"),
    ("lora", {"lora": LORA8}, {"lora": {"rank": 0}}, "the LoRA adapters"),
    ("lora", {"lora": {"rank": 0}}, {"lora": LORA8}, "the LoRA adapters"),
    ("lora", {"lora": LORA8}, {"lora": {**LORA8, "targets": ["wq_a"]}}, "the LoRA adapters"),
    ("lora", {"lora": LORA8}, {"lora": {**LORA8, "rank": 16}}, "the LoRA adapters"),
    ("engram", {"engram": {"trainable": True}}, {"engram": {"trainable": False}},
     "the Engram tables"),
    ("engram", {"engram": {"trainable": False}}, {"engram": {"trainable": True}},
     "the Engram tables"),
]  # fmt: skip


@pytest.mark.parametrize(("switch", "saved", "current", "part"), MATRIX)
def test_each_mode_change_is_refused_naming_the_part_and_switch(
    switch: str, saved: dict, current: dict, part: str
) -> None:
    with pytest.raises(ResumeError) as err:
        check_trained_parts("ckpt/step_00000002", saved, current)
    message = str(err.value)
    assert part in message, message
    assert f"model.{switch}." in message and "->" in message, message
    assert "\n" not in message
    check_trained_parts("ckpt/step_00000002", saved, saved)  # the same switches resume


def test_what_each_mode_trains() -> None:
    assert set(trained_parts({})) == {"the language model's weights"}
    assert set(trained_parts({"draft": {"train": "only"}})) == {"the DSpark drafter"}
    assert set(trained_parts({"lora": LORA8, "vision": {"train": "frozen"}})) == {
        "the LoRA adapters"
    }
    assert len(trained_parts({"vision": {"train": "all"}, "engram": {"trainable": True}})) == 4


def test_a_reordered_target_list_and_other_knobs_are_no_change() -> None:
    saved = {"lora": LORA8, "draft": {"train": "off", "weight": 1.0}}
    current = {"lora": {**LORA8, "targets": ["wkv", "wq_a"], "alpha": 32.0},
               "draft": {"train": "off", "weight": 2.0}}  # fmt: skip
    check_trained_parts("ckpt", saved, current)


def _items(tmp: Path, mode: str) -> list[str]:
    return [
        "model.preset=null", f"model.pretrained={V41}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        "train.steps=2", "train.warmup_steps=1", "train.global_batch_size=1",
        f"model.draft.train={mode}", "model.draft.anchor_rate=0.5",
        f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.interval=1",
    ]  # fmt: skip


def _trainer(tmp: Path, mode: str, corpus: FakeCorpus | None = None) -> Trainer:
    return Trainer(resolve_run(load_config(overrides=_items(tmp, mode)), world=1), corpus=corpus)


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("the corpus was packed or the model built before the refusal")


@pytest.mark.usefixtures("one_thread")
def test_a_drafter_run_resumed_without_it_stops_before_work(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    _trainer(tmp_path, "joint", FakeCorpus(RAGGED_PACKS)).train()
    monkeypatch.setattr("primus_v4.training.trainer.build_corpus", _no_work)
    monkeypatch.setattr("primus_v4.training.trainer.build_model", _no_work)
    for mode, part in (("off", "the DSpark drafter"), ("only", "the language model's weights")):
        with pytest.raises(ResumeError, match=f"it trained {part}.*model.draft.train: 'joint' "
                           f"-> '{mode}'"):  # fmt: skip
            _trainer(tmp_path, mode)
        # the dry run refuses it alike, before packing
        argv = [a for item in _items(tmp_path, mode) for a in ("--set", item)]
        assert main(["train", "--dry-run", *argv]) == ResumeError.exit_code
        assert f"it trained {part}" in capsys.readouterr().err
    assert main(["train", "--dry-run", *[a for i in _items(tmp_path, "joint")
                                         for a in ("--set", i)]]) == 0  # fmt: skip
