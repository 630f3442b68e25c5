"""DeepSeek-V4.1's batch under context parallelism: DeepSeek-V4's contiguous split of a pack,
with V4.1's boundary rows.

Each rank hands its right neighbour: the last W - 1 window KV rows, the last ratio - 1 hidden
rows of a 2:1 compression group that straddles the edge (a position belongs to the rank holding
its last row; compressor.PoolPlan) and the last max_n - 1 token ids of Engram's n-gram look-back.
The pools are all-gathered whole (backward: summed back to their owners), so the index keys,
selections and candidate blocks of every local row are computed over the pack's own pool,
exactly as on one process.
"""

from __future__ import annotations

from primus_v4.models.deepseek_v4.infra.cp_batch import CpSplitter as V4CpSplitter
from primus_v4.models.deepseek_v41.geometry import required_local_rows


class CpSplitter(V4CpSplitter):
    """DeepSeek-V4's splitter (the V4.1 backbone has no MTP streams) with V4.1's boundaries."""

    required_rows = staticmethod(required_local_rows)
