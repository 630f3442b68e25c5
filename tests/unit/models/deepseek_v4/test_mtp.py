"""MTP shifts: depth-k targets stay inside their sample, padding is never a target, and the
global shift sliced per CP rank is what a rank must receive.

Legend: S = rows of the pack.
"""

from __future__ import annotations

import torch

from primus_v4.data.mtp_shift import IGNORE_LABEL, mtp_streams, shift_in_sample

CU = torch.tensor([0, 1, 4, 9, 12], dtype=torch.int32)  # last segment = trailing padding


def _pack():
    ids = torch.arange(100, 112)
    pad = torch.zeros(12, dtype=torch.bool)
    pad[9:] = True
    labels = torch.full((12,), IGNORE_LABEL)
    mask = torch.zeros(12)
    for a, b in [(0, 1), (1, 4), (4, 9)]:
        labels[a : b - 1] = ids[a + 1 : b]
        mask[a : b - 1] = 1.0
    return ids, labels, mask, pad


def test_shift_never_crosses_a_sample_end():
    x = torch.arange(12)
    out = shift_in_sample(x, CU, 2, -1)
    assert out.tolist() == [-1, 3, -1, -1, 6, 7, 8, -1, -1, 11, -1, -1]


def test_depth_targets_are_labels_k_ahead_in_the_same_sample():
    ids, labels, mask, pad = _pack()
    for k in (1, 2, 3):
        s = mtp_streams(
            input_ids_S=ids, cu_seqlens=CU, depth=k,
            labels_S=labels, loss_mask_S=mask, padding_mask_S=pad,
        )  # fmt: skip
        for t in range(12):
            seg = int(torch.searchsorted(CU, torch.tensor(t), right=True)) - 1
            inside = t + k < int(CU[seg + 1])
            valid = inside and not pad[t + k] and mask[t + k] > 0
            assert s.loss_mask[t].item() == float(valid), (k, t)
            if valid:
                # Depth k at t predicts token t+k+1 of the same sample.
                assert s.labels[t].item() == ids[t + k + 1].item()
            if inside:
                assert s.input_ids[t].item() == ids[t + k].item()
    # A depth longer than every sample masks everything.
    deep = mtp_streams(input_ids_S=ids, cu_seqlens=CU, depth=5, labels_S=labels, loss_mask_S=mask)
    assert deep.loss_mask.sum().item() == 0


def test_global_shift_then_slice_is_the_cp_feed():
    """Under CP the caller shifts the global pack and slices it like input_ids; a rank-local
    roll would read the next rank's rows wrongly at the rank boundary."""
    ids, labels, mask, pad = _pack()
    full = mtp_streams(
        input_ids_S=ids, cu_seqlens=CU, depth=1, labels_S=labels, loss_mask_S=mask,
        padding_mask_S=pad,
    )  # fmt: skip
    cp = 2
    t = 12 // cp
    for rank in range(cp):
        part = full.local_slice(rank * t, (rank + 1) * t)
        assert torch.equal(part.input_ids, full.input_ids[rank * t : (rank + 1) * t])
        assert torch.equal(part.loss_mask, full.loss_mask[rank * t : (rank + 1) * t])
    # Row 5 (rank 0's last row) targets row 6, which lives on rank 1: only a global shift has it.
    assert full.input_ids[5].item() == ids[6].item() and full.loss_mask[5].item() == 1.0
