"""CP bookkeeping without processes: window ownership, capacity, the contiguous split of a pack
and the MTP streams shifted in global order before slicing (all exact).

Legend: S = pack rows, T = rows per rank, P = compressed windows, C = pool slots per rank.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4.data.mtp_shift import IGNORE_LABEL, mtp_streams
from primus_v4.data.thd import ThdBatch, segment_starts
from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.compressor import boundary_rows, build_window_plan
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.infra.cp_batch import (
    CpShard,
    required_local_rows,
    shard_batch,
    shard_token_counts,
)
from primus_v4.models.deepseek_v4.layout import LocalComm, RowLayout
from primus_v4.parallel.context_parallel import split_rows
from primus_v4.training.loss import count_tokens


class _Place(LocalComm):
    """Rank and size only: the window plan is arithmetic on global cu_seqlens."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _ragged_cu(g: torch.Generator, total: int, short: bool) -> torch.Tensor:
    """Random segment lengths; `short` mixes in many segments below the ratios (1..5 rows)."""
    lens: list[int] = []
    while sum(lens) < total:
        tiny = short and bool(torch.rand((), generator=g) < 0.5)
        hi = 6 if tiny else 400
        lens.append(int(torch.randint(1, hi, (), generator=g)))
    lens[-1] -= sum(lens) - total
    lens = [n for n in lens if n > 0]
    return torch.tensor([0, *lens]).cumsum(0)


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_every_window_owned_exactly_once_by_its_last_row(ratio: int, cp: int) -> None:
    g = torch.Generator().manual_seed(ratio * 10 + cp)
    overlap = ratio == 4
    for trial in range(25):
        total = 1024 * (1 + trial % 2)
        cu = _ragged_cu(g, total, short=trial % 3 == 0)
        t = total // cp
        owners: dict[int, int] = {}
        slots = None
        for rank in range(cp):
            lay = RowLayout.from_cu_seqlens(cu, local_rows=t, comm=_Place(rank, cp))
            plan = build_window_plan(lay, ratio, overlap=overlap)
            used = plan.own_win_C >= 0
            assert int(used.sum()) <= plan.capacity  # capacity never exceeded
            # Used slots are the leading ones, so the fixed-width gather carries no holes.
            assert bool(used[: int(used.sum())].all())
            first = plan.own_row_C[used] - boundary_rows(ratio, overlap) + lay.global_start
            for row in first.tolist():
                last = row + ratio - 1
                assert lay.global_start <= last < lay.global_start + t  # owner holds last row
                # Every row pooled (incl. the overlap predecessor) is in the boundary buffer.
                reach = row - (ratio if overlap else 0)
                assert reach >= lay.global_start - boundary_rows(ratio, overlap)
                assert row not in owners
                owners[row] = rank
            if slots is None:
                slots = plan.slot_P
            assert torch.equal(plan.slot_P, slots)  # every rank derives the same global slots
        lens = cu[1:] - cu[:-1]
        expected = {
            int(cu[i]) + w * ratio
            for i in range(lens.numel())
            for w in range(int(lens[i]) // ratio)
        }
        assert set(owners) == expected  # covered once: no window lost, none duplicated
        assert slots is not None and slots.unique().numel() == len(expected)


def _pack(lens: list[int], pad: int = 0, seed: int = 0) -> ThdBatch:
    """A pack of samples with every second token supervised; `pad` trailing padding rows."""
    g = torch.Generator().manual_seed(seed)
    all_lens = [*lens, pad] if pad else list(lens)
    cu = torch.tensor([0, *all_lens]).cumsum(0).to(torch.int32)
    s = int(cu[-1])
    ids = torch.randint(1, 1000, (s,), generator=g)
    labels = torch.full((s,), IGNORE_LABEL)
    mask = torch.zeros(s)
    pad_mask = torch.zeros(s, dtype=torch.bool)
    for i, n in enumerate(lens):
        a = int(cu[i])
        labels[a : a + n - 1] = ids[a + 1 : a + n]
        mask[a : a + n - 1] = (torch.arange(n - 1) % 2 == 0).float()
    if pad:
        pad_mask[s - pad :] = True
        ids[s - pad :] = 0
    pos = torch.arange(s) - segment_starts(cu)
    return ThdBatch(
        input_ids_S=ids,
        labels_S=labels,
        loss_mask_S=mask,
        position_ids_S=pos,
        cu_seqlens_N1=cu,
        padding_mask_S=pad_mask,
    )


def _cat(shards: list[CpShard], get) -> torch.Tensor:
    return torch.cat([get(s) for s in shards])


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("depths", [1, 2])
def test_split_then_concat_is_the_pack_and_mtp_is_shifted_globally(cp: int, depths: int) -> None:
    batch = _pack([333, 191, 2, 277, 1, 223], pad=29)  # 1056 rows, segments of 1 and 2 rows
    shards = [shard_batch(batch, cp_rank=r, cp_size=cp, mtp_depths=depths) for r in range(cp)]
    assert torch.equal(_cat(shards, lambda s: s.input_ids_T), batch.input_ids_S)
    assert torch.equal(_cat(shards, lambda s: s.labels_T), batch.labels_S)
    assert torch.equal(_cat(shards, lambda s: s.loss_mask_T), batch.loss_mask_S)
    assert torch.equal(_cat(shards, lambda s: s.position_ids_T), batch.position_ids_S)
    assert torch.equal(_cat(shards, lambda s: s.padding_mask_T), batch.padding_mask_S)
    assert all(torch.equal(s.cu_seqlens_N1, batch.cu_seqlens_N1) for s in shards)  # global
    for k in range(1, depths + 1):
        ref = mtp_streams(
            input_ids_S=batch.input_ids_S,
            cu_seqlens=batch.cu_seqlens_N1,
            depth=k,
            labels_S=batch.labels_S,
            loss_mask_S=batch.loss_mask_S,
            padding_mask_S=batch.padding_mask_S,
        )
        got = [s.mtp[k - 1] for s in shards]
        assert torch.equal(torch.cat([m.input_ids for m in got]), ref.input_ids)
        assert torch.equal(torch.cat([m.labels for m in got]), ref.labels)
        mask = torch.cat([m.loss_mask for m in got])
        assert torch.equal(mask, ref.loss_mask)
        _check_mtp_invariants(batch, k, mask)
        _check_padding_polarity(batch, k, torch.cat([s.mtp_padding_T[k - 1] for s in shards]))
    # Token counts of the shards add up to the unsplit pack's (the loss denominators).
    per_rank = [shard_token_counts([s], samples=batch.num_samples) for s in shards]
    whole = count_tokens([batch], mtp_depths=depths)
    assert sum(c.supervised for c in per_rank) == whole.supervised
    assert sum(c.real for c in per_rank) == whole.real
    assert sum(c.total for c in per_rank) == whole.total
    for d in range(depths):
        assert sum(c.mtp[d] for c in per_rank) == whole.mtp[d]
    # Every CP rank counts the whole pack's samples (the balance loss is replicated per rank).
    assert all(c.samples == whole.samples for c in per_rank)


def _check_mtp_invariants(batch: ThdBatch, k: int, mask_S: torch.Tensor) -> None:
    """A depth-k target is valid only if t+k is in t's sample, real and supervised."""
    cu = batch.cu_seqlens_N1.long()
    ends = torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1])
    t = torch.arange(batch.seq_length)
    inside = t + k < ends
    src = (t + k).clamp(max=batch.seq_length - 1)
    want = torch.where(inside & ~batch.padding_mask_S[src], batch.loss_mask_S[src], 0.0)
    assert torch.equal(mask_S, want)
    assert not bool(mask_S[batch.padding_mask_S].any())


