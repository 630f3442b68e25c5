"""Rows with images, for a model with a vision tower (DeepSeek-V4.1): every form users bring is
read, each image becomes its span of image tokens with the release's token types (never a
target), and each bad image is a bad row counted by reason with its file and line, or under
strict the error naming it. The golden documents' token ids and token types are rebuilt from
their prompts and pictures exactly."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from primus_v4.data.corpus import RawRow
from primus_v4.data.image_rows import PLACEHOLDER, RowImages, resolve_images
from primus_v4.data.images import ImageGrid
from primus_v4.data.templates import BAD_REASONS, _expand_images, render
from primus_v4.data.tokenizer import load_tokenizer
from primus_v4.errors import DataError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GOLDEN = FIXTURES / "dsv41_vision_golden"
V41_TOKENIZER = FIXTURES / "dsv41_tokenizer"
IMAGE_TOKEN = 129264  # the V4.1 release's image_token_id
IMG0 = GOLDEN / "images" / "img0.png"  # 56 x 42: a 2 x 2 grid of cells, a span of 8


@pytest.fixture(scope="module")
def grid() -> ImageGrid:
    return ImageGrid.of(json.loads((GOLDEN / "checkpoint" / "config.json").read_text()))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(V41_TOKENIZER)


def _render(rows, tokenizer, grid, base: Path | None = None, **kwargs):
    raw = [RawRow(where=f"rows.jsonl line {i}", value=r) for i, r in enumerate(rows, 1)]
    vision = RowImages(grid=grid, token_id=IMAGE_TOKEN, base=base)
    return render(raw, tokenizer, fmt="auto", where="rows.jsonl", chat_format_name="v4.1",
                  images=vision, **kwargs)  # fmt: skip


def _ask(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)},
                         {"role": "assistant", "content": "A grey box."}]}  # fmt: skip


TEXT = {"type": "text", "text": "What is in the picture?"}


def test_the_golden_documents_token_ids_and_types_are_rebuilt_exactly(grid) -> None:
    """Each golden prompt tokenized with the golden tokenizer, each placeholder expanded into
    its picture's span: the official code's input ids and token types, position for position."""
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    golden = load_file(GOLDEN / "golden.safetensors")
    stub = Tokenizer.from_file(str(GOLDEN / "checkpoint" / "tokenizer.json"))
    token_id = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())["image_token_id"]
    for doc in manifest["docs"]:
        ids = np.asarray(stub.encode(doc["prompt"], add_special_tokens=False).ids, np.uint32)
        pictures = [GOLDEN / image["file"] for image in doc["images"]]
        images = resolve_images([str(p) for p in pictures], None, grid)
        tokens, supervised, types, lengths = _expand_images(
            ids, np.ones(len(ids), bool), np.asarray([len(ids)]), [images], token_id, [0]
        )
        name = f"doc{doc['doc']}"
        assert tokens.tolist() == golden[f"{name}.input_ids"].flatten().tolist(), name
        assert types.tolist() == golden[f"{name}.token_types"].flatten().tolist(), name
        assert lengths.tolist() == [doc["len"]]
        assert not supervised[types >= 0].any() and supervised[types < 0].all()


def test_an_image_part_becomes_its_span_and_the_text_around_it_is_unchanged(
    tokenizer, grid
) -> None:
    r = _render([_ask({"type": "image_url", "image_url": {"url": str(IMG0)}}, TEXT)],
                tokenizer, grid)  # fmt: skip
    at = np.flatnonzero(r.token_types >= 0)
    assert r.token_types[at].tolist() == [0, 1, 1, 2, 1, 1, 2, 3]
    assert (r.tokens[at] == IMAGE_TOKEN).all() and not r.supervised[at].any()
    assert at.tolist() == list(range(at[0], at[0] + 8)), "a span is consecutive"
    # The same conversation as text, the placeholder written out: one image token for the span.
    text = {"messages": [{"role": "user", "content": PLACEHOLDER + TEXT["text"]},
                         {"role": "assistant", "content": "A grey box."}]}  # fmt: skip
    plain = render([RawRow(where="x", value=text)], tokenizer, fmt="auto", where="x",
                   chat_format_name="v4.1")  # fmt: skip
    kept = np.concatenate([r.tokens[: at[0] + 1], r.tokens[at[-1] + 1 :]])
    assert kept.tolist() == plain.tokens.tolist()
    assert r.supervised.sum() == plain.supervised.sum() > 0
    assert r.lengths.tolist() == [len(plain.tokens) + 7]
    assert r.image_counts.tolist() == [1] and r.images[0].span == 8


def test_every_way_to_give_an_image_reads_the_same_picture(tokenizer, grid, tmp_path) -> None:
    from PIL import Image

    data = IMG0.read_bytes()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a b.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = {
        "relative path": {"type": "image", "image": "pics/a b.png"},
        "absolute path": {"type": "image_url", "image_url": str(tmp_path / "pics" / "a b.png")},
        "file URL": {
            "type": "image_url",
            "image_url": {"url": f"file://{tmp_path}/pics/a%20b.png"},
        },
        "data URL": {"type": "image_url", "image_url": {"url": url}},
        "input_image": {"type": "input_image", "image_url": url},
        "hub bytes": {"type": "image", "image": {"bytes": data, "path": "a.png"}},
    }
    rendered = {
        k: _render([_ask(p, TEXT)], tokenizer, grid, base=tmp_path) for k, p in forms.items()
    }
    first = rendered["relative path"]
    assert sum(first.bad_rows.values()) == 0
    for name, r in rendered.items():
        assert r.bad_rows == {}, name
        assert r.tokens.tolist() == first.tokens.tolist(), name
        assert r.images[0].digest == first.images[0].digest, name
    picture = Image.open(IMG0).convert("RGB")  # a hub dataset's decoded Image feature
    hub = _render([_ask({"type": "image", "image": picture}, TEXT)], tokenizer, grid)
    assert hub.tokens.tolist() == first.tokens.tolist()
    assert np.asarray(hub.images[0].read()).tolist() == np.asarray(picture).tolist()


def test_llava_placeholders_with_an_images_column_read_like_content_parts(tokenizer, grid) -> None:
    both = str(IMG0), str(GOLDEN / "images" / "img1.png")
    sharegpt = {"conversations": [
        {"from": "human", "value": "<image>Compare these.<image>"},
        {"from": "gpt", "value": "Both are grey."}], "images": list(both)}  # fmt: skip
    parts = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": both[0]},
                                     {"type": "text", "text": "Compare these."},
                                     {"type": "image", "image": both[1]}]},
        {"role": "assistant", "content": "Both are grey."}]}  # fmt: skip
    a, b = (_render([row], tokenizer, grid) for row in (sharegpt, parts))
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.token_types.tolist() == b.token_types.tolist()
    assert [i.span for i in a.images] == [8, 11] and a.image_counts.tolist() == [2]
    assert (a.token_types >= 0).sum() == 19


def test_each_bad_image_is_a_bad_row_named_by_reason_file_and_line(
    tokenizer, grid, tmp_path
) -> None:
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(IMG0.read_bytes()[:60])
    good = _ask({"type": "image", "image": str(IMG0)}, TEXT)
    rows = [
        good,
        _ask({"type": "image", "image": str(tmp_path / "missing.png")}, TEXT),
        _ask({"type": "image", "image": str(corrupt)}, TEXT),
        _ask({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, TEXT),
        {"messages": [{"role": "user", "content": "<image><image>Two?"},
                      {"role": "assistant", "content": "One."}], "images": [str(IMG0)]},
        {"messages": [{"role": "user", "content": PLACEHOLDER + "no image given"},
                      {"role": "assistant", "content": "?"}]},
        _ask({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, TEXT),
    ]  # fmt: skip
    r = _render(rows, tokenizer, grid)
    assert r.bad_rows == {"image_count": 2, "image_missing": 1, "image_not_local": 1,
                          "image_unreadable": 2}  # fmt: skip
    assert all(reason in BAD_REASONS for reason in r.bad_rows)
    where = {e["where"]: (e["reason"], e["detail"]) for e in r.bad_examples}
    assert where["rows.jsonl line 2"][0] == "image_missing"
    assert "missing.png" in where["rows.jsonl line 2"][1]
    assert where["rows.jsonl line 3"][0] == "image_unreadable"
    assert where["rows.jsonl line 4"] == ("image_not_local", where["rows.jsonl line 4"][1])
    assert "https://example.com/cat.png" in where["rows.jsonl line 4"][1]
    assert (
        "2 <image> placeholders in the conversation but 1 images" in where["rows.jsonl line 5"][1]
    )
    assert r.rows.tolist() == [0] and r.image_counts.tolist() == [1]
    with pytest.raises(DataError, match=r"rows.jsonl line 2: image 1 \(.*missing.png\): no such"):
        _render(rows, tokenizer, grid, strict=True)


def test_without_a_vision_tower_a_row_with_an_image_is_a_bad_row(tokenizer) -> None:
    row = _ask({"type": "image", "image": str(IMG0)}, TEXT)
    r = render([RawRow(where="x", value=row), RawRow(where="y", value={"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})],
        tokenizer, fmt="auto", where="rows", chat_format_name="v4.1")  # fmt: skip
    assert r.bad_rows == {"image": 1} and r.token_types is None and r.images == ()


def test_a_tokenizer_without_the_image_token_is_refused(grid, tmp_path) -> None:
    """A V4.1 tokenizer whose id 129264 is V4's `<｜image2｜>`: the placeholder is several ids."""
    text = (V41_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8")
    assert text.count(PLACEHOLDER) >= 1
    (tmp_path / "tokenizer.json").write_text(text.replace(PLACEHOLDER, "<｜image2｜>"), "utf-8")
    other = load_tokenizer(tmp_path)
    with pytest.raises(DataError, match="not the model's image_token_id 129264"):
        _render([_ask({"type": "image", "image": str(IMG0)}, TEXT)], other, grid)


def test_a_fifo_a_device_and_a_decompression_bomb_are_bad_rows_not_a_hang(
    tokenizer, grid, tmp_path, monkeypatch
) -> None:
    """An image path naming /dev/zero or a FIFO would read forever; a picture of more pixels
    than Pillow's bomb bound raised past the bad-row handling: each is `image_unreadable`."""
    import os

    from PIL import Image

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    rows = [_ask({"type": "image", "image": p}, TEXT) for p in ("/dev/zero", str(fifo))]
    r = _render([*rows, _ask({"type": "image", "image": str(IMG0)}, TEXT)], tokenizer, grid)
    assert r.bad_rows == {"image_unreadable": 2}
    assert all("not a regular file" in e["detail"] for e in r.bad_examples)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # img0's 2352 pixels: over 2x the bound
    with pytest.raises(DataError, match="no usable row"):
        _render([_ask({"type": "image", "image": str(IMG0)}, TEXT)], tokenizer, grid)
    r = _render([_ask({"type": "image", "image": str(IMG0)}, TEXT), {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}],
        tokenizer, grid)  # fmt: skip
    assert r.bad_rows == {"image_unreadable": 1}
    assert "decompression bomb" in r.bad_examples[0]["detail"].lower()


@pytest.mark.parametrize(
    ("mode", "size"),
    [("RGBA", (50, 40)), ("P", (64, 64)), ("L", (30, 90)), ("I;16", (40, 40)),
     ("CMYK", (40, 40)), ("1", (33, 33)), ("RGB", (1, 1)), ("RGB", (4000, 3)),
     ("RGB", (3, 4000)), ("LA", (20, 20)), ("F", (16, 16))],
)  # fmt: skip
def test_any_picture_mode_and_shape_plans_a_span_its_patches_fill(mode, size, grid) -> None:
    """Modes Pillow converts to RGB (alpha dropped, palettes, 16-bit and float grey, CMYK,
    1-bit), a 1 x 1 picture and 4000 x 3 strips, under the golden and the release's settings:
    the span planned from the row equals the span of the patches made later."""
    import io

    from PIL import Image

    from primus_v4.data.images import image_patches

    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="TIFF" if mode in ("CMYK", "F", "I;16") else "PNG")
    for settings in (grid, ImageGrid()):  # ImageGrid(): DeepSeek-V4.1-Flash's own
        [source] = resolve_images([buffer.getvalue()], None, settings)
        patches, (h, w) = image_patches(buffer.getvalue(), settings)
        assert patches.shape == (h * w, 3, 14, 14)
        cells = (-(-h // 3), -(-w // 3))
        assert (source.llm_h, source.llm_w) == cells
        assert source.span == cells[0] * (cells[1] + 1) + 2 <= settings.max_image_tokens
