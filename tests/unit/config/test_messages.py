"""Config errors a user can act on: a YAML error names the file (not "<unicode string>"), a
shipped config is named as such (not by a path in site-packages), a warmup the user did not choose
fits the steps they asked for, and every bad model override is one ConfigError naming the key,
in --dry-run too (no ZeroDivisionError, math domain error or optimizer failure later)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ConfigError


def test_a_yaml_error_names_the_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "run.yaml"
    bad.write_text("train:\n  steps: [1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    message = str(err.value)
    assert message.startswith(f"{bad}:3:1: not valid YAML: expected ',' or ']'")
    assert "<unicode string>" not in message and len(message.splitlines()) == 1
    with pytest.raises(ConfigError, match=r"^--set 'train.steps=\[1' \(value\):1:3: not valid"):
        load_config(overrides=["train.steps=[1"])


def test_steps_alone_fit_the_shipped_warmup(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("primus_v4")
    logger.addHandler(caplog.handler)
    try:
        cfg = load_config(overrides=["train.steps=2"])
    finally:
        logger.removeHandler(caplog.handler)
    assert (cfg.train.steps, cfg.train.warmup_steps) == (2, 2)
    assert "train.warmup_steps=3 (shipped config tiny_cpu_thd:" in caplog.text
    assert "site-packages" not in caplog.text and "configs/runs" not in caplog.text
    # a warmup the user chose is theirs: too long is still an error, naming where they set it
    with pytest.raises(ConfigError, match=r"--set train.warmup_steps=3: train.warmup_steps: 3 "):
        load_config(overrides=["train.steps=2", "train.warmup_steps=3"])


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("num_layers=0", "num_layers: must be an integer >= 1 (a model size), got 0"),
        ("num_layers=-1", "num_layers: must be an integer >= 1 (a model size), got -1"),
        ("num_layers=abc", "num_layers: must be an integer >= 1 (a model size), got 'abc'"),
        ("hidden_size=0", "hidden_size: must be an integer >= 1 (a model size), got 0"),
        ("num_attention_heads=0", "num_attention_heads: must be an integer >= 1"),
        ("mtp_num_layers=-1", "mtp_num_layers: must be an integer >= 0"),
        ("attn_sink=3", "attn_sink: expected bool like the model's True, got int 3"),
        ("rotary_base=fast", "rotary_base: expected float like the model's 10000.0, got str"),
    ],
)
def test_a_bad_model_override_is_one_config_error(item: str, words: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(f"model.overrides.{words}")):
        resolve_run(load_config(overrides=[f"model.overrides.{item}"]), world=1)


def test_an_override_of_the_right_type_still_builds() -> None:
    run = resolve_run(load_config(overrides=["model.overrides.rotary_base=20000"]), world=1)
    assert run.model.rotary_base == 20000
