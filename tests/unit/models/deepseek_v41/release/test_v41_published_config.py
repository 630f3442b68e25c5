"""The DeepSeek-V4.1 release's config.json as published loads: the DSpark stages' tail of
`compress_ratios`, `attention_bias`, `vision_config` and `image_token_id` each have a place, the
tiny release with that config gives the official reference's backbone logits, dry runs accept
it, an export writes the same config back, and every variation we do not build is refused in
one line naming it."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from primus_v4.errors import CheckpointFormatError, ConfigError, ExitCode
from primus_v4.models.deepseek_v41.geometry import (
    VISION_SIZE_BOUNDS,
    DeepseekV41Geometry,
    check_vision_sizes,
)
from primus_v4.models.deepseek_v41.release import config_json
from primus_v4.models.deepseek_v41.release.load import load_pretrained

REPO = Path(__file__).resolve().parents[5]
GOLDEN = REPO / "tests" / "fixtures" / "dsv41_dspark_golden"
RELEASE = GOLDEN / "checkpoint"
FLASH = REPO / "primus_v4" / "configs" / "models" / "releases" / "deepseek_v41_flash"
# the official float32 reference against our float32 port: the text golden's tolerance
LOGIT_TOL = 1e-5
FRAGILE_TOL = 0.5  # tokens whose routing / top-k flips under 1e-6 weight noise


def _config(path: Path = RELEASE) -> dict:
    return json.loads((path / "config.json").read_text())


def _keys(d: dict) -> list:
    """Every key path of a config.json, in file order."""
    out = []
    for key, value in d.items():
        out.append(key)
        if isinstance(value, dict):
            out += [f"{key}.{k}" for k in _keys(value)]
    return out


def test_the_fixture_config_is_the_published_one_key_for_key() -> None:
    assert _keys(_config()) == _keys(_config(FLASH))
    text = _config(FLASH)["text_config"]
    assert len(text["compress_ratios"]) == 43 == text["num_hidden_layers"] + 3


def test_the_flash_preset_reads_the_published_file() -> None:
    g = DeepseekV41Geometry.preset("deepseek_v41_flash")
    text = _config(FLASH)["text_config"]
    assert g.num_layers == 40 and g.compress_ratios == text["compress_ratios"][:40]
    assert g.engram_num_embeddings == text["engram_num_embeddings"]
    assert (g.hidden_size, g.num_moe_experts, g.index_topk) == (5120, 384, 512)


@pytest.fixture(scope="module")
def model():
    golden = load_file(GOLDEN / "golden.safetensors")
    return load_pretrained(RELEASE, dtype=torch.float32, token_map=golden["token_map"]), golden


@pytest.mark.parametrize("doc", range(3))
def test_the_published_shape_release_gives_the_reference_backbone_logits(model, doc) -> None:
    model, golden = model
    ids = golden[f"doc{doc}.input_ids"]
    with torch.no_grad():
        logits = model(ids[None], torch.arange(len(ids))[None]).logits[0]
    ref, fragile = golden[f"doc{doc}.logits"], golden[f"doc{doc}.fragile"].bool()
    err = (logits - ref).abs().amax(-1) / ref.abs().max()
    print(f"doc{doc} ({len(ids)} tokens): worst {err[~fragile].max():.2e} of max |logit|")
    assert err[~fragile].max() <= LOGIT_TOL
    assert not fragile.any() or err[fragile].max() <= FRAGILE_TOL


def test_the_load_counts_what_it_leaves_by_part(caplog) -> None:
    logger = logging.getLogger("primus_v4")
    logger.addHandler(caplog.handler)
    caplog.set_level("INFO")
    try:
        load_pretrained(RELEASE, token_map=torch.arange(512) // 2)
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "not part of the text model" in r.message]
    index = json.loads((RELEASE / "model.safetensors.index.json").read_text())["weight_map"]
    stages = [sum(1 for n in index if n.startswith(f"mtp.{k}.") and not n.endswith(".scale"))
              for k in range(3)]  # fmt: skip
    bias_vl = sum(n.startswith("layers.") and n.endswith(".bias_vl") for n in index)  # per layer
    assert len(lines) == 1 and bias_vl == 8
    assert lines[0].endswith(
        f": {sum(stages) + bias_vl} tensors (ffn.gate.bias_vl {bias_vl}, mtp.0 {stages[0]}, "
        f"mtp.1 {stages[1]}, mtp.2 {stages[2]})"
    ), lines[0]


def test_dry_runs_accept_the_published_shape(tmp_path: Path, capsys) -> None:
    from primus_v4.cli import main

    out = tmp_path / "out"
    assert main(["train", "--dry-run", "--set", "model.preset=null", "--set",
                 f"model.pretrained={RELEASE}", "--set", f"output.dir={out}"]) == 0  # fmt: skip
    derived = json.loads(capsys.readouterr().out.splitlines()[0])["derived"]
    assert derived["num_layers"] == 8 and derived["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1]


def test_a_copy_of_the_published_config_alone_plans_a_dry_run(tmp_path: Path, capsys) -> None:
    from primus_v4.cli import main

    release = tmp_path / "flash"
    release.mkdir()
    (release / "config.json").write_text((FLASH / "config.json").read_text())
    out = tmp_path / "o"
    code = main(["train", "--dry-run", "--set", "model.preset=null", "--set",
                 f"model.pretrained={release}", "--set", f"output.dir={out}"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "holds a config.json and no weights" in captured.err
    assert json.loads(captured.out.splitlines()[0])["derived"]["num_layers"] == 40


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
def test_an_export_writes_the_published_config_back(model, tmp_path: Path, dtype) -> None:
    from primus_v4.models.deepseek_v41.release.export import save_pretrained

    save_pretrained(model[0], tmp_path / "out", dtype=dtype)
    back, source = _config(tmp_path / "out"), _config()
    if dtype == "bfloat16":
        assert "quantization_config" not in back
        source.pop("quantization_config")
    assert back == source and _keys(back) == _keys(source)


def _edited(edit) -> dict:
    d = copy.deepcopy(_config())
    edit(d)
    return d


REFUSED = {
    "a non-zero tail entry": (
        lambda d: d["text_config"]["compress_ratios"].__setitem__(9, 2),
        "text_config.compress_ratios[9] = 2: the entries after the 8 backbone layers are the "
        "DSpark draft stages' and must be 0",
    ),
    "a tail of the wrong length": (
        lambda d: d["text_config"]["compress_ratios"].pop(),
        "text_config.compress_ratios has 10 entries; the release lists num_hidden_layers (8) "
        "backbone ratios then one 0 per DSpark draft stage (num_nextn_predict_layers 3): 11 "
        "expected",
    ),
    "attention_bias true": (
        lambda d: d["text_config"].__setitem__("attention_bias", True),
        "text_config.attention_bias = True; DeepSeek-V4.1 is built with False only",
    ),
    "an unknown text key": (
        lambda d: d["text_config"].__setitem__("qk_nope_head_dim", 128),
        "unknown text_config key 'qk_nope_head_dim'",
    ),
    "an unknown top-level key": (
        lambda d: d.__setitem__("audio_config", {}),
        "unknown config.json key 'audio_config'",
    ),
    "no text_config": (
        lambda d: d.pop("text_config"),
        "no text_config: a DeepSeek-V4.1 config.json (model_type deepseek_v41) holds the text "
        "model's keys under text_config",
    ),
    "another quantization block": (
        lambda d: d["quantization_config"].__setitem__("weight_block_size", [128, 128]),
        "quantization_config.weight_block_size = [128, 128]; the DeepSeek-V4.1 release stores "
        "[32, 32]",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_we_do_not_build_is_refused_in_one_line(case: str) -> None:
    edit, message = REFUSED[case]
    with pytest.raises(CheckpointFormatError) as err:
        config_json.fields_from_release(_edited(edit), source="cfg.json")
    text = str(err.value)
    assert "\n" not in text and text.startswith("cfg.json: ") and message in text, text


def test_a_bad_tail_in_a_preset_release_is_a_config_error(tmp_path: Path) -> None:
    bad = _edited(REFUSED["a non-zero tail entry"][0])
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"compress_ratios\[9\] = 2") as err:
        DeepseekV41Geometry.release_fields(tmp_path / "config.json")
    assert "\n" not in str(err.value)


def _dry_run_of(tmp_path: Path, config: dict, capsys) -> tuple[int, str]:
    """(exit code, stderr) of `train --dry-run` on a release holding `config` as its config.json
    alone; the run's output dir is never made."""
    from primus_v4.cli import main

    release = tmp_path / "big"
    release.mkdir()
    (release / "config.json").write_text(json.dumps(config))
    out = tmp_path / "o"
    code = main(["train", "--dry-run", "--set", "model.preset=null", "--set",
                 f"model.pretrained={release}", "--set", f"output.dir={out}"])  # fmt: skip
    assert not out.exists()
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "key,value",
    [("engram_num_embeddings", [10**11, 864]), ("engram_vocab_size", 10**12),
     ("dspark_block_size", 10**6), ("candidate_topk_blocks", 10**9)],
)  # fmt: skip
def test_a_huge_size_in_a_release_is_refused_by_the_dry_run(tmp_path: Path, capsys, key, value):
    """Before anything is packed or allocated (a 1e11-row Engram table would be 6.4 TB)."""
    config = _config()
    config["text_config"][key] = value
    code, err = _dry_run_of(tmp_path, config, capsys)
    assert code != 0 and "\n" not in err, err
    shown = max(value) if isinstance(value, list) else value
    assert f"{key}={shown} is above its bound" in err, err


