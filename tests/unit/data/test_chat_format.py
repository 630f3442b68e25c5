"""The conversation format follows the model (`data.chat_format`, `pack --chat-format`): V4,
V4-0731 and V4.1 as DeepSeek's deepseek-recipe renders them, reasoning effort as each format
defines it, `auto` from the release or tokenizer, and a format the tokenizer cannot write refused
in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus_v4.cli import main
from primus_v4.config import load_config
from primus_v4.config.resolve import chat_format_of
from primus_v4.data import chat_format
from primus_v4.data.corpus import RawRow
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.shapes import BadRow
from primus_v4.data.templates import render, row_samples
from primus_v4.data.tokenizer import TextTokenizer, load_tokenizer
from primus_v4.errors import DataError

V41_TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "dsv41_tokenizer"
ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add.", "content": "4"},
    ]
}
V4_HIGH = "Reasoning Effort: Absolute maximum with no shortcuts permitted."
V0731_MAX = "Reasoning Effort: Beyond maximum"


def _text(fmt: str, effort: object = None, mode: str = "thinking") -> str:
    row = ROW if effort is None else {**ROW, "reasoning_effort": effort}
    [(text, _)] = row_samples(row, "messages", mode, chat_format.FORMATS[fmt])[1]
    return text


def test_effort_texts_per_format() -> None:
    # V4: none by default; "max" writes the text 0731 calls "high".
    assert "Reasoning Effort" not in _text("v4") + _text("v4", "high")
    assert _text("v4", "max").startswith(f"{chat_format.BOS}{V4_HIGH}")
    # V4-0731: shifted down one level, a new "max".
    assert "Reasoning Effort" not in _text("v4-0731") + _text("v4-0731", "low")
    assert V4_HIGH in _text("v4-0731", "high") and V0731_MAX in _text("v4-0731", "max")
    # V4.1: a number 1-100 after <｜System｜>; low/high/max = 50/75/100, 75 when absent.
    for effort, number in ((None, 75), ("low", 50), ("high", 75), ("max", 100), (33, 33)):
        assert _text("v4.1", effort).startswith(
            f"{chat_format.BOS}<｜System｜>Reasoning Effort: {number} (range 1-100"
        ), effort
    assert "Reasoning Effort" not in _text("v4.1", 33, mode="chat")  # chat mode has none
    for bad in (0, 101, "xhigh", True):
        with pytest.raises(BadRow, match="reasoning_effort"):
            _text("v4.1", bad)
    with pytest.raises(BadRow, match="reasoning_effort 50 is not one of"):
        _text("v4", 50)


def test_v41_with_v4_tokenizer_is_refused_naming_the_token(tokenizer: TextTokenizer) -> None:
    rows = [RawRow(value=ROW, where="t.jsonl:1")]
    with pytest.raises(DataError, match=r"chat format v4\.1 needs the token '<｜System｜>'"):
        render(rows, tokenizer, fmt="messages", where="t", chat_format_name="v4.1")
    v41 = load_tokenizer(V41_TOKENIZER)
    r = render(rows, v41, fmt="messages", where="t", chat_format_name="v4.1")
    assert r.tokens[:2].tolist() == [0, 128799]  # BOS, <｜System｜> as one token


def test_auto_follows_the_release_and_the_tokenizer(
    tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    assert chat_format.detect(V41_TOKENIZER) == "v4.1"
    assert chat_format.detect(tokenizer.dir) == "v4"
    release = tmp_path / "release"
    release.mkdir()
    (release / "tokenizer.json").write_bytes((tokenizer.dir / "tokenizer.json").read_bytes())
    config = {"model_type": "deepseek_v4", "dspark_block_size": 4}
    (release / "config.json").write_text(json.dumps(config))
    assert chat_format.detect(release) == "v4-0731"  # same tokenizer as V4: the config tells
    (release / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    # V4.1's config beside V4's tokenizer (a V4.1 preset run's export): the tokenizer's format
    assert chat_format.detect(release) == "v4"
    exported = load_config(overrides=["model.preset=null", f"model.pretrained={release}"])
    assert chat_format_of(exported) == "v4"
    v41_release = tmp_path / "v41_release"
    v41_release.mkdir()
    (v41_release / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (V41_TOKENIZER / name).is_file():
            (v41_release / name).write_bytes((V41_TOKENIZER / name).read_bytes())
    assert chat_format.detect(v41_release) == "v4.1"
    v41_run = load_config(overrides=["model.preset=null", f"model.pretrained={v41_release}"])
    assert chat_format_of(v41_run) == "v4.1"

    assert chat_format_of(load_config(overrides=[])) == "v4"  # the tiny preset's family
    assert chat_format_of(load_config(overrides=["data.chat_format=v4.1"])) == "v4.1"
    # V4.1's preset: v4.1 with V4.1's tokenizer, v4 on the bundled V4 one (it lacks the tokens)
    v41 = ["model.preset=tiny_v41"]
    assert (
        chat_format_of(load_config(overrides=[*v41, f"data.tokenizer={V41_TOKENIZER}"])) == "v4.1"
    )
    assert chat_format_of(load_config(overrides=v41)) == "v4"
    (release / "config.json").write_text(json.dumps(config))
    pretrained = load_config(overrides=["model.preset=null", f"model.pretrained={release}"])
    assert chat_format_of(pretrained) == "v4-0731"


def test_pack_chat_format_flag(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    stats = tmp_path / "stats.json"
    argv = ["pack", "--data", str(data), "--seq-length", "256", "--no-progress",
            "--tokenizer", str(V41_TOKENIZER), "--cache-dir", str(tmp_path / "c"),
            "--lock-dir", str(tmp_path / "l"), "--stats-json", str(stats)]  # fmt: skip
    assert main(argv) == 0  # auto: V4.1's tokenizer
    assert json.loads(stats.read_text())["chat_format"] == "v4.1"
    assert main([*argv, "--chat-format", "v4-0731"]) == 0
    assert json.loads(stats.read_text())["chat_format"] == "v4-0731"
    spec = PackSpec(data=str(data), seq_length=256, tokenizer=V41_TOKENIZER,
                    cache_dir=tmp_path / "c", lock_dir=tmp_path / "l")  # fmt: skip
    ids, _ = build_or_load(spec).sample_tokens(0)
    assert ids[:2].tolist() == [0, 128799]
