"""The release a run started from, as it read it: a resumed run is checked against it.

A run from `model.pretrained` reads the release again when it resumes: the checkpoint holds the
trained weights, not what stayed as released (frozen Engram tables, the Engram token map from the
release's tokenizer, a base kept as released, a frozen LoRA base). So that a resume never pairs a
checkpoint with another release, the first start of a run writes, per rank,
`<checkpoint.dir>/release_reads/rank<NNNNN>.json`: the sha256 of the release's config.json and
tokenizer files and, per stored tensor the rank read, the byte span and its digest
(checkpoint_formats/read_record.py). A resume reads the same spans again and compares every span
that a record of the first start also holds (all of them in the same layout; the overlap after
a change of the parallel layout): one that differs is refused in one line naming the tensor.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from primus_v4.checkpoint_formats.read_record import ReadRecord
from primus_v4.checkpoint_formats.sharded import CONFIG_FILE, tokenizer_files
from primus_v4.durable import write_durable
from primus_v4.errors import ResumeError
from primus_v4.log import get_logger

log = get_logger(__name__)

RECORD_DIR = "release_reads"


def _record_path(root: Path, rank: int) -> Path:
    return root / RECORD_DIR / f"rank{rank:05d}.json"


def release_files(release: str | Path) -> dict[str, str]:
    """sha256 of the release's config.json and tokenizer files, by file name."""
    paths = [Path(release) / CONFIG_FILE, *tokenizer_files(release)]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def save(root: Path, *, rank: int, world: int, release: str | Path, record: ReadRecord) -> Path:
    """Write this rank's record of a first start (rank 0 also removes records of ranks past
    `world`, left by an earlier run in this checkpoint.dir)."""
    path = _record_path(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for old in path.parent.glob("rank*.json"):
            number = old.stem.removeprefix("rank")
            if number.isdigit() and int(number) >= world:
                old.unlink(missing_ok=True)
    body = {"release": str(release), "files": release_files(release),
            "tensors": record.as_json()}  # fmt: skip
    write_durable(path, json.dumps(body, indent=1) + "\n")
    return path


def _recorded(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted((root / RECORD_DIR).glob("rank*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ResumeError(f"{path}: unreadable record of the run's release ({err})") from None
        out.append((path, body))
    return out


def verify(root: Path, *, release: str | Path, record: ReadRecord) -> int:
    """Raise ResumeError naming the first file or tensor of `release` that differs from what
    the run's first start read; returns how many tensor spans were compared."""
    recorded = _recorded(root)
    if not recorded:
        log.warning("%s: no record of the release this run started from (a checkpoint of an "
                    "older version); model.pretrained=%s is read unchecked", root / RECORD_DIR,
                    release)  # fmt: skip
        return 0
    first, body = recorded[0]
    files = release_files(release)
    for name, digest in body.get("files", {}).items():
        if files.get(name) != digest:
            how = "is missing" if name not in files else "differs"
            raise ResumeError(
                f"model.pretrained={release}: {name} {how} from the release this run started "
                f"from ({body.get('release')}, recorded in {first}); resume with that release, "
                "or start a new run in another checkpoint.dir"
            )
    spans = {}
    for path, rec in recorded:
        for name, read in rec.get("tensors", {}).items():
            spans[name, read["shard"], read["lo"], read["hi"]] = (read["digest"], path, rec)
    compared = 0
    for name, read in sorted(record.as_json().items()):
        seen = spans.get((name, read["shard"], read["lo"], read["hi"]))
        if seen is None:
            continue
        compared += 1
        if seen[0] != read["digest"]:
            raise ResumeError(
                f"model.pretrained={release}: tensor '{name}' (bytes {read['lo']}-{read['hi']} "
                f"of {read['shard']}) differs from the release this run started from "
                f"({seen[2].get('release')}, recorded in {seen[1]}); resume with that release, "
                "or start a new run in another checkpoint.dir"
            )
    log.info("model.pretrained=%s: %d of %d tensor reads match the release this run started "
             "from (%s)", release, compared, len(record.reads), root / RECORD_DIR)  # fmt: skip
    return compared