@pytest.mark.parametrize("key", list(VISION_SIZE_BOUNDS))
def test_a_huge_vision_size_in_a_release_is_refused_by_the_dry_run(
    tmp_path: Path, capsys, key: str
) -> None:
    """vision_config.hidden_size 2**30 passed the dry run; the run then failed (exit 70) at a
    2.5 TB allocation of the image encoder, after packing. On a copy of the published Flash
    config (which a dry run plans: test_a_copy_of_the_published_config_alone_plans_a_dry_run),
    each of the encoder's sizes at 2**30 is one line naming it."""
    config = _config(FLASH)
    config["vision_config"][key] = 2**30
    code, err = _dry_run_of(tmp_path, config, capsys)
    assert code == ExitCode.PRETRAINED and "\n" not in err, err
    bound = VISION_SIZE_BOUNDS[key]
    assert f"model config: vision_config.{key}={2**30} is above its bound {bound} (" in err, err


def test_the_published_vision_sizes_pass_and_each_bound_is_16x_flash() -> None:
    vision = _config(FLASH)["vision_config"]
    assert {k: 16 * vision[k] for k in VISION_SIZE_BOUNDS} == VISION_SIZE_BOUNDS
    g = DeepseekV41Geometry.preset("deepseek_v41_flash")
    assert g.vision_config == vision
    check_vision_sizes(vision)
    check_vision_sizes({**vision, **VISION_SIZE_BOUNDS})  # every size at its bound
