"""The golden V4.1 image documents (tests/fixtures/dsv41_vision_golden) packed two to a row, as
a trainer corpus with token types and pictures, and a run from the golden release with a vision
tower."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from safetensors.torch import load_file

from primus_v4.config import load_config, resolve_run
from primus_v4.data.packed_corpus import layout, to_thd_batch
from primus_v4.data.thd import ThdBatch

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures/dsv41_vision_golden"
TINY_IMAGE_RUN = Path(__file__).resolve().parents[2] / "examples/images/make_tiny_image_run.py"
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


def image_run(tmp: Path, *extra: str, world: int = 1):
    items = [
        "model.preset=null", f"model.pretrained={RELEASE}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "output.plot=false",
        "train.shuffle=false", "train.steps=1", "train.warmup_steps=0",
        "train.global_batch_size=2", "model.dtype=float32", *extra,
    ]  # fmt: skip
    return resolve_run(load_config(overrides=items), world=world)


def tiny_image_script() -> ModuleType:
    """examples/images/make_tiny_image_run.py as a module (its `write_release`, `main`)."""
    spec = importlib.util.spec_from_file_location("make_tiny_image_run", TINY_IMAGE_RUN)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script