def _check_padding_polarity(batch: ThdBatch, k: int, pad_S: torch.Tensor) -> None:
    """True = pad at every vacated slot (the last k rows of each segment) and on real padding."""
    cu = batch.cu_seqlens_N1.long()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        assert bool(pad_S[max(a, b - k) : b].all())
        assert torch.equal(pad_S[a : max(a, b - k)], batch.padding_mask_S[a + k : b])


def test_all_ones_shift_masks_logical_ends() -> None:
    """Megatron #7278 case: 8 all-supervised rows, a segment of 8 at depth 2 keeps 6 ones."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    ones = torch.ones(8)
    shifted = mtp_streams(
        input_ids_S=torch.arange(8),
        cu_seqlens=cu,
        depth=2,
        labels_S=torch.arange(8),
        loss_mask_S=ones,
    ).loss_mask
    assert shifted.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def test_split_errors_are_clear() -> None:
    """Each CP rule is a config error, raised once where the config is resolved (the split
    itself only asserts what the config guaranteed)."""
    from primus_v4.config import load_config, resolve_run

    with pytest.raises(ConfigError, match=r"must be divisible by parallel\.cp=3"):
        load_config(overrides=["parallel.cp=3", "data.seq_length=512"])
    cfg = DeepseekV4Config.preset("tiny")
    need = required_local_rows(cfg)
    assert need == 128  # HCA ratio 128 pools with 128 boundary rows; the window needs 127
    run = load_config(overrides=["parallel.cp=8", "data.seq_length=512"])
    with pytest.raises(ConfigError, match="64 rows per rank, fewer than the 128 boundary rows"):
        resolve_run(run, world=8)
    batch = _pack([300, 212], pad=0)  # 512 rows
    with pytest.raises(AssertionError, match="not divisible by cp=3"):
        shard_batch(batch, cp_rank=0, cp_size=3)
    with pytest.raises(ConfigError, match="micro-batch size 1"):
        split_rows(torch.zeros(2, 512), 0, 2, "input_ids")


def test_unpacked_rows_shift_over_the_whole_row() -> None:
    """BSHD rows are one sequence to the model (padding included): the MTP shift under CP must be
    the model's CP = 1 shift over [0, S], not one that stops at the sample/padding edge."""
    batch = _pack([300], pad=212)
    shards = [shard_batch(batch, cp_rank=r, cp_size=2, mtp_depths=2, packed=False) for r in (0, 1)]
    whole = torch.tensor([0, batch.seq_length])
    for k in (1, 2):
        ref = mtp_streams(
            input_ids_S=batch.input_ids_S,
            cu_seqlens=whole,
            depth=k,
            labels_S=batch.labels_S,
            loss_mask_S=batch.loss_mask_S,
            padding_mask_S=batch.padding_mask_S,
        )
        assert torch.equal(torch.cat([s.mtp[k - 1].input_ids for s in shards]), ref.input_ids)
        assert torch.equal(torch.cat([s.mtp[k - 1].loss_mask for s in shards]), ref.loss_mask)
