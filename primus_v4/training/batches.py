"""Which rows each optimizer step trains on, for either layout, on every data-parallel rank.

Order is a pure function of (seed, step): pack order is a seeded permutation per epoch, so a
resumed run draws exactly the rows an uninterrupted run would. The BSHD baseline walks the
*samples of the same pack order* (sample j alone in a padded row), so a THD step of P packs and a
BSHD step of the samples in those P packs see identical tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch

from primus_v4.data.thd import ThdBatch


class Corpus(Protocol):
    """What the trainer needs from `primus_v4.data.pipeline.build_or_load`."""

    num_samples: int
    stats: dict

    def __len__(self) -> int: ...

    def thd_batch(self, i: int) -> ThdBatch: ...

    def pack_sample_range(self, i: int) -> tuple[int, int]: ...

    def bshd_batch(self, j: int) -> ThdBatch: ...


class BatchSource:
    """Rows of global step `step` for data-parallel rank `dp_rank` of `dp_size`."""

    def __init__(
        self,
        corpus: Corpus,
        *,
        layout: str,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if len(corpus) == 0:
            raise ValueError("the corpus has no packs: nothing to train on")
        self.corpus = corpus
        self.layout = layout
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    @property
    def rows_per_epoch(self) -> int:
        return len(self.corpus) if self.layout == "thd" else self.corpus.num_samples

    def _pack_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.corpus)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.corpus), generator=gen).tolist()

    def _order(self, epoch: int) -> list[int]:
        """Row ids of one epoch: pack ids (thd) or sample ids in pack order (bshd)."""
        if epoch not in self._orders:
            packs = self._pack_order(epoch)
            if self.layout == "thd":
                order = packs
            else:
                order = [j for p in packs for j in range(*self.corpus.pack_sample_range(p))]
            self._orders = {epoch: order}  # one epoch cached; steps walk forward
        return self._orders[epoch]

    def row_ids(self, step: int, *, dp_rank: int = 0, dp_size: int = 1) -> list[int]:
        per_rank = self.global_batch_size // dp_size
        first = step * self.global_batch_size + dp_rank * per_rank
        ids = []
        for g in range(first, first + per_rank):
            epoch, pos = divmod(g, self.rows_per_epoch)
            ids.append(self._order(epoch)[pos])
        return ids

    def rows(self, step: int, *, dp_rank: int = 0, dp_size: int = 1) -> list[ThdBatch]:
        get = self.corpus.thd_batch if self.layout == "thd" else self.corpus.bshd_batch
        return [get(i) for i in self.row_ids(step, dp_rank=dp_rank, dp_size=dp_size)]
