"""DeepSeek-V4-Flash-0731 (DESIGN.md section 14): the V4 backbone loads and trains, the DSpark
drafter (`mtp.0-2`) is carried: an export of the fine-tune holds every drafter tensor byte for
byte and a config.json that still declares it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from faults import captured_logs
from pretrained_runs import run_command, train_items
from release_0731 import DSPARK_KEYS, release_0731_config, write_release_0731
from safetensors import safe_open

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.commands import export, train
from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.release.config_json import config_from_release


def _stored_bytes(directory: Path) -> dict[str, bytes]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(str(directory / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                out[name] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8))
    return {n: (d, s, b.numpy().tobytes()) for n, (d, s, b) in out.items()}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return write_release_0731(tmp_path_factory.mktemp("r0731") / "release")


def test_config_keys_understood_and_other_keys_still_refused() -> None:
    config = release_0731_config()
    cfg = config_from_release(config)
    assert cfg.mtp_num_layers == 0 and len(cfg.compress_ratios) == config["num_hidden_layers"]
    assert {k: cfg.dspark[k] for k in DSPARK_KEYS} == DSPARK_KEYS
    with pytest.raises(ConfigError, match=r"keys \['dspark_future_knob'\] are not understood"):
        config_from_release({**config, "dspark_future_knob": 1})
    with pytest.raises(ConfigError, match="mtp_num_layers must stay 0"):
        config_from_release(config, mtp_num_layers=1)


def test_fine_tune_export_carries_the_drafter(release: tuple[Path, dict], tmp_path: Path) -> None:
    directory, drafter = release
    with captured_logs("primus_v4.models.deepseek_v4.release.load") as logs:
        assert run_command(train, train_items(tmp_path, directory, steps=3)) == 0
    told = [m for m in logs if "DSpark drafter" in m]
    assert len(told) == 1 and "MTP loss is off" in told[0]
    out = tmp_path / "export"
    args = ("--run", str(tmp_path / "run" / "ckpt"), "--out", str(out), "--no-progress")
    assert run_command(export, [], args) == 0

    source, exported = _stored_bytes(directory), _stored_bytes(out)
    carried = [n for n in source if n.startswith("mtp.")]
    assert len(carried) == len(drafter) == 3 * (5 + 4 * 3 * 2 + 3)
    assert [n for n in carried if exported.get(n) != source[n]] == []
    config = json.loads((out / "config.json").read_text())
    want = release_0731_config()
    assert {k: config[k] for k in DSPARK_KEYS} == DSPARK_KEYS
    assert config["compress_ratios"] == want["compress_ratios"]  # 4 layers + 3 drafter slots
    assert config["num_nextn_predict_layers"] == 1
    # the backbone was trained: its exported weights moved
    moved = [n for n in source if n.startswith("layers.") and exported[n] != source[n]]
    assert moved
    # the export is a 0731 release again: it loads, and its fp8 export carries the drafter too
    assert (
        load_pretrained(out, dtype=torch.float32, progress=False).cfg.dspark
        == config_from_release(want).dspark
    )
    fp8 = tmp_path / "export_fp8"
    assert run_command(export, [], (*args[:3], str(fp8), "--no-progress", "--dtype", "fp8")) == 0
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"
    exported = _stored_bytes(fp8)
    assert [n for n in carried if exported.get(n) != source[n]] == []


def test_save_pretrained_carries_the_drafter(release: tuple[Path, dict], tmp_path: Path) -> None:
    directory, drafter = release
    model = load_pretrained(directory, dtype=torch.float32, progress=False)
    assert not any(n.startswith("mtp.") for n in model.state_dict())
    save_pretrained(model, tmp_path / "out", progress=False)
    exported = _stored_bytes(tmp_path / "out")
    source = _stored_bytes(directory)
    assert all(exported[n] == source[n] for n in drafter)
