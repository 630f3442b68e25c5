"""Many processes, one key: exactly one build per node and identical packs everywhere; a builder
killed mid-write leaves no entry and the next run rebuilds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from primus_v4.data import cache
from primus_v4.data.pipeline import PackSpec, build_or_load, pack_key

REPO = Path(__file__).resolve().parents[3]
DATA = "synthetic:rows=300,seed=11"

# Child: build or load, then report whether it was a hit and a digest of every pack array.
CHILD = """
import hashlib, json, sys
from primus_v4.data.pipeline import PackSpec, build_or_load
spec = PackSpec(data=sys.argv[1], seq_length=1024, cache_dir=sys.argv[2], lock_dir=sys.argv[3])
corpus = build_or_load(spec)
h = hashlib.sha256()
for i in range(len(corpus)):
    for name, array in sorted(corpus.pack_arrays(i).items()):
        h.update(name.encode()); h.update(array.tobytes())
print(json.dumps({"hit": corpus.stats["cache_hit"], "packs": len(corpus), "digest": h.hexdigest(),
                  "torch": "torch" in sys.modules}))
"""

# Child: a builder that stops for good after writing its second array file.
STALLED_BUILDER = """
import sys, time
from pathlib import Path
from primus_v4.data import cache
from primus_v4.data.pipeline import PackSpec, build_or_load
write = cache._write_array
def stall_after_second_file(path, array):
    out = write(path, array)
    if path.name == "supervised.npy":
        Path(sys.argv[4]).touch()
        time.sleep(120)
    return out
cache._write_array = stall_after_second_file
build_or_load(PackSpec(data=sys.argv[1], seq_length=1024, cache_dir=sys.argv[2],
                       lock_dir=sys.argv[3]))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PRIMUS_LOG_LEVEL": "WARNING"}


def test_eight_processes_one_build_identical_packs(tmp_path: Path) -> None:
    args = [DATA, str(tmp_path / "cache"), str(tmp_path / "locks")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, text=True, env=_env()
        )
        for _ in range(8)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(not r["hit"] for r in results) == 1  # exactly one builder
    assert len({r["digest"] for r in results}) == 1 and results[0]["packs"] > 0
    assert not any(r["torch"] for r in results)  # the pack path never imports torch
    entries = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(entries) == 1 and entries[0].startswith("pack-")  # no temp left behind


def test_builder_killed_mid_write_leaves_no_entry(tmp_path: Path) -> None:
    spec = PackSpec(
        data=DATA, seq_length=1024, cache_dir=tmp_path / "cache", lock_dir=tmp_path / "locks"
    )
    key = pack_key(spec)
    flag = tmp_path / "writing"
    args = [DATA, str(spec.cache_dir), str(spec.lock_dir), str(flag)]
    proc = subprocess.Popen([sys.executable, "-c", STALLED_BUILDER, *args], env=_env())
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, "the stalled builder exited early"
            assert time.monotonic() < deadline, "the builder never reached the write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    cache_dir = spec.resolved_cache_dir()
    temps = [p for p in cache_dir.iterdir() if p.name.startswith(".tmp-pack-")]
    assert len(temps) == 1 and (temps[0] / "supervised.npy").exists()
    assert not cache.entry_dir(cache_dir, key).exists()  # readers see nothing, not a partial

    # The killed builder's lock died with it: the next run builds, publishes and cleans up.
    corpus = build_or_load(spec)
    assert corpus.stats["cache_hit"] is False and len(corpus) > 0
    assert [p.name for p in cache_dir.iterdir()] == [f"pack-{key}"]
    cache.verify(cache.entry_dir(cache_dir, key), key)
