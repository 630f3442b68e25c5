"""The family seam: a release directory is dispatched on its config.json `model_type` to the
family that owns it; a known family we cannot build yet answers with one line; presets and run
configs name their family; the public API loads and saves through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dsv41_model import CHECKPOINT, golden
from release_checkpoint import random_release_tensors, release_config, write_checkpoint

import primus_v4
from primus_v4 import cli
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import CheckpointFormatError, ConfigError, ExitCode
from primus_v4.models import FAMILIES, UNSUPPORTED, presets, release_family, release_spec, spec_of
from primus_v4.models.deepseek_v41.release import load as v41_load

UNSUPPORTED_LINE = "DeepSeek-V5 is not supported by this version"


def _release_dir(tmp: Path, **config) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def test_a_v4_release_is_dispatched_to_deepseek_v4(tmp_path: Path) -> None:
    assert release_family(_release_dir(tmp_path / "a", model_type="deepseek_v4")) == "deepseek_v4"
    assert release_spec(tmp_path / "a" / "config.json").name == "deepseek_v4"
    # the April release's config.json in some copies has no model_type: it is V4's format
    assert release_family(_release_dir(tmp_path / "b", hidden_size=8)) == "deepseek_v4"


def test_a_v41_release_is_dispatched_to_deepseek_v41(monkeypatch: pytest.MonkeyPatch) -> None:
    assert release_family(CHECKPOINT) == "deepseek_v41"
    assert release_spec(CHECKPOINT / "config.json").name == "deepseek_v41"
    # the stub tokenizer's Engram map (id -> id // 2, documented with the golden set)
    monkeypatch.setattr(v41_load, "release_token_map", lambda path, cfg: golden()["token_map"])
    model = primus_v4.load_pretrained(CHECKPOINT, dtype=torch.float32)
    assert model.family == "deepseek_v41" and spec_of(model).name == "deepseek_v41"
    ids = golden()["doc0.input_ids"]
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    ref = golden()["doc0.logits"]
    assert float((logits - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_an_unsupported_model_type_answers_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(UNSUPPORTED, "deepseek_v5", UNSUPPORTED_LINE)
    v5 = _release_dir(tmp_path / "v5", model_type="deepseek_v5", hidden_size=5120)
    with pytest.raises(
        CheckpointFormatError, match=f"model_type 'deepseek_v5': {UNSUPPORTED_LINE}$"
    ):
        primus_v4.load_pretrained(v5)
    with pytest.raises(ConfigError, match=UNSUPPORTED_LINE):
        resolve_run(load_config(overrides=["model.family=deepseek_v5"]), 1)


def test_the_cli_refuses_a_v41_config_it_cannot_read_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v41 = _release_dir(tmp_path / "v41", model_type="deepseek_v41", text_config={"mystery": 1})
    args = ["train", "--dry-run", "--set", f"model.pretrained={v41}", "--set", "model.preset=null",
            "--set", "model.family=null"]  # fmt: skip
    assert cli.main(args) == ExitCode.PRETRAINED
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.endswith("unknown text_config key 'mystery'"), err


def test_an_unknown_model_type_names_the_known_families(tmp_path: Path) -> None:
    other = _release_dir(tmp_path / "x", model_type="llama")
    with pytest.raises(CheckpointFormatError, match=r"'llama' is not a model family .*deepseek_v4"):
        primus_v4.load_pretrained(other)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match=r"config.json: not JSON"):
        release_family(tmp_path / "bad")


def test_presets_and_run_configs_name_their_family() -> None:
    known = presets()
    assert known and set(known.values()) <= set(FAMILIES), known
    cfg = load_config()  # the embedded default run config: the family of its preset
    assert cfg.model.family is None and resolve_run(cfg, 1).model.family == "deepseek_v4"
    v41 = resolve_run(load_config(overrides=["model.preset=tiny_v41"]), 1)
    assert v41.model.family == "deepseek_v41"
    with pytest.raises(ConfigError, match=r"'deepseek_v41' conflicts with model.preset='tiny'"):
        resolve_run(load_config(overrides=["model.family=deepseek_v41"]), 1)
    assert resolve_run(load_config(overrides=["model.family=deepseek_v4"]), 1).model.family == (
        "deepseek_v4"
    )


def test_a_named_family_must_match_the_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second buildable family (registered here) named beside a V4 release is refused."""
    monkeypatch.setitem(FAMILIES, "second", FAMILIES["deepseek_v4"])
    cfg = release_config("a")
    release = write_checkpoint(tmp_path / "r", cfg, random_release_tensors(cfg, seed=0))
    items = [f"model.pretrained={release}", "model.preset=null", "model.family=second"]
    with pytest.raises(ConfigError, match=r"model.family: 'second' conflicts with .*"
                       r"model_type 'deepseek_v4'"):  # fmt: skip
        resolve_run(load_config(overrides=items), 1)


def test_load_and_save_pretrained_round_trip_through_the_seam(tmp_path: Path) -> None:
    cfg = release_config("a")
    release = write_checkpoint(tmp_path / "release", cfg, random_release_tensors(cfg, seed=0))
    model = primus_v4.load_pretrained(release, progress=False)
    assert model.family == "deepseek_v4"
    # bf16 out and back in, twice: the second write is the first's bits (nothing drifts)
    primus_v4.save_pretrained(model, tmp_path / "one", dtype="bfloat16", progress=False)
    once = primus_v4.load_pretrained(tmp_path / "one", progress=False)
    primus_v4.save_pretrained(once, tmp_path / "two", dtype="bfloat16", progress=False)
    twice = primus_v4.load_pretrained(tmp_path / "two", progress=False)
    a, b = once.state_dict(), twice.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    changed = [n for n, v in model.state_dict().items() if not torch.equal(v, a[n])]
    assert changed  # the bf16 export did round float32 weights: the comparison has teeth
