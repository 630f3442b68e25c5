"""DeepSeek-V4.1's batch under context parallelism: DeepSeek-V4's contiguous split of a pack,
with V4.1's boundary rows.

Each rank hands its right neighbour: the last W - 1 window KV rows, the last ratio - 1 hidden
rows of a 2:1 compression group that straddles the edge (a position belongs to the rank holding
its last row; compressor.PoolPlan) and the last max_n - 1 token ids of Engram's n-gram look-back.
The pools are all-gathered whole (backward: summed back to their owners), so the index keys,
selections and candidate blocks of every local row are computed over the pack's own pool,
exactly as on one process.

A drafter in training (`dspark_train` joint / only; one CP rank) adds its target slots to the
step's counts: the draft loss's denominator, known before the forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from primus_v4.data.thd import ThdBatch, TokenCounts
from primus_v4.models.deepseek_v4.infra.cp_batch import CpSplitter as V4CpSplitter
from primus_v4.models.deepseek_v41.dspark_objective import IGNORE, count_slots
from primus_v4.models.deepseek_v41.geometry import required_local_rows


class CpSplitter(V4CpSplitter):
    """DeepSeek-V4's splitter (the V4.1 backbone has no MTP streams) with V4.1's boundaries."""

    required_rows = staticmethod(required_local_rows)

    def __init__(self, cp_axis: Any, model_cfg: Any, **kwargs: Any) -> None:
        super().__init__(cp_axis, model_cfg, **kwargs)
        self.cfg = model_cfg

    def token_counts(self, rows: Sequence[ThdBatch]) -> TokenCounts:
        counts = super().token_counts(rows)
        cfg = self.cfg
        if getattr(cfg, "dspark_train", "off") == "off":
            return counts
        slots = 0
        for row in rows:
            pad = row.padding_mask_S.bool()
            targets = torch.where(row.loss_mask_S.bool() & ~pad, row.labels_S, IGNORE)
            slots += count_slots(row.input_ids_S, targets, row.cu_seqlens_N1, pad,
                                 seed=cfg.dspark_anchor_seed, rate=cfg.dspark_anchor_rate,
                                 block=cfg.dspark_block_size)  # fmt: skip
        return dataclasses.replace(counts, draft=slots)

    def model_inputs(self, row: ThdBatch) -> dict[str, Any]:
        """DeepSeek-V4's inputs, with a row's token types and images (one CP rank: the model
        refuses images under context parallelism)."""
        inputs = super().model_inputs(row)
        if row.token_types_S is not None:
            inputs["token_types"] = row.token_types_S[None].to(self.device)
            inputs["images"] = [(p.to(self.device), hw) for p, hw in row.images]
        return inputs
