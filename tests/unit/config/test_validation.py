"""Field and cross-field validation, and parallel sizes checked against the world size."""

from __future__ import annotations

import json

import pytest

from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ConfigError


def test_tp_is_rejected_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"parallel.tp.*deliberately absent.*cp.*ep"):
        load_config(overrides=["parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"parallel.etp"):
        load_config(overrides=["parallel.etp=2"])


def test_thd_needs_micro_batch_one_but_bshd_does_not() -> None:
    with pytest.raises(ConfigError, match=r"micro_batch_size: must be 1 with data.layout=thd"):
        load_config(overrides=["train.micro_batch_size=2"])
    cfg = load_config(overrides=["train.micro_batch_size=2", "data.layout=bshd"])
    assert cfg.train.micro_batch_size == 2


@pytest.mark.parametrize(
    ("item", "pattern"),
    [
        ("train.lr=0", "train.lr: must be > 0"),
        ("train.min_lr=1.0", r"train.min_lr: must be in \[0, train.lr"),
        ("train.warmup_steps=99", "train.warmup_steps: 99 exceeds train.steps"),
        ("optim.offload_fraction=1.5", r"optim.offload_fraction: must be in \[0, 1\]"),
        ("train.nan_policy=ignore", r"train.nan_policy: must be one of \['error', 'skip'\]"),
        ("data.seq_length=4", "data.seq_length: must be >= 8"),
        ("parallel.pp_layout='Et|tL'", "has 2 stages but parallel.pp is 1"),
        ("checkpoint.interval=-1", "checkpoint.interval"),
        ("parallel.collective_timeout_s=0", "parallel.collective_timeout_s: must be > 0 seconds"),
    ],
)
def test_field_validation(item: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=[item])


def test_engram_placement_and_training_choices_that_contradict_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"model\.engram\.placement: host holds frozen tables"):
        load_config(overrides=["model.engram.trainable=true", "model.engram.placement=host"])
    with pytest.raises(ConfigError) as lora:
        load_config(overrides=["model.engram.trainable=true", "model.lora.rank=8"])
    assert str(lora.value).endswith(
        "model.engram.trainable: true with model.lora.rank=8: LoRA freezes the base, Engram "
        "tables included; train adapters (model.lora.targets may name engram.wkv) or the tables, "
        "not both"
    )


def test_parallel_sizes_against_world_size() -> None:
    cfg = load_config(overrides=["parallel.cp=2", "parallel.ep=4", "train.global_batch_size=4"])
    run = resolve_run(cfg, world=8)
    assert (run.sizes.dp, run.sizes.expert_dp, run.num_micro_batches) == (4, 2, 1)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by .* = 2 x 2 = 4"):
        resolve_run(load_config(overrides=["parallel.pp=2", "parallel.cp=2"]), world=6)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide dp x cp = 1 x 2 = 2"):
        resolve_run(load_config(overrides=["parallel.cp=2", "parallel.ep=4"]), world=2)
    with pytest.raises(ConfigError, match=r"global_batch_size=2 .* 1 x 8 = 8"):
        resolve_run(load_config(overrides=["train.global_batch_size=2"]), world=8)


def test_world_size_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    gbs2 = ["train.global_batch_size=2"]
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"global_batch_size=2 .* 1 x 3 = 3"):
        resolve_run(load_config(overrides=gbs2))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_run(load_config(overrides=gbs2)).sizes.dp == 2


def test_model_checks() -> None:
    with pytest.raises(ConfigError, match=r"parallel.ep=16 must divide the model's num_moe_exp"):
        resolve_run(load_config(overrides=["parallel.ep=16", "train.global_batch_size=16"]), 16)
    with pytest.raises(ConfigError, match=r"unknown model preset 'huge'"):
        resolve_run(load_config(overrides=["model.preset=huge"]), world=1)
    with pytest.raises(ConfigError, match=r"model.overrides"):
        resolve_run(load_config(overrides=["model.overrides.num_layers=5"]), world=1)
    with pytest.raises(ConfigError, match=r"unknown model config keys"):
        resolve_run(load_config(overrides=["model.overrides.num_layerz=2"]), world=1)


def test_lm_head_rows_reaches_the_model_and_is_checked() -> None:
    from primus_v4.config.resolve import model_config

    assert model_config(load_config()).lm_head_rows == "supervised"
    assert model_config(load_config(overrides=["model.lm_head_rows=all"])).lm_head_rows == "all"
    with pytest.raises(ConfigError, match=r"model.lm_head_rows: must be one of"):
        load_config(overrides=["model.lm_head_rows=every"])
    with pytest.raises(ConfigError, match=r"lm_head_rows must be 'supervised' or 'all'"):
        resolve_run(load_config(overrides=["model.overrides.lm_head_rows=some"]), world=1)


def test_dry_run_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from primus_v4.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--dry-run", "--set", "parallel.cp=1", "--set", "train.steps=3"])
    assert train.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    payload = json.loads(out)
    assert payload["train"]["steps"] == 3 and payload["parallel"]["tp"] == 1
    assert payload["derived"]["packed"] is True and payload["derived"]["num_layers"] == 3


def test_data_sources_chat_mode_and_epochs_in_a_config() -> None:
    from primus_v4.config import dump_yaml, load_config_text

    text = """
data:
  path:
    - {path: a.jsonl, weight: 3}
    - {path: org/set, split: test, subset: en, format: sharegpt}
  chat_mode: thinking
train:
  steps: null
  epochs: 2
"""
    cfg = load_config_text(text)
    spec = resolve_run(cfg, world=1).data
    assert spec.chat_mode == "thinking" and spec.seed == cfg.train.seed
    assert [(s.path, s.weight, s.split, s.subset, s.format) for s in spec.sources()] == [
        ("a.jsonl", 3, None, None, None),
        ("org/set", 1.0, "test", "en", "sharegpt"),
    ]
    assert cfg.train.epochs == 2.0 and load_config_text(dump_yaml(cfg)) == cfg
    with pytest.raises(ConfigError, match=r"data.path: .*unknown keys \['wieght'\]"):
        load_config(overrides=["data.path=[{path: a.jsonl, wieght: 2}]"])
    with pytest.raises(ConfigError, match=r"data.chat_mode: must be one of"):
        load_config(overrides=["data.chat_mode=reasoning"])
    with pytest.raises(ConfigError, match=r"exactly one of train.steps and train.epochs"):
        load_config(overrides=["train.steps=null"])
