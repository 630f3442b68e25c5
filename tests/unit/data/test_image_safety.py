"""Pictures in a corpus are data only: a file is read by Pillow's PNG, JPEG, WebP, GIF, BMP or
TIFF reader alone, so an EPS picture is a bad row (`image_format`) and Ghostscript never starts;
a picture of more than 8 bits per channel is converted as DeepSeek's processor converts it,
counted in the pack's stats with a warning naming it, and refused under strict; the image
settings of a release are bounded, a value out of bounds refused naming its field."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from primus_v4.data.corpus import RawRow
from primus_v4.data.image_rows import RowImages
from primus_v4.data.images import (
    GRID_BOUNDS,
    READ_FORMATS,
    ImageFormatError,
    ImageGrid,
    read_picture,
)
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.data.stats_table import summary_table
from primus_v4.data.templates import BAD_REASONS, render
from primus_v4.data.tokenizer import load_tokenizer
from primus_v4.errors import ConfigError, DataError, ExitCode

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GOLDEN = FIXTURES / "dsv41_vision_golden"
RELEASE = Path(__file__).resolve().parents[3] / "primus_v4/configs/models/releases"
IMG0 = GOLDEN / "images" / "img0.png"
IMAGE_TOKEN = 129264
# A minimal Encapsulated PostScript file: Pillow's EPS reader opens it and renders it with gs.
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 2 2\n%%EndComments\nshowpage\n%%EOF\n"
ALLOWED = "PNG, JPEG, WebP, GIF, BMP and TIFF"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(FIXTURES / "dsv41_tokenizer")


@pytest.fixture(scope="module")
def grid() -> ImageGrid:
    return ImageGrid.of(json.loads((GOLDEN / "checkpoint" / "config.json").read_text()))


def _release(tmp_path: Path, **vision: Any) -> Path:
    """The V4.1 tokenizer beside the golden config.json, its vision_config updated by `vision`."""
    config = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    config.update(image_token_id=IMAGE_TOKEN, vision_config={**config["vision_config"], **vision})
    out = tmp_path / "release"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(FIXTURES / "dsv41_tokenizer" / "tokenizer.json", out)
    return out


def _ask(image) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "What is it?"}]},
                         {"role": "assistant", "content": "A grey box."}]}  # fmt: skip


def _render(rows, tokenizer, grid, **kwargs):
    raw = [RawRow(where=f"rows.jsonl line {i}", value=r) for i, r in enumerate(rows, 1)]
    vision = RowImages(grid=grid, token_id=IMAGE_TOKEN)
    return render(raw, tokenizer, fmt="auto", where="rows.jsonl", chat_format_name="v4.1",
                  images=vision, **kwargs)  # fmt: skip


def _fake_ghostscript(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `gs` first on PATH that leaves a marker file when started; Pillow looks for it again."""
    from PIL import EpsImagePlugin

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "gs-started"
    gs = bin_dir / "gs"
    gs.write_text(f'#!/bin/sh\necho "$@" >> "{marker}"\nexit 1\n')
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    return marker


def _spy_other_readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every Pillow reader outside READ_FORMATS, wrapped to record that it was consulted."""
    from PIL import Image

    Image.init()
    consulted: list[str] = []
    for fmt, (factory, accept) in list(Image.OPEN.items()):
        if fmt in READ_FORMATS:
            continue

        def spy(prefix, fmt=fmt, accept=accept):
            consulted.append(fmt)
            return accept(prefix) if accept else True

        monkeypatch.setitem(Image.OPEN, fmt, (factory, spy))
    return consulted


def test_an_eps_picture_is_a_bad_row_and_ghostscript_never_starts(
    tokenizer, grid, tmp_path, monkeypatch
) -> None:
    """An EPS file (a path or a data URL), a PDF, and a decoded EPS picture not yet rendered:
    each a bad row `image_format` naming the formats read; no reader but those is consulted
    and the `gs` on PATH never starts. Without the allow-list Pillow starts it."""
    from PIL import Image

    marker = _fake_ghostscript(tmp_path, monkeypatch)
    eps = tmp_path / "figure.eps"
    eps.write_bytes(EPS)
    lazy = Image.open(eps)  # Pillow's EPS reader, as a hub dataset may hand it over
    assert lazy.format == "EPS"
    consulted = _spy_other_readers(monkeypatch)
    data_url = "data:image/png;base64," + base64.b64encode(EPS).decode()
    pdf_url = "data:image/png;base64," + base64.b64encode(b"%PDF-1.4\n%%EOF\n").decode()
    rows = [_ask(str(eps)), _ask(data_url), _ask(pdf_url), _ask(lazy), _ask(str(IMG0))]
    r = _render(rows, tokenizer, grid)
    assert r.bad_rows == {"image_format": 4} and "image_format" in BAD_REASONS
    details = {e["where"]: e["detail"] for e in r.bad_examples}
    assert all(e["reason"] == "image_format" for e in r.bad_examples)
    assert "figure.eps" in details["rows.jsonl line 1"]
    for line, fmt in ((1, "PostScript/EPS"), (2, "PostScript/EPS"), (3, "PDF"), (4, "EPS")):
        assert (
            f"{fmt}, a format not read (only {ALLOWED} pictures are read)"
            in details[f"rows.jsonl line {line}"]
        )
    assert r.rows.tolist() == [4]
    with pytest.raises(DataError, match=r"rows.jsonl line 1: image 1 \(.*figure.eps\).*EPS"):
        _render(rows, tokenizer, grid, strict=True)
    with pytest.raises(ImageFormatError, match="PostScript/EPS, a format not read"):
        read_picture(eps)
    assert consulted == [] and not marker.exists(), "a reader outside READ_FORMATS ran"
    # the trap works: Pillow with every reader starts the gs on PATH
    with Image.open(eps) as opened, pytest.raises((OSError, subprocess.CalledProcessError)):
        opened.load()
    assert marker.exists() and consulted[-1] == "EPS"  # readers registered before it, then EPS


@pytest.mark.parametrize("fmt", READ_FORMATS)
def test_each_format_read_gives_its_picture(fmt) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    picture = Image.new("RGB" if fmt != "GIF" else "P", (5, 3), color=7)
    picture.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    rgb, bits = read_picture(buffer.getvalue())
    assert (rgb.mode, rgb.size, bits) == ("RGB", (5, 3), 8)


def _png(width: int, height: int, depth: int, color: int, pixel: bytes) -> bytes:
    """A PNG of one colour written by hand (Pillow writes no 48-bit RGB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    head = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    rows = (b"\x00" + pixel * width) * height
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))  # fmt: skip


