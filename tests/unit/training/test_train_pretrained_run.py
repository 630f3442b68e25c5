"""`primus-v4 train` with `model.pretrained`, the checks that need no HF oracle: the fp8 export
of the run reloads, resuming the run's own checkpoint reads model.pretrained again (checked
against the first start's record), a preset beside model.pretrained is ignored (refused when of
another family), and where the tokenizer comes from. The comparisons with HF transformers:
test_train_pretrained.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from pretrained_runs import run_command, train_items

from primus_v4 import load_pretrained
from primus_v4.commands import export, train
from primus_v4.config import load_config
from primus_v4.errors import CheckpointFormatError, ConfigError
from primus_v4.training.metrics.writer import read_metrics


def test_fp8_export_of_the_run_reloads(trained: Path) -> None:

    out = trained / "export_fp8"
    args = ("--run", str(trained / "run" / "ckpt"), "--out", str(out), "--dtype", "fp8")
    assert run_command(export, [], (*args, "--no-progress")) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"
    model = load_pretrained(out, dtype=torch.float32, progress=False)
    logits = model(torch.tensor([[5, 900, 77, 12000]])).logits
    assert torch.isfinite(logits).all()


def test_a_resume_reads_the_release_and_needs_it_whole(
    checkpoint: Path, trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint holds the trained weights, not what stays as released: a resume reads
    model.pretrained again, checked against the record of the first start."""
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointFormatError, match=f"model.pretrained={weightless}: "):
        run_command(train, train_items(trained, weightless, steps=2))
    assert [r["step"] for r in read_metrics(trained / "run" / "metrics.jsonl")] == [1]
    with caplog.at_level(logging.INFO, logger="primus_v4"):
        assert run_command(train, train_items(trained, checkpoint, steps=2)) == 0
    assert "gives what the checkpoint does not hold" in caplog.text
    assert "tensor reads match the release this run started from" in caplog.text
    rows = read_metrics(trained / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]


def test_a_preset_beside_pretrained_is_ignored_unless_of_another_family(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from primus_v4.config import resolve_run

    release = json.loads((checkpoint / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="primus_v4"):
        run = resolve_run(load_config(overrides=[f"model.pretrained={checkpoint}"]), world=1)
    assert run.cfg.model.preset == "tiny"  # the shipped default run's
    assert run.model.num_layers == release["num_hidden_layers"]
    ignored = [r.message for r in caplog.records if "ignored" in r.message]
    assert ignored == [f"model.preset 'tiny' ignored: model.pretrained={checkpoint} is the model "
                       f"({run.model.num_layers} layers, its config.json)"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.preset: 'tiny_v41' is a 'deepseek_v41' preset"):
        resolve_run(load_config(overrides=[f"model.pretrained={checkpoint}",
                                           "model.preset=tiny_v41"]), world=1)  # fmt: skip


def test_tokenizer_comes_from_the_checkpoint_unless_data_tokenizer(
    checkpoint: Path, tmp_path: Path
) -> None:
    from primus_v4.config.resolve import tokenizer_of

    with_tok = tmp_path / "with_tok"
    with_tok.mkdir()
    (with_tok / "config.json").write_text((checkpoint / "config.json").read_text())
    base = ["model.preset=null"]
    cfg = load_config(overrides=[*base, f"model.pretrained={checkpoint}"])
    assert tokenizer_of(cfg) is None  # no tokenizer.json there: the default DeepSeek-V4 one
    (with_tok / "tokenizer.json").write_text("{}")
    cfg = load_config(overrides=[*base, f"model.pretrained={with_tok}"])
    assert tokenizer_of(cfg) == str(with_tok)
    cfg = load_config(overrides=[*base, f"model.pretrained={with_tok}", "data.tokenizer=/x"])
    assert tokenizer_of(cfg) == "/x"
