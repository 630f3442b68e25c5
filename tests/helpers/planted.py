"""Hostile files for the trust-boundary tests: a checkpoint whose pickled metadata runs code when
unpickled (its manifest updated so that checksums pass), and the marker that code leaves."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path


class Planted:
    """Unpickles as `os.mkdir(marker)`: the marker's existence says whether the code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def plant_metadata(step: Path, marker: Path) -> None:
    """Rewrite `step`'s DCP `.metadata` with code in it (a valid checkpoint otherwise: the
    object stands where DCP accepts None) and update MANIFEST.json to match."""
    from primus_v4.training.checkpoint.integrity import MANIFEST, file_digest

    with (step / ".metadata").open("rb") as f:
        meta = pickle.load(f)  # our own test checkpoint: trusted here
    meta.storage_meta = Planted(marker)
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"][".metadata"] = file_digest(step / ".metadata")
    (step / MANIFEST).write_text(json.dumps(manifest, indent=1))
