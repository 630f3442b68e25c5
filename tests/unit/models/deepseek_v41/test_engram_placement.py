"""Engram tables placed (engram_placement.py) equal the replicated model, on one process: frozen
FP8 rows on the device or in host memory; a release's rows read by range, only those bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from dsv41_model import CHECKPOINT, documents, next_token_labels, pack

from primus_v4.models.deepseek_v41.engram_placement import (
    PlacedTable,
    decode_rows,
    encode_rows,
    engram_modules,
    place_engram,
    read_release_rows,
    row_range,
)


def _step(model):
    docs = documents()
    ids, pos, psp = pack(docs)
    out = model(ids, pos, packed_seq_params=psp)
    labels = next_token_labels(docs)[0]
    keep = labels >= 0
    loss = torch.nn.functional.cross_entropy(out.logits[0][keep], labels[keep])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def test_fp8_rows_round_trip_the_release_values_exactly(golden_model):
    for _, engram in engram_modules(golden_model):
        table = engram.table.detach()
        codes, scales = encode_rows(table)
        assert codes.dtype == torch.uint8 and scales.shape == (table.shape[0], table.shape[1] // 32)
        assert torch.equal(decode_rows(codes, scales, torch.float32), table)


@pytest.mark.parametrize("placement", ["replicated", "host"])
def test_frozen_placement_equals_the_replicated_model(golden_model, placement):
    want_logits, want = _step(golden_model)
    placed_model = copy.deepcopy(golden_model)
    placed = place_engram(placed_model, placement=placement, trainable=False)
    assert sorted(placed) == ["layers.1.engram", "layers.4.engram"]
    assert not any(n.endswith("engram.table") for n, _ in placed_model.named_parameters())
    for name, store in placed.items():
        rows, width = golden_model.get_submodule(name).table.shape
        assert store.held_bytes() == rows * (width + width // 32)  # FP8 codes + e8m0 scales
        # host rows are no buffers: moving the model to a device leaves them in host memory
        assert len(list(store.buffers())) == (0 if placement == "host" else 2)
    logits, grads = _step(placed_model)
    assert torch.equal(logits, want_logits)
    assert sorted(grads) == sorted(n for n in want if not n.endswith("engram.table"))
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=0, msg=name)


def test_host_rows_are_not_moved_with_the_module():
    store = PlacedTable(placement="host", rows=10, width=32, dtype=torch.float32, trainable=False)
    assert list(store.buffers()) == [] and list(store.parameters()) == []
    store.fill(torch.randn(10, 32))
    got = store(torch.tensor([[3, 3], [9, 0]]))
    assert got.shape == (2, 2, 32) and torch.equal(got[0, 0], got[0, 1])


def test_placement_errors_name_the_choice():
    with pytest.raises(ValueError, match="'disk': choose from"):
        PlacedTable(placement="disk", rows=4, width=32, dtype=torch.float32, trainable=False)
    with pytest.raises(ValueError, match="trainable Engram table is replicated or sharded"):
        PlacedTable(placement="host", rows=4, width=32, dtype=torch.float32, trainable=True)


def test_release_rows_read_only_the_asked_rows(golden_model):
    names = [n for n, _ in engram_modules(golden_model)]
    for rank in range(2):
        lo_hi = {n: row_range(golden_model.get_submodule(n).table.shape[0], rank, 2) for n in names}
        tables, read = read_release_rows(CHECKPOINT, names, lo_hi=lo_hi)
        rows = sum(hi - lo for lo, hi in lo_hi.values())
        assert read == rows * (32 + 1)  # 32 FP8 codes + one e8m0 scale per row
        for name, (codes, scales) in tables.items():
            lo, hi = lo_hi[name]
            table = golden_model.get_submodule(name).table.detach()
            assert torch.equal(decode_rows(codes, scales, torch.float32), table[lo:hi])
