"""Training on packs with images (DeepSeek-V4.1, a release with a vision tower): the trainer
attaches the release's image encoder and feeds each row's token types and pictures, so its loss
is the model's own loss on the rows with their images (not the spans read as text; and with the
release's image routing bias, which the trainer's load path once left zero); a run that cannot
train them stops in one line before the model is built."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from threads import one_thread  # noqa: F401 (the fixture)
from train_fakes import FakeCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.data.packed_corpus import layout, to_thd_batch
from primus_v4.data.thd import ThdBatch
from primus_v4.errors import DataError
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.vision import load_image_encoder
from primus_v4.training.trainer import Trainer, check_images

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures/dsv41_vision_golden"
RELEASE = GOLDEN / "checkpoint"
SEQ = 256
ROWS = [["doc0", "doc2"], ["doc1", "text"]]  # 154 and 213 tokens, 19 and 41 in image spans


class GoldenImageCorpus:
    """The golden documents packed two to a row, with their token types and pictures; the
    text positions are targets (never an image position)."""

    def __init__(self, *, images: bool = True) -> None:
        golden = load_file(GOLDEN / "golden.safetensors")
        manifest = {f"doc{d['doc']}": d for d in json.loads(
            (GOLDEN / "manifest.json").read_text())["docs"]}  # fmt: skip
        self.rows: list[ThdBatch] = []
        for names in ROWS:
            ids = [golden[f"{n}.input_ids"].flatten().numpy() for n in names]
            types = np.concatenate([golden[f"{n}.token_types"].flatten().numpy() for n in names])
            arrays = layout(np.concatenate(ids), types < 0, np.array([len(i) for i in ids]),
                            seq_length=SEQ, pad_id=2)  # fmt: skip
            pictures = []
            if images:
                full = np.full(SEQ, -1, dtype=np.int8)
                full[: len(types)] = types
                arrays["token_types"] = full
                for n in names:
                    for k, im in enumerate(manifest.get(n, {"images": []})["images"]):
                        patches = golden[f"{n}.img{k}.patches"]
                        bits = patches.reshape(len(patches), -1).view(torch.int16).numpy()
                        pictures.append((bits.view(np.uint16), tuple(im["vit_grid_hw"])))
            self.rows.append(to_thd_batch(arrays, pictures))
        spans = sum(int((r.token_types_S >= 0).sum()) for r in self.rows) if images else 0
        self.stats = {"images": 4 if images else 0, "image_tokens": spans}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_samples(self) -> int:
        return 2 * len(self.rows)

    def pack_sample_range(self, i: int) -> tuple[int, int]:
        return 2 * i, 2 * i + 2

    def thd_batch(self, i: int) -> ThdBatch:
        return self.rows[i]

    def bshd_batch(self, j: int) -> ThdBatch:
        raise NotImplementedError("the golden rows are packed")


def _run(tmp: Path, *extra: str, world: int = 1):
    items = [
        "model.preset=null", f"model.pretrained={RELEASE}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "output.plot=false",
        "train.shuffle=false", "train.steps=1", "train.warmup_steps=0",
        "train.global_batch_size=2", "model.dtype=float32", *extra,
    ]  # fmt: skip
    return resolve_run(load_config(overrides=items), world=world)


def _reference_loss(corpus: GoldenImageCorpus, *, images: bool) -> float:
    """The model's own token-mean cross entropy over both rows, from the release, with the
    rows' pictures (or with the spans read as text)."""
    model = load_pretrained(RELEASE, dtype=torch.float32, progress=False).eval()
    model.set_image_encoder(load_image_encoder(RELEASE))
    total, count = 0.0, 0
    with torch.no_grad():
        for row in corpus.rows:
            from primus_v4.data.thd import to_packed_seq_params

            out = model(row.input_ids_S[None], row.position_ids_S[None],
                        packed_seq_params=to_packed_seq_params(row),
                        token_types=row.token_types_S[None] if images else None,
                        images=list(row.images) if images else None)  # fmt: skip
            mask = row.loss_mask_S.bool()
            logits = out.logits[0][mask].double()
            total += float(torch.nn.functional.cross_entropy(logits, row.labels_S[mask],
                                                              reduction="sum"))  # fmt: skip
            count += int(mask.sum())
    return total / count


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_trainer_feeds_the_pictures_its_loss_is_the_model_s(tmp_path: Path) -> None:
    corpus = GoldenImageCorpus()
    trainer = Trainer(_run(tmp_path), corpus=corpus)
    [row] = trainer.train().rows
    with_images = _reference_loss(corpus, images=True)
    as_text = _reference_loss(corpus, images=False)
    print(f"step-1 loss {row.loss!r}; the model's with images {with_images!r}, "
          f"spans as text {as_text!r}")  # fmt: skip
    assert abs(row.loss - with_images) <= 1e-6 * abs(with_images)
    assert abs(row.loss - as_text) > 1e-3, "the pictures made no difference"
    release = load_pretrained(RELEASE, dtype=torch.float32, progress=False)
    for ours, theirs in zip(trainer.model.layers, release.layers, strict=True):
        # the rank loader's model routes image positions with the release's bias, not zeros
        assert torch.equal(ours.moe.router.bias_vl, theirs.moe.router.bias_vl)
        assert ours.moe.router.bias_vl.abs().sum() > 0
    encoder = trainer.model.__dict__["image_encoder"]
    assert encoder is not None and not any(p.requires_grad for p in encoder.parameters())
    assert not any(p is q for p in trainer.params for q in encoder.parameters())


def test_a_run_that_cannot_train_images_stops_in_one_line(tmp_path: Path) -> None:
    corpus = GoldenImageCorpus()
    run = _run(tmp_path)
    check_images(corpus, run, "rows.jsonl")  # a release, one process: allowed
    check_images(FakeCorpus([[100]]), _run(tmp_path, "model.pretrained=null",
                                           "model.preset=tiny_v41"), "text")  # fmt: skip
    cases = {
        "model.pretrained=null": "set model.pretrained to the release whose vision tower",
        "model.preset=tiny": "DeepSeek-V4 has no vision tower",
    }
    for item, words in cases.items():
        extra = (
            ("model.pretrained=null", item) if "preset" in item else (item, "model.preset=tiny_v41")
        )
        with pytest.raises(DataError, match=words):
            check_images(corpus, _run(tmp_path, *extra), "rows.jsonl")
    with pytest.raises(DataError, match=r"one process or data parallel for now: parallel\.cp=2"):
        check_images(corpus, _run(tmp_path, "parallel.cp=2", world=2), "rows.jsonl")
