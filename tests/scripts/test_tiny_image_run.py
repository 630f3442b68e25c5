"""The tiny image run of examples/images: the script makes a release with a vision tower, 12
synthetic pictures and 48 conversations; `train --config run.yaml` trains 30 steps on packs with
images (the loss falls); the export of its checkpoint is re-read, the vision tensors byte for
byte the release's (the tower is frozen) and the text model the trained one; with
`model.vision.train=aligner` the aligner trains and is exported, the tower still as released."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from image_corpus import tiny_image_script
from safetensors import safe_open
from threads import one_thread  # noqa: F401 (the fixture)

from primus_v4.cli import main


def _tensors(release: Path, prefix: tuple[str, ...]) -> dict[str, bytes]:
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in index.items():
        if name.startswith(prefix):
            with safe_open(str(release / file), "pt") as f:
                out[name] = f.get_tensor(name).view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.usefixtures("one_thread")
def test_the_tiny_image_run_trains_and_exports(tmp_path: Path, monkeypatch) -> None:
    script = tiny_image_script()
    out = tmp_path / "tiny"
    assert script.main([str(out)]) == 0
    assert len(list((out / "pictures").glob("*.png"))) == 12
    assert len((out / "corpus.jsonl").read_text().splitlines()) == 48
    monkeypatch.setenv("PRIMUS_PACK_CACHE_DIR", str(tmp_path / "packs"))
    monkeypatch.setenv("PRIMUS_PACK_LOCK_DIR", str(tmp_path / "locks"))
    quiet = ["--set", "output.progress_bar=false", "--set", "output.plot=false"]
    assert main(["train", "--config", str(out / "run.yaml"), *quiet]) == 0
    rows = [
        json.loads(line) for line in (out / "outputs" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in rows if "loss" in r]
    print(f"tiny image run: 30 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]
    assert main(["export", "--run", str(out / "outputs"), "--out", str(out / "export"),
                 "--no-progress"]) == 0  # fmt: skip
    vision = ("vision.", "aligner.", "image_")
    released, exported = _tensors(out / "release", vision), _tensors(out / "export", vision)
    assert released and exported == released, "the frozen tower is carried byte for byte"
    text = _tensors(out / "export", ("embed.",))
    assert text and text != _tensors(out / "release", ("embed.",)), "the text model trained"
    # the aligner trained too (`model.vision.train=aligner`, 3 steps): exported in BF16 under
    # the release's names, changed; the frozen tower still the release's bytes
    aligner = out / "aligner"
    assert main(["train", "--config", str(out / "run.yaml"), *quiet, "--set",
                 "model.vision.train=aligner", "--set", "train.steps=3", "--set",
                 f"output.dir={aligner}", "--set", f"checkpoint.dir={aligner / 'ckpt'}",
                 "--set", "checkpoint.interval=3"]) == 0  # fmt: skip
    assert main(["export", "--run", str(aligner), "--out", str(out / "aligner_export"),
                 "--no-progress"]) == 0  # fmt: skip
    exported = _tensors(out / "aligner_export", vision)
    assert sorted(exported) == sorted(released)
    moved = sorted(n for n in released if exported[n] != released[n])
    assert moved and all(n.startswith(("aligner.", "image_")) for n in moved), moved
    assert "aligner.w1.weight" in moved
