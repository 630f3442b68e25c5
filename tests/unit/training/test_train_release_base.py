"""`model.lora.base: release` from an FP8 / FP4 release through `primus-v4 train`: the first step
(fresh adapters, B = 0) logs the loss of the decoded-base run bit for bit, later steps follow it
within float rounding, and a release stored unquantized is refused before training, naming the
tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pretrained_runs import run_command, train_items, write_pretrained

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.commands import train
from primus_v4.errors import CheckpointFormatError

LORA = [
    "model.lora.rank=8",
    "model.lora.allow_random_base=true",
    "model.lora.alpha=16",
    "train.lr=0.02",
    "model.dtype=bfloat16",
]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("fp8_release")
    model = load_pretrained(write_pretrained(tmp / "src"), dtype=torch.float32, progress=False)
    save_pretrained(model, tmp / "fp8", dtype="fp8", progress=False)
    return tmp / "fp8"


def test_release_base_trains_like_the_decoded_base(fp8_release: Path, tmp_path: Path) -> None:
    losses = {}
    for base in ("bfloat16", "release"):
        tmp = tmp_path / base
        items = [*train_items(tmp, fp8_release, steps=3), *LORA, f"model.lora.base={base}"]
        assert run_command(train, items) == 0
        losses[base] = _losses(tmp / "run")
    assert len(losses["release"]) == 3
    assert losses["release"][0] == losses["bfloat16"][0]  # B = 0: the same logits
    assert losses["release"][2] != losses["release"][0]  # the adapters learn
    assert losses["release"] == pytest.approx(losses["bfloat16"], rel=2e-3)


def test_an_unquantized_release_is_refused(tmp_path: Path) -> None:
    plain = write_pretrained(tmp_path / "plain")  # float32 tensors, no FP8 / FP4
    items = [*train_items(tmp_path, plain, steps=1), *LORA, "model.lora.base=release"]
    with pytest.raises(CheckpointFormatError, match=r"'layers\.0\.attn\.wq_a\.weight' is stored "
                       r"as fp32, not FP8 / FP4"):  # fmt: skip
        run_command(train, items)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
