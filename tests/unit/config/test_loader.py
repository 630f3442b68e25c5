"""Strict loader: unknown keys and bad types are errors naming key and file; --set and ${ENV}
resolve typed by their fields; the resolved config round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from primus_v4.config import (
    DEFAULT_CONFIG,
    RunConfig,
    dump_yaml,
    load_config,
    load_config_text,
    to_dict,
    write_resolved,
)
from primus_v4.errors import ConfigError

REQUIRED_KEYS = [
    "train.steps", "train.seed", "train.global_batch_size", "train.micro_batch_size", "train.lr",
    "data.path", "data.format", "data.seq_length", "data.layout", "model.preset", "parallel.tp",
    "parallel.pp", "parallel.cp", "parallel.ep", "output.dir", "parallel.etp",
    "parallel.pp_layout", "optim.offload_fraction", "checkpoint.dir", "checkpoint.interval",
    "checkpoint.resume", "model.overrides", "model.dtype", "model.fused_linear_ce",
    "model.lm_head_rows",
    "train.warmup_steps", "train.min_lr", "train.weight_decay", "train.clip_grad",
    "train.nan_policy", "data.algorithm", "data.overlong", "data.tokenizer", "data.cache_dir",
    "data.lock_dir",
]  # fmt: skip


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_every_contract_key_exists_in_the_embedded_default() -> None:
    tree = to_dict(load_config())
    for dotted in REQUIRED_KEYS:
        section, key = dotted.split(".")
        assert key in tree[section], dotted
    assert tree["checkpoint"]["resume"] is True
    assert tree["data"]["layout"] == "thd" and tree["model"]["preset"] == "tiny"


def test_unknown_key_is_an_error_naming_key_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "train:\n  steps: 3\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "train.learning_rate" in msg and f"{path}:3" in msg


def test_unknown_section_and_close_match_hint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown section 'trian'.*'train'"):
        load_config(_write(tmp_path, "trian:\n  steps: 3\n"))
    with pytest.raises(ConfigError, match=r"--set data.seq_len=5.*did you mean 'seq_length'"):
        load_config(overrides=["data.seq_len=5"])


def test_wrong_type_names_key_and_location(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run.yaml:2: train.steps: expected int"):
        load_config(_write(tmp_path, "train:\n  steps: many\n"))
    with pytest.raises(ConfigError, match=r"data.layout: must be one of \['thd', 'bshd'\]"):
        load_config(overrides=["data.layout=padded"])
    with pytest.raises(ConfigError, match=r"train.global_batch_size: expected int, got bool"):
        load_config(overrides=["train.global_batch_size=true"])
    with pytest.raises(ConfigError, match=r"train.steps: expected int \| None, got True"):
        load_config(overrides=["train.steps=true"])


def test_set_overrides_are_yaml_typed() -> None:
    cfg = load_config(
        overrides=[
            "train.steps=5",
            "train.lr=1e-3",
            "data.cache_dir=/tmp/c",
            "model.overrides.num_layers=2",
            "model.overrides.compress_ratios=[0, 4]",
            "checkpoint.resume=false",
        ]
    )
    assert cfg.train.steps == 5 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.model.overrides == {"num_layers": 2, "compress_ratios": [0, 4]}
    assert cfg.checkpoint.resume is False and cfg.data.cache_dir == "/tmp/c"


def test_bad_set_syntax() -> None:
    with pytest.raises(ConfigError, match=r"expected section.key=value"):
        load_config(overrides=["train.steps"])
    with pytest.raises(ConfigError, match=r"train.steps is a value, not a section"):
        load_config(overrides=["train.steps.x=1"])


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = "train:\n  steps: ${STEPS:7}\n  lr: ${LR}\noutput:\n  dir: ${ROOT:/x}/run-${TAG:a}\n"
    monkeypatch.setenv("LR", "0.01")
    cfg = load_config(_write(tmp_path, text))
    assert cfg.train.steps == 7 and cfg.train.lr == pytest.approx(0.01)
    assert cfg.output.dir == "/x/run-a"
    monkeypatch.setenv("STEPS", "9")
    monkeypatch.setenv("TAG", "b")
    cfg = load_config(_write(tmp_path, text))
    assert cfg.train.steps == 9 and cfg.output.dir == "/x/run-b"
    monkeypatch.delenv("LR")
    with pytest.raises(ConfigError, match=r"run.yaml:3: train.lr: environment variable LR"):
        load_config(_write(tmp_path, text))


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=["train.steps=11", "model.overrides.num_layers=2",
                   "model.overrides.compress_ratios=[0, 128]", "parallel.pp_layout=null"]
    )  # fmt: skip
    path = write_resolved(cfg, tmp_path)
    assert path == tmp_path / "config.yaml"
    again = load_config(path)
    assert again == cfg and isinstance(again, RunConfig)
    assert load_config_text(dump_yaml(again)) == cfg
    assert yaml.safe_load(path.read_text()) == to_dict(cfg)


def test_empty_file_gives_the_schema_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "")) == RunConfig()


def test_default_config_is_the_embedded_file() -> None:
    assert DEFAULT_CONFIG.name == "tiny_cpu_thd.yaml" and DEFAULT_CONFIG.is_file()
    assert load_config() == load_config(DEFAULT_CONFIG)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config("/nonexistent/run.yaml")


@pytest.mark.parametrize(
    ("item", "key"),
    [
        ("train.lr=inf", "train.lr"),
        ("train.lr=.nan", "train.lr"),
        ("optim.eps=-.inf", "optim.eps"),
        ("data.lock_timeout_s=.inf", "data.lock_timeout_s"),
        ("model.overrides.init_method_std=.nan", "model.overrides.init_method_std"),
    ],
)
def test_non_finite_floats_are_rejected_with_the_key(item: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"--set {item}: {key}: must be a finite number"):
        load_config(overrides=[item])


def test_config_by_shipped_name_or_by_path(tmp_path: Path) -> None:
    from primus_v4.config.loader import bundled_run_configs

    assert {"tiny_cpu_thd", "tiny_cpu_bshd"} <= set(bundled_run_configs())
    bshd = load_config("tiny_cpu_bshd")
    assert bshd.data.layout == "bshd"
    # The repository spelling of a shipped config keeps working from any directory.
    assert load_config("configs/runs/tiny_cpu_bshd.yaml") == bshd
    own = _write(tmp_path, "train:\n  steps: 7\n")
    assert load_config(own).train.steps == 7
    with pytest.raises(ConfigError, match=r"no_such_run.yaml does not exist.*tiny_cpu_thd"):
        load_config("no_such_run.yaml")


def test_string_fields_take_set_and_env_values_literally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ' #' starts a YAML comment and ': ' a mapping; neither may cut a path short.
    sets = ["data.path=rc/run #2/c.json", "output.dir=out: a", "checkpoint.dir=ck #1",
            "train.steps=5", "checkpoint.resume=false", "model.preset=null",
            "model.lora.targets=[wq_a]", "output.progress_bar='no'"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"output.progress_bar: expected bool, got str 'no'"):
        load_config(overrides=sets)
    cfg = load_config(overrides=sets[:-1])
    assert (cfg.data.path, cfg.output.dir, cfg.checkpoint.dir) == (
        "rc/run #2/c.json", "out: a", "ck #1")  # fmt: skip
    assert cfg.train.steps == 5 and cfg.checkpoint.resume is False and cfg.model.preset is None
    assert cfg.model.lora.targets == ["wq_a"]
    monkeypatch.setenv("CORPUS", "rc/run #2/c.json")
    monkeypatch.setenv("STEPS", "7")
    text = "data:\n  path: ${CORPUS}\ntrain:\n  steps: ${STEPS}\n"
    cfg = load_config(_write(tmp_path, text))
    assert cfg.data.path == "rc/run #2/c.json" and cfg.train.steps == 7
