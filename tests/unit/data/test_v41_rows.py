"""A DeepSeek-V4.1 run's corpus: conversations render in the V4.1 format through the trainer's
pack path (`data.chat_format: auto` follows the model), and for a model without a vision tower
rows with images are refused, named by file and line, and counted as bad rows (or stop a
`data.strict` pack in one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus_v4.config import load_config
from primus_v4.config.resolve import pack_spec
from primus_v4.data.corpus import RawRow
from primus_v4.data.pipeline import build_or_load
from primus_v4.data.shapes import BadRow, check_no_images
from primus_v4.data.templates import BAD_REASONS, render
from primus_v4.data.tokenizer import load_tokenizer
from primus_v4.errors import DataError

V41_TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "dsv41_tokenizer"
TEXT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
PICTURE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
ASK = {"role": "user", "content": [{"type": "text", "text": "What is it?"}, PICTURE]}
SHOWN = {"from": "human", "value": [{"type": "image", "image": "cat.png"}]}
IMAGE_ROWS = [
    {"messages": [ASK, {"role": "assistant", "content": "A cat."}]},
    {**TEXT, "images": ["cat.png"]},
    {"conversations": [SHOWN, {"from": "gpt", "value": "A cat."}]},
]


def _run(tmp: Path, rows: list[dict], *settings: str):
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(overrides=[
        "model.preset=tiny_v41", f"data.path={data}", f"data.tokenizer={V41_TOKENIZER}",
        "data.seq_length=256", f"data.cache_dir={tmp / 'c'}", f"data.lock_dir={tmp / 'l'}",
        *settings,
    ])  # fmt: skip


def test_a_v41_run_packs_conversations_in_the_v41_format(tmp_path: Path) -> None:
    spec = pack_spec(_run(tmp_path, [TEXT]))
    assert spec.chat_format == "v4.1"  # auto: the preset's family
    ids, _ = build_or_load(spec).sample_tokens(0)
    assert ids[:2].tolist() == [0, 128799]  # BOS, <｜System｜>: V4.1's system turn


@pytest.mark.parametrize("row", IMAGE_ROWS, ids=["image_url part", "images field", "sharegpt"])
def test_a_row_with_an_image_is_refused(row: dict) -> None:
    with pytest.raises(BadRow, match="this model has no vision tower") as exc:
        check_no_images(row)
    assert exc.value.reason == "image"


def test_image_rows_are_counted_and_named_by_file_and_line(tmp_path: Path) -> None:
    rows = [TEXT, *IMAGE_ROWS, TEXT]
    corpus = build_or_load(pack_spec(_run(tmp_path, rows)))
    assert corpus.stats["bad_rows"] == {"image": 3}
    lines = [e["where"].rsplit(" ", 1)[-1] for e in corpus.stats["bad_row_examples"]]
    assert lines == ["2", "3", "4"]
    assert corpus.stats["num_samples"] == 2
    assert "image" in BAD_REASONS


def test_a_strict_pack_stops_at_the_first_image_row_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        build_or_load(pack_spec(_run(tmp_path, [TEXT, IMAGE_ROWS[1]], "data.strict=true")))
    message = str(exc.value)
    assert "\n" not in message
    assert "rows.jsonl line 2: an image (field 'images')" in message


def test_render_refuses_an_image_row_in_every_chat_format() -> None:
    tok = load_tokenizer(V41_TOKENIZER)
    rows = [RawRow(where="t.jsonl line 1", value=IMAGE_ROWS[0]), RawRow(where="t.jsonl line 2",
                                                                        value=TEXT)]  # fmt: skip
    for fmt in ("v4", "v4.1"):
        r = render(rows, tok, fmt="auto", where="t", chat_format_name=fmt)
        assert r.bad_rows == {"image": 1}
        assert r.bad_examples[0]["where"] == "t.jsonl line 1"
