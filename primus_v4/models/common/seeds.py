"""Per-parameter random streams: every weight and adapter draws from a generator seeded by
(run seed, its name), so a pipeline stage or an expert shard draws what one process draws."""

from __future__ import annotations

import hashlib


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (run seed, parameter name), stable across processes."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
