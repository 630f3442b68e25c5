"""Training on packs with images (DeepSeek-V4.1, a release with a vision tower): the trainer
attaches the release's image encoder and feeds each row's token types and pictures, so its loss
is the model's own loss on the rows with their images (not the spans read as text; and with the
release's image routing bias, which the trainer's load path once left zero); a run that cannot
train them stops in one line before the model is built."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from image_corpus import RELEASE, GoldenImageCorpus, image_run
from threads import one_thread  # noqa: F401 (the fixture)
from train_fakes import FakeCorpus

from primus_v4.errors import DataError
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.vision import load_image_encoder
from primus_v4.training.trainer import Trainer, check_images


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
    trainer = Trainer(image_run(tmp_path), corpus=corpus)
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
    run = image_run(tmp_path)
    check_images(corpus, run, "rows.jsonl")  # a release, one process: allowed
    check_images(FakeCorpus([[100]]), image_run(tmp_path, "model.pretrained=null",
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
            check_images(corpus, image_run(tmp_path, *extra), "rows.jsonl")
    with pytest.raises(DataError, match=r"one process or data parallel for now: parallel\.cp=2"):
        check_images(corpus, image_run(tmp_path, "parallel.cp=2", world=2), "rows.jsonl")


def test_a_resumed_run_with_images_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """Two steps, one row each; the run stopped after step 1 and resumed trains step 2 with the
    same loss and gradient norm, bit for bit (the encoder is the release's again)."""
    from primus_v4.training.checkpoint.store import LATEST, step_dir

    def train(into: Path) -> dict:
        run = image_run(into, "train.steps=2", "train.global_batch_size=1",
                   f"checkpoint.dir={into / 'ckpt'}", "checkpoint.interval=1")  # fmt: skip
        return {r.step: r for r in Trainer(run, corpus=GoldenImageCorpus()).train().rows}

    want = train(tmp_path / "full")[2]
    ckpt = tmp_path / "resumed" / "ckpt"
    shutil.copytree(tmp_path / "full" / "ckpt", ckpt)
    shutil.rmtree(step_dir(ckpt, 2))
    (ckpt / LATEST).write_text(step_dir(ckpt, 1).name + "\n")
    got = train(tmp_path / "resumed")
    assert list(got) == [2]
    assert (got[2].loss, got[2].grad_norm) == (want.loss, want.grad_norm)