def _deep_png() -> bytes:
    """A 16-bit grey PNG (Pillow's mode I;16) of values around a third of its range."""
    from PIL import Image

    buffer = io.BytesIO()
    values = np.arange(20000, 20000 + 56 * 42, dtype=np.uint16).reshape(42, 56)
    Image.fromarray(values).save(buffer, format="PNG")
    return buffer.getvalue()


def _saved(mode: str, values: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(values).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


DEPTHS = [
    ("16-bit grey PNG", _deep_png, 16),
    ("48-bit RGB PNG", lambda: _png(3, 2, 16, 2, b"\x12\x34" * 3), 16),
    ("64-bit RGBA PNG", lambda: _png(3, 2, 16, 6, b"\x12\x34" * 4), 16),
    ("16-bit grey TIFF", lambda: _saved("I;16", np.full((2, 3), 999, np.uint16), "TIFF"), 16),
    ("float TIFF", lambda: _saved("F", np.full((2, 3), 0.5, np.float32), "TIFF"), 32),
    ("8-bit RGB PNG", lambda: _png(3, 2, 8, 2, b"\x12\x34\x56"), 8),
    ("8-bit grey TIFF", lambda: _saved("L", np.full((2, 3), 9, np.uint8), "TIFF"), 8),
]


@pytest.mark.parametrize(("name", "make", "bits"), DEPTHS, ids=[d[0] for d in DEPTHS])
def test_the_bits_per_channel_of_a_picture_are_those_stored(name, make, bits) -> None:
    from PIL import Image

    data = make()
    rgb, got = read_picture(data)
    assert got == bits, name
    with Image.open(io.BytesIO(data)) as opened:  # DeepSeek's processor: Image.open().convert
        assert rgb.tobytes() == opened.convert("RGB").tobytes(), name


def test_a_16_bit_picture_is_counted_warned_about_and_refused_under_strict(
    tmp_path, caplog
) -> None:
    from PIL import Image

    release = _release(tmp_path)
    pics = tmp_path / "corpus"
    pics.mkdir()
    (pics / "deep.png").write_bytes(_deep_png())
    shutil.copy(IMG0, pics / "img0.png")
    assert np.asarray(Image.open(pics / "deep.png").convert("RGB")).min() == 255  # clipped
    data = pics / "rows.jsonl"
    data.write_text("".join(json.dumps(_ask(p)) + "\n" for p in ("deep.png", "img0.png")))

    def spec(**kw) -> PackSpec:
        return PackSpec(data=str(data), tokenizer=release, lock_dir=tmp_path / "locks",
                        seq_length=128, **{"cache_dir": tmp_path / "packs", **kw})  # fmt: skip

    with caplog.at_level(logging.WARNING, logger="primus_v4"):
        corpus = build_or_load(spec())
    stats = corpus.stats
    first = stats["first_image_above_8_bit"]
    assert stats["images_above_8_bit"] == 1 and stats["bad_rows"] == {}
    assert re.fullmatch(r".*rows\.jsonl line 1: image 1 \(.*deep\.png\): 16 bits per channel",
                        first)  # fmt: skip
    assert "1 picture of more than 8 bits per channel" in caplog.text and first in caplog.text
    assert "--strict refuses them" in caplog.text
    assert re.search(rf"images above 8 bits +1 \(first: {re.escape(first)}\)", summary_table(stats))
    assert stats["images"] == 2, "converted as DeepSeek's processor converts it, and packed"
    with pytest.raises(DataError, match=r"--strict: the cached packs .* hold 1 picture of more"):
        build_or_load(spec(strict=True))  # a cache hit: the stats name it
    with pytest.raises(DataError, match=r"rows\.jsonl line 1: image 1 \(.*deep\.png\): 16 bits "
                       r"per channel, above the 8 bits.* drop --strict"):  # fmt: skip
        build_or_load(spec(strict=True, cache_dir=tmp_path / "other"))
    data.write_text(json.dumps(_ask("img0.png")) + "\n")
    plain = build_or_load(spec(strict=True, cache_dir=tmp_path / "plain"))
    assert plain.stats["images_above_8_bit"] == 0
    assert "first_image_above_8_bit" not in plain.stats


@pytest.mark.parametrize("name", sorted(GRID_BOUNDS))
def test_each_image_setting_has_an_upper_bound_naming_it(name) -> None:
    bound = GRID_BOUNDS[name]
    with pytest.raises(ConfigError, match=rf"^vision_config\.{name}=1000000000000(\.0)? is above "
                       rf"its bound {bound} \(about 16x DeepSeek-V4\.1-Flash's"):  # fmt: skip
        ImageGrid(**{name: 10**12 if name != "max_wh_ratio" else 1e12})
    wrong = (True, "14", float("nan"), float("inf"), -1)
    for bad in wrong if name == "max_wh_ratio" else (*wrong, 1e12, 14.0, None):
        with pytest.raises(ConfigError, match=rf"^vision_config\.{name} must be"):
            ImageGrid(**{name: bad})


def test_the_released_settings_pass_and_the_largest_picture_planned_is_bounded() -> None:
    config = json.loads((RELEASE / "deepseek_v41_flash" / "config.json").read_text())
    assert ImageGrid.of(config) == ImageGrid()  # DeepSeek-V4.1-Flash's own
    for name in ("max_image_tokens", "min_pixels", "max_wh_ratio"):
        ImageGrid(**{name: GRID_BOUNDS[name]})
    with pytest.raises(ConfigError, match=r"max_image_tokens=1024 of cells of \(patch_size=224 "
                       r"x downsample_ratio=3\)\^2 pixels plan pictures of 462422016 pixels, "
                       r"above the bound 28901376"):  # fmt: skip
        ImageGrid(patch_size=224)


@pytest.mark.parametrize(("name", "value"), [("min_pixels", 10**12),
                                             ("max_image_tokens", 10**12),
                                             ("patch_size", 1e12)])  # fmt: skip
def test_pack_refuses_a_release_with_an_image_setting_out_of_bounds(
    tmp_path, capsys, name, value
) -> None:
    from primus_v4.cli import main

    release = _release(tmp_path, **{name: value})
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(_ask(str(IMG0))) + "\n")
    code = main(["pack", "--data", str(data), "--tokenizer", str(release), "--cache-dir",
                 str(tmp_path / "packs"), "--lock-dir", str(tmp_path / "locks"),
                 "--seq-length", "128", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.DATA
    assert len(err.splitlines()) == 1 and f"config.json: vision_config.{name}" in err


def test_a_hub_dataset_hands_its_pictures_over_undecoded(
    tokenizer, grid, tmp_path, monkeypatch
) -> None:
    """A hub dataset's Image columns (top level, in a list) reach the rows as bytes and path,
    so an EPS picture there is a bad row `image_format` too: `datasets` decodes nothing, and
    the `gs` on PATH never starts."""
    import datasets

    from primus_v4.data.corpus import CorpusSource, read_rows

    marker = _fake_ghostscript(tmp_path, monkeypatch)
    png = IMG0.read_bytes()
    features = datasets.Features({"image": datasets.Image(),
                                  "images": datasets.List(datasets.Image()),
                                  "messages": datasets.Value("string")})  # fmt: skip
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": EPS, "path": None}, {"bytes": png, "path": None}],
         "images": [[{"bytes": EPS, "path": None}], [{"bytes": png, "path": None}]],
         "messages": ["a", "b"]},
        features=features,
    )  # fmt: skip
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: table)
    rows = read_rows(CorpusSource(kind="hub", name="someone/pictures"))
    assert [type(r.value["image"]) for r in rows] == [dict, dict]
    assert rows[0].value["image"]["bytes"] == EPS and rows[1].value["images"][0]["bytes"] == png
    r = _render([_ask(rows[0].value["image"]), _ask(rows[1].value["image"])], tokenizer, grid)
    assert r.bad_rows == {"image_format": 1} and r.rows.tolist() == [1]
    assert not marker.exists()
