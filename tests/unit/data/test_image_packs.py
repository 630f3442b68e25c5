"""A corpus with images packs for a model with a vision tower: an image's span never splits
(across packs, or by truncation), no image position is a target, each picture's patches are
stored once (bf16 bits) and come back with their pack in span order, the key names the vision
grid, and a picture changed after packing rebuilds the entry."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from primus_v4.data.images import IMAGE_END, IMAGE_START, image_patches
from primus_v4.data.pipeline import PackSpec, build_or_load
from primus_v4.errors import DataError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GOLDEN = FIXTURES / "dsv41_vision_golden"
VISION = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())["vision_config"]
PICTURES = ["img0.png", "img1.png", "img2.png"]  # spans of 8, 11 and 30 positions here


@pytest.fixture()
def release(tmp_path: Path) -> Path:
    """The V4.1 tokenizer beside a config.json with the golden vision_config."""
    out = tmp_path / "release"
    out.mkdir()
    shutil.copy(FIXTURES / "dsv41_tokenizer" / "tokenizer.json", out)
    config = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    config["image_token_id"] = 129264  # the release's (the golden stub tokenizer has 496)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _corpus(tmp: Path, rows: list[dict]) -> Path:
    (tmp / "corpus" / "pics").mkdir(parents=True, exist_ok=True)
    for name in PICTURES:
        shutil.copy(GOLDEN / "images" / name, tmp / "corpus" / "pics" / name)
    path = tmp / "corpus" / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(*pictures: str, words: int = 6) -> dict:
    parts = [{"type": "image", "image": f"pics/{p}"} for p in pictures]
    text = {"type": "text", "text": " ".join(["describe"] * words)}
    return {"messages": [{"role": "user", "content": [*parts, text]},
                         {"role": "assistant", "content": "grey " * words}]}  # fmt: skip


def _spec(tmp: Path, release: Path, data: Path, **kw) -> PackSpec:
    return PackSpec(data=str(data), tokenizer=release, cache_dir=tmp / "packs",
                    lock_dir=tmp / "locks", **{"seq_length": 128, **kw})  # fmt: skip


def _spans(types: np.ndarray) -> list[tuple[int, int]]:
    starts = np.flatnonzero(types == IMAGE_START)
    ends = np.flatnonzero(types == IMAGE_END)
    assert len(starts) == len(ends) and (starts < ends).all(), "a span is cut"
    return list(zip(starts.tolist(), (ends + 1).tolist(), strict=True))


def test_packs_carry_whole_spans_untrained_with_their_pictures(tmp_path, release) -> None:
    rows = [_row("img0.png"), _row("img1.png", "img2.png"), _row(words=30), _row("img0.png")]
    data = _corpus(tmp_path, rows)
    corpus = build_or_load(_spec(tmp_path, release, data))
    assert corpus.has_images
    s = corpus.stats
    assert (s["images"], s["distinct_images"], s["image_tokens"]) == (4, 3, 8 + 11 + 30 + 8)
    assert s["image_patch_bytes"] == sum(
        image_patches(GOLDEN / "images" / p, VISION)[0].numel() * 2 for p in PICTURES
    )
    seen = []
    for i in range(len(corpus)):
        row, pictures = corpus.pack_arrays(i), corpus.pack_images(i)
        types = row["token_types"]
        spans = _spans(types)
        assert len(spans) == len(pictures)
        assert (row["input_ids"][types >= 0] == 129264).all()
        assert (types[row["padding_mask"]] == -1).all()
        # loss_mask[t] trains label t = token t + 1: never an image position
        assert not row["loss_mask"][:-1][types[1:] >= 0].any()
        for (a, b), (patches, (h, w)) in zip(spans, pictures, strict=True):
            seen.append((b - a, patches.shape, (h, w)))
    got = sorted(seen)
    want = []
    for name in ["img0.png", "img1.png", "img2.png", "img0.png"]:
        patches, (h, w) = image_patches(GOLDEN / "images" / name, VISION)
        span = -(-h // 3) * (-(-w // 3) + 1) + 2
        want.append((span, (h * w, 588), (h, w)))
    assert got == sorted(want)
    exported = tmp_path / "packs.jsonl"
    assert corpus.export_jsonl(exported) == len(corpus)
    first_row = json.loads(exported.read_text().splitlines()[0])
    assert first_row["token_types"] == corpus.pack_arrays(0)["token_types"].tolist()
    # the stored bits are the processor's, picture for picture
    first = next(i for i in range(len(corpus)) if corpus.pack_images(i))
    for patches, hw in corpus.pack_images(first):
        ref = [image_patches(GOLDEN / "images" / p, VISION) for p in PICTURES]
        match = [r for r in ref if r[1] == hw]
        bits = match[0][0].reshape(len(patches), -1).view(__import__("torch").int16).numpy()
        assert (patches.view(np.int16) == bits).all()


def test_the_same_packs_come_from_the_cache_and_a_changed_picture_rebuilds(
    tmp_path, release, capsys
) -> None:
    data = _corpus(tmp_path, [_row("img0.png"), _row("img1.png")])
    spec = _spec(tmp_path, release, data)
    built = build_or_load(spec)
    hit = build_or_load(spec)
    assert hit.stats["cache_hit"] and hit.stats["cache_key"] == built.stats["cache_key"]
    for i in range(len(built)):
        assert (hit.pack_arrays(i)["token_types"] == built.pack_arrays(i)["token_types"]).all()
    # a text-only V4.1 release packs the same corpus under another key: image rows are bad rows
    text_only = tmp_path / "text_only"
    shutil.copytree(release, text_only)
    config = json.loads((text_only / "config.json").read_text())
    del config["vision_config"]
    (text_only / "config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="no usable row"):
        build_or_load(_spec(tmp_path, text_only, data))
    # the same path, another picture: the entry is rebuilt, not served stale
    picture = tmp_path / "corpus" / "pics" / "img1.png"
    shutil.copy(GOLDEN / "images" / "img2.png", picture)
    os.utime(picture, ns=(1, 1))
    from primus_v4.cli import main

    assert main(["inspect", "cache", str(tmp_path / "packs"), "--verify", "--json"]) == 0
    [entry] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"key"' in x]
    assert entry["images"] == 2
    assert entry["status"].startswith(f"stale (image {picture} changed since the packs were")
    again = build_or_load(spec)
    assert not again.stats["cache_hit"]
    assert again.stats["image_tokens"] == 8 + 30


def test_truncation_cuts_before_a_span_never_inside_it(tmp_path, release) -> None:
    # a long text turn, then a second user turn with a picture, then the answer: at 128 tokens
    # the cut lands inside the picture's span, and moves back to its start
    long = {"messages": [
        {"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "hi " * 40},
        {"role": "user", "content": [{"type": "image", "image": "pics/img2.png"}]},
        {"role": "assistant", "content": "grey"}]}  # fmt: skip
    data = _corpus(tmp_path, [long])
    full = build_or_load(_spec(tmp_path, release, data, seq_length=4096))
    types = full.pack_arrays(0)["token_types"]
    [(a, _)] = _spans(types)
    cut = build_or_load(_spec(tmp_path, release, data, seq_length=a + 5))
    assert cut.stats["truncated"] == 1
    row = cut.pack_arrays(0)
    assert int((~row["padding_mask"]).sum()) == a, "cut at the span's start"
    # no image is left: the entry is text alone (no image arrays, as for a text corpus)
    assert not cut.has_images and "token_types" not in row and cut.pack_images(0) == []
    assert "images" not in cut.stats


def test_a_text_corpus_of_a_release_with_a_vision_tower_packs_as_text(tmp_path, release):
    data = _corpus(tmp_path, [_row(words=10), _row(words=20)])
    corpus = build_or_load(_spec(tmp_path, release, data))
    assert not corpus.has_images and "images" not in corpus.stats
    assert sorted(p.name for p in corpus.entry.iterdir()) == sorted(
        [f"{n}.npy" for n in ("tokens", "supervised", "sample_offsets", "pack_offsets",
                              "sample_rows")] + ["manifest.json"])  # fmt: skip


def test_bad_pictures_are_counted_with_their_line_and_strict_names_the_first(
    tmp_path, release
) -> None:
    rows = [_row("img0.png"), _row("missing.png"), _row("img1.png")]
    data = _corpus(tmp_path, rows)
    corpus = build_or_load(_spec(tmp_path, release, data))
    assert corpus.stats["bad_rows"] == {"image_missing": 1}
    [example] = corpus.stats["bad_row_examples"]
    assert example["where"].endswith("rows.jsonl line 2") and "missing.png" in example["detail"]
    with pytest.raises(DataError, match=r"rows.jsonl line 2: image 1 \(.*missing.png\)"):
        build_or_load(_spec(tmp_path, release, data, strict=True))


def test_a_parquet_corpus_with_a_hub_image_feature_packs_its_pictures(tmp_path, release):
    """A dataset saved with `datasets`' Image feature (each picture's bytes in the parquet file,
    its path a bare file name that exists nowhere) and LLaVA placeholders: the pictures come
    from the embedded bytes."""
    from datasets import Dataset, Features, Image, Sequence, Value

    pictures = [[{"bytes": (GOLDEN / "images" / name).read_bytes(), "path": name}]
                for name in ("img0.png", "img1.png")]  # fmt: skip
    turn = {"role": Value("string"), "content": Value("string")}
    chat = [{"role": "user", "content": "<image>What is it?"},
            {"role": "assistant", "content": "grey"}]  # fmt: skip
    ds = Dataset.from_dict({"images": pictures, "messages": [chat, chat]},
                           features=Features({"images": Sequence(Image()),
                                              "messages": [turn]}))  # fmt: skip
    data = tmp_path / "hub" / "train.parquet"
    data.parent.mkdir()
    ds.to_parquet(str(data))
    corpus = build_or_load(_spec(tmp_path, release, data))
    assert corpus.stats["bad_rows"] == {}
    assert (corpus.stats["images"], corpus.stats["image_tokens"]) == (2, 8 + 11)
    files = json.loads((corpus.entry / "manifest.json").read_text())["image_files"]
    assert files == [], "embedded pictures: no file to watch"
