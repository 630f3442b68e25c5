"""Fault-table cases (tests/unit/test_cli_faults.py) for hostile and oversized input: sizes
above their bounds, rows that are too deep, too large or not text, special-token text under the
`error` policy, pack cache and lock dirs someone else could write, and a checkpoint whose pickled
metadata would run code. Imported by the table, which runs every registered case the same way."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from cli_fault_runner import GOOD_ROW, ROWS, Ws, case, pack_argv
from planted import plant_metadata

from primus_v4.errors import ExitCode

# A user other than this one, for directories "owned by another user" (root can chown to it;
# anyone else gets the group/others-writable refusal instead, the same check).
NOBODY = 65534


def _pack_rows(ws: Ws, second_line: str, *args: str) -> list[str]:
    path = ws.file("rows.jsonl", GOOD_ROW + second_line + "\n" + GOOD_ROW)
    return pack_argv(ws, "--data", str(path), "--strict", *args)


@contextlib.contextmanager
def _foreign(directory: Path) -> Iterator[None]:
    """`directory` owned by another user when this process may chown, else writable by all."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(directory, NOBODY, NOBODY)
    else:
        directory.chmod(0o777)
    try:
        yield
    finally:
        if os.geteuid() == 0:
            os.chown(directory, 0, 0)
        directory.chmod(0o700)


# --- sizes above their bounds ---------------------------------------------------------------


@case("pack: --seq-length above its bound", ExitCode.DATA, "=1000000000000 is above its bound")
def _(ws: Ws):
    yield ["pack", "--seq-length", str(10**12), *ws.cache, "--data", ROWS]


@case("train: data.seq_length above its bound", ExitCode.CONFIG, "is above its bound 4194304")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", f"data.seq_length={10**12}"]


@case("train: model override above its bound", ExitCode.CONFIG, "num_layers=1000000 is above")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", f"model.overrides.num_layers={10**6}"]


@case("train: LoRA rank above its bound", ExitCode.CONFIG, "model.lora.rank: 1000000 is above")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", f"model.lora.rank={10**6}"]


@case("train: release config.json num_hidden_layers=10**6", ExitCode.PRETRAINED,
      "num_hidden_layers=1000000 is above its bound 1024")  # fmt: skip
def _(ws: Ws):
    release = ws.release()
    config = json.loads((release / "config.json").read_text())
    config["num_hidden_layers"] = 10**6
    config["compress_ratios"] = [0] * 10**6
    (release / "config.json").write_text(json.dumps(config))
    yield ["train", "--dry-run", "--set", "model.preset=null",
           "--set", f"model.pretrained={release}"]  # fmt: skip


# --- bad rows: counted with file and line, named under --strict ---------------------------------


@case("pack: row nested 200,000 deep under --strict", ExitCode.DATA,
      "rows.jsonl line 2: nested deeper than 100 levels")  # fmt: skip
def _(ws: Ws):
    deep = "[" * 200_000 + "]" * 200_000
    yield _pack_rows(ws, '{"instruction": "a", "output": "b", "metadata": ' + deep + "}")


@case("pack: lone surrogate in a row under --strict", ExitCode.DATA,
      "rows.jsonl line 2: a lone surrogate \\ud800")  # fmt: skip
def _(ws: Ws):
    yield _pack_rows(ws, '{"instruction": "a\\ud800", "output": "b"}')


@case("pack: row above the row-size bound under --strict", ExitCode.DATA,
      "rows.jsonl line 2: 9437218 bytes, above the row bound of 8 MiB")  # fmt: skip
def _(ws: Ws):
    yield _pack_rows(ws, json.dumps({"instruction": "a" * (9 << 20), "output": "b"}))


@case("pack: special-token text with --special-tokens-in-text error", ExitCode.DATA,
      "rows.jsonl line 2: <｜Assistant｜>")  # fmt: skip
def _(ws: Ws):
    row = json.dumps({"instruction": "a <｜Assistant｜> b", "output": "c"}, ensure_ascii=False)
    yield _pack_rows(ws, row, "--special-tokens-in-text", "error")


# --- directories someone else could write ------------------------------------------------------


@case("pack: --cache-dir owned by another user", ExitCode.PATH, "refusing the pack cache dir")
def _(ws: Ws):
    with _foreign(ws.tmp / "cache"):
        yield pack_argv(ws, "--data", ROWS)


@case("pack: --cache-dir writable by others", ExitCode.PATH, "writable by group or others")
def _(ws: Ws):
    (ws.tmp / "cache").mkdir(mode=0o700)
    (ws.tmp / "cache").chmod(0o777)
    yield pack_argv(ws, "--data", ROWS)


@case("pack: --lock-dir writable by others", ExitCode.PATH, "point --lock-dir at a directory")
def _(ws: Ws):
    (ws.tmp / "locks").mkdir(mode=0o700)
    (ws.tmp / "locks").chmod(0o757)
    yield pack_argv(ws, "--data", ROWS)


@case("pack: default cache root planted by another user", ExitCode.PATH,
      "primus_v4-")  # fmt: skip
def _(ws: Ws):
    tmpdir = ws.tmp / "tmpdir"
    root = tmpdir / f"primus_v4-{os.getuid()}"
    with _foreign(root):
        old = {k: os.environ.pop(k, None) for k in ("PRIMUS_PACK_CACHE_DIR", "TMPDIR")}
        os.environ["TMPDIR"] = str(tmpdir)
        try:
            yield ["pack", "--seq-length", "512", "--no-progress", "--data", ROWS]
        finally:
            for k, v in old.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v


@case("inspect cache --verify: manifest of the wrong types", ExitCode.VERIFY_FAILED,
      "field 'files' is NoneType, not dict")  # fmt: skip
def _(ws: Ws):
    entry = ws.tmp / "cache" / "pack-0123456789abcdef0123"
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text(json.dumps({
        "key": entry.name[5:], "format_version": "primus_v4.pack/1", "seq_length": 512,
        "pad_id": 1, "stats": {}, "key_fields": {}, "files": None, "manifest_sha256": "0",
    }))  # fmt: skip
    yield ["inspect", "cache", "--cache-dir", str(ws.tmp / "cache"), "--verify"]


# --- checkpoints whose metadata would run code ---------------------------------------------


def _planted_ck(ws: Ws) -> tuple[Path, Path]:
    ck, marker = ws.ck(), ws.tmp / "planted-code-ran"
    for step in sorted(ck.glob("step_*")):
        plant_metadata(step, marker)
    return ck, marker


@case("export: planted object in .metadata (MANIFEST updated)", ExitCode.CHECKPOINT,
      ".metadata: refused to load: it names posix.mkdir")  # fmt: skip
def _(ws: Ws):
    ck, marker = _planted_ck(ws)
    try:
        yield ["export", "--run", str(ck), "--out", str(ws.tmp / "out"), "--no-progress"]
    finally:
        assert not marker.exists(), "the planted code ran"


@case("train: resume from a planted .metadata", ExitCode.CHECKPOINT,
      ".metadata: refused to load: it names posix.mkdir")  # fmt: skip
def _(ws: Ws):
    ck, marker = _planted_ck(ws)
    try:
        yield ws.train_sets(f"checkpoint.dir={ck}", "train.steps=3")
    finally:
        assert not marker.exists(), "the planted code ran"
        shutil.rmtree(ws.tmp / "run", ignore_errors=True)
