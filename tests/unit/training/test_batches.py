"""Which rows a step gets: deterministic under the seed, BSHD walks the THD packs' samples,
data-parallel ranks split the global batch exactly."""

from __future__ import annotations

from train_fakes import RAGGED_PACKS, FakeCorpus

from primus_v4.training.batches import BatchSource


def test_order_is_seeded_and_covers_every_pack_once_per_epoch() -> None:
    corpus = FakeCorpus(RAGGED_PACKS)
    a = BatchSource(corpus, layout="thd", global_batch_size=3, seed=7)
    b = BatchSource(corpus, layout="thd", global_batch_size=3, seed=7)
    c = BatchSource(corpus, layout="thd", global_batch_size=3, seed=8)
    epoch = a.row_ids(0) + a.row_ids(1)
    assert sorted(epoch) == list(range(len(RAGGED_PACKS)))
    assert epoch == b.row_ids(0) + b.row_ids(1)
    assert epoch != c.row_ids(0) + c.row_ids(1)
    assert a.row_ids(2) + a.row_ids(3) != epoch  # reshuffled next epoch


def test_bshd_walks_the_samples_of_the_thd_pack_order() -> None:
    corpus = FakeCorpus(RAGGED_PACKS)
    thd = BatchSource(corpus, layout="thd", global_batch_size=2, seed=3)
    packs = thd.row_ids(0)
    n = sum(len(RAGGED_PACKS[p]) for p in packs)
    bshd = BatchSource(corpus, layout="bshd", global_batch_size=n, seed=3)
    expected = [j for p in packs for j in range(*corpus.pack_sample_range(p))]
    assert bshd.row_ids(0) == expected
    assert sum(corpus.bshd_batch(j).num_supervised for j in expected) == sum(
        corpus.thd_batch(p).num_supervised for p in packs
    )


def test_data_parallel_ranks_split_the_global_batch() -> None:
    corpus = FakeCorpus(RAGGED_PACKS)
    src = BatchSource(corpus, layout="thd", global_batch_size=4, seed=0)
    whole = src.row_ids(5)
    parts = [src.row_ids(5, dp_rank=r, dp_size=2) for r in range(2)]
    assert parts[0] + parts[1] == whole
