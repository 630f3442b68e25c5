"""A V4.1 release through the public API after the model and the release writer meet: the token
map of the release's own tokenizer, logits, and an fp8 export bit for bit the source release;
a bf16 export loads back to the same weights (FP8 / FP4 values are exact in bf16)."""

from __future__ import annotations

from pathlib import Path

import torch
from dsv41_model import CHECKPOINT, golden

import primus_v4
from primus_v4.checkpoint_formats.sharded import CheckpointReader


def _bytes(reader: CheckpointReader, name: str) -> torch.Tensor:
    t = reader._raw(name)
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def test_a_v41_release_loads_and_exports_back_bit_for_bit(tmp_path: Path) -> None:
    model = primus_v4.load_pretrained(CHECKPOINT, dtype=torch.float32)
    assert torch.equal(model.engram_rows.token_map, golden()["token_map"])
    primus_v4.save_pretrained(model, tmp_path / "fp8", dtype="fp8")
    with CheckpointReader(CHECKPOINT) as a, CheckpointReader(tmp_path / "fp8") as b:
        assert a.stored_names() == b.stored_names()
        for name in a.stored_names():
            assert torch.equal(_bytes(a, name), _bytes(b, name)), name
    primus_v4.save_pretrained(model, tmp_path / "bf16", dtype="bfloat16")
    again = primus_v4.load_pretrained(tmp_path / "bf16", dtype=torch.float32)
    for (n, x), y in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(x, y), n
