"""Fault injection over every subcommand: each case feeds `primus-v4 pack | train | export |
inspect` one bad input (missing, unreadable, unwritable, a full disk, malformed, of the wrong
type, out of range) and requires, whatever the code path: exactly one error line on stderr
naming what and where, the exit status of that kind of failure (errors.ExitCode), no
traceback, and nothing partial left behind (no temp, partial or probe file anywhere in the
case's directory; refused runs leave the checkpoint dir as it was).

A full disk is a small tmpfs when the tests may mount one, else RLIMIT_FSIZE in a child
process; an unreadable file is mode 000, or for root (who reads through mode bits) an open()
that fails with EACCES (tests/unit/training/faults.py). `PRIMUS_FAULT_TABLE=FILE` writes the
table of cases (command, input, exit status, message) as it runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "training"))
import cli_faults_trust  # noqa: F401  (registers the cases of hostile and oversized input)
from cli_fault_runner import (
    CASES,
    GOOD_ROW,
    ROWS,
    Limited,
    Ws,
    case,
    damage,
    leftovers,
    pack_argv,
    record,
    release,
    run_case,
    snapshot,
    trained,
)
from faults import read_only_dir, small_disk, unreadable

from primus_v4.errors import ExitCode

__all__ = ["release", "trained"]  # module fixtures, shared with the runner

# --- pack ---------------------------------------------------------------------------------------


@case("pack: corpus missing", ExitCode.DATA, "does not exist")
def _(ws: Ws):
    yield pack_argv(ws, "--data", str(ws.tmp / "missing.jsonl"))


@case("pack: corpus unreadable", ExitCode.DATA, "cannot read corpus")
def _(ws: Ws):
    path = ws.file("rows.jsonl", GOOD_ROW)
    with unreadable(path):
        yield pack_argv(ws, "--data", str(path))


@case("pack: corpus malformed JSON", ExitCode.DATA, "is not valid JSON (line 1")
def _(ws: Ws):
    yield pack_argv(ws, "--data", str(ws.file("broken.json", "[1, 2")))


@case("pack: corpus not UTF-8", ExitCode.DATA, "line 1, column 25: byte 0xff is not UTF-8")
def _(ws: Ws):
    yield pack_argv(ws, "--data", str(ws.file("latin.json", b'[{"instruction": "a", "o\xff": 1}]')))


@case("pack: corpus of the wrong type (.csv)", ExitCode.DATA, "unsupported file type '.csv'")
def _(ws: Ws):
    yield pack_argv(ws, "--data", str(ws.file("rows.csv", "a,b\n")))


@case("pack: bad row under --strict", ExitCode.DATA, "line 2: missing field 'output'")
def _(ws: Ws):
    path = ws.file("bad.jsonl", GOOD_ROW + '{"instruction": "a"}\n')
    yield pack_argv(ws, "--data", str(path), "--strict")


@case("pack: --seq-length out of range", ExitCode.DATA, "seq_length must be an integer >= 2")
def _(ws: Ws):
    yield ["pack", "--seq-length", "1", *ws.cache, "--data", ROWS]


@case("pack: --seq-length of the wrong type", ExitCode.USAGE, "invalid int value: 'abc'")
def _(ws: Ws):
    yield ["pack", "--seq-length", "abc", "--data", ROWS]


@case("pack: --lock-timeout out of range", ExitCode.DATA, "lock_timeout_s must be > 0")
def _(ws: Ws):
    yield pack_argv(ws, "--data", ROWS, "--lock-timeout", "0")


@case("pack: --data option malformed", ExitCode.DATA, "weight 'x' is not a number")
def _(ws: Ws):
    yield pack_argv(ws, "--data", f"{ws.file('a.jsonl', GOOD_ROW)}::weight=x")


@case("pack: tokenizer dir without tokenizer.json", ExitCode.DATA, "has no tokenizer.json")
def _(ws: Ws):
    (ws.tmp / "tok").mkdir()
    yield pack_argv(ws, "--data", ROWS, "--tokenizer", str(ws.tmp / "tok"))


@case("pack: --cache-dir unwritable", ExitCode.PATH, "point --cache-dir at a writable")
def _(ws: Ws):
    with read_only_dir(ws.tmp) as ro:
        yield ["pack", "--seq-length", "512", "--data", ROWS, "--cache-dir", str(ro / "c"),
               "--lock-dir", str(ws.tmp / "locks")]  # fmt: skip


@case("pack: --lock-dir unwritable", ExitCode.PATH, "point --lock-dir at a writable")
def _(ws: Ws):
    with read_only_dir(ws.tmp) as ro:
        yield ["pack", "--seq-length", "512", "--data", ROWS, "--cache-dir",
               str(ws.tmp / "cache"), "--lock-dir", str(ro / "l")]  # fmt: skip


@case("pack: --stats-json under a read-only dir", ExitCode.PATH, "--stats-json")
def _(ws: Ws):
    with read_only_dir(ws.tmp) as ro:
        yield pack_argv(ws, "--data", ROWS, "--stats-json", str(ro / "stats.json"))


@case("pack: cache dir on a full disk", ExitCode.DISK_FULL, "pack cache")
def _(ws: Ws):
    with small_disk(ws.tmp, 64 << 10) as disk:
        argv = ["pack", "--seq-length", "512", "--no-progress", "--data",
                "synthetic:rows=400,seed=3", "--lock-dir", str(ws.tmp / "locks"), "--cache-dir",
                str(disk or ws.tmp) + "/cache"]  # fmt: skip
        yield argv if disk else Limited(argv=argv, max_bytes=64 << 10)


@case("pack: --export-jsonl on a full disk", ExitCode.DISK_FULL, "packs.jsonl")
def _(ws: Ws):
    with small_disk(ws.tmp, 64 << 10) as disk:
        argv = pack_argv(ws, "--data", "synthetic:rows=200,seed=3", "--export-jsonl",
                     str(disk or ws.tmp) + "/packs.jsonl")  # fmt: skip
        yield argv if disk else Limited(argv=argv, max_bytes=256 << 10)


# --- train ----------------------------------------------------------------------------------


@case("train: --config missing", ExitCode.CONFIG, "does not exist")
def _(ws: Ws):
    yield ["train", "--dry-run", "--config", str(ws.tmp / "run.yaml")]


@case("train: --config unreadable", ExitCode.CONFIG, "cannot read it (Permission denied)")
def _(ws: Ws):
    path = ws.file("run.yaml", "train:\n  steps: 2\n")
    with unreadable(path):
        yield ["train", "--dry-run", "--config", str(path)]


@case("train: --config malformed YAML", ExitCode.CONFIG, "run.yaml:3:1: not valid YAML")
def _(ws: Ws):
    yield ["train", "--dry-run", "--config", str(ws.file("run.yaml", "train:\n  steps: [2\n"))]


@case("train: --config of the wrong type (a list)", ExitCode.CONFIG, "must be a mapping")
def _(ws: Ws):
    yield ["train", "--dry-run", "--config", str(ws.file("run.yaml", "- 1\n- 2\n"))]


@case("train: --config is a directory", ExitCode.CONFIG, "is a directory; pass a YAML file")
def _(ws: Ws):
    yield ["train", "--dry-run", "--config", str(ws.tmp)]


@case("train: unknown key", ExitCode.CONFIG, "unknown key 'train.stpes'; did you mean 'steps'")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "train.stpes=2"]


@case("train: value of the wrong type", ExitCode.CONFIG, "train.steps: expected")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "train.steps=abc"]


@case("train: value out of range", ExitCode.CONFIG, "train.lr: must be > 0, got -1.0")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "train.lr=-1"]


@case("train: --set malformed", ExitCode.CONFIG, "expected section.key=value")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "steps"]


@case("train: LoRA on the indexer", ExitCode.CONFIG, "no gradient passes it")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.lora.rank=4",
           "--set", "model.lora.targets=[wq_a,indexer.wq_b]"]  # fmt: skip


@case("train: LoRA base unknown", ExitCode.CONFIG, "model.lora.base")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.lora.rank=4", "--set", "model.lora.base=fp8"]


@case("train: LoRA base as released from an unquantized release", ExitCode.PRETRAINED,
      "is stored as fp32, not FP8 / FP4")  # fmt: skip
def _(ws: Ws):
    sets = ["model.preset=null", "model.lora.rank=4", "model.lora.base=release",
            f"model.pretrained={ws.release()}"]  # fmt: skip
    yield ["train", "--dry-run", *(a for s in sets for a in ("--set", s))]


@case("train: model override out of range", ExitCode.CONFIG, "num_layers: must be an integer")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.overrides.num_layers=0"]


@case("train: model override of the wrong type", ExitCode.CONFIG, "got 'abc'")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.overrides.hidden_size=abc"]


@case("train: WORLD_SIZE malformed", ExitCode.CONFIG, "WORLD_SIZE='two' is not an integer")
def _(ws: Ws):
    os.environ["WORLD_SIZE"] = "two"
    try:
        yield ["train", "--dry-run"]
    finally:
        del os.environ["WORLD_SIZE"]


@case("train: parallel sizes out of range", ExitCode.CONFIG, "is not divisible by parallel.pp")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "parallel.pp=2"]


@case("train: corpus missing", ExitCode.PATH, "data.path: corpus file")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", f"data.path={ws.tmp / 'none.jsonl'}"]


@case("train: output.dir unwritable", ExitCode.PATH, "output.dir: ")
def _(ws: Ws):
    with read_only_dir(ws.tmp) as ro:
        yield ["train", "--dry-run", "--set", f"output.dir={ro / 'run'}"]


@case("train: checkpoint.dir under a file", ExitCode.PATH, "is under the file")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", f"checkpoint.dir={ws.file('f', '')}/ck"]


@case("train: model.pretrained missing", ExitCode.PRETRAINED, "no config.json")
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.preset=null",
           "--set", f"model.pretrained={ws.tmp / 'none'}"]  # fmt: skip


@case("train: model.pretrained config.json malformed", ExitCode.PRETRAINED, "model.pretrained=")
def _(ws: Ws):
    release = ws.release()
    (release / "config.json").write_text("{")
    yield ["train", "--dry-run", "--set", "model.preset=null",
           "--set", f"model.pretrained={release}"]  # fmt: skip


@case("train: model.pretrained shard truncated", ExitCode.PRETRAINED, "it is truncated")
def _(ws: Ws):
    release = ws.release()
    shard = release / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    yield ["train", "--dry-run", "--set", "model.preset=null",
           "--set", f"model.pretrained={release}"]  # fmt: skip


@case("train: model.pretrained shard unreadable", ExitCode.PRETRAINED, "cannot read")
def _(ws: Ws):
    release = ws.release()
    with unreadable(release / "model.safetensors"):
        yield ["train", "--dry-run", "--set", "model.preset=null",
               "--set", f"model.pretrained={release}"]  # fmt: skip


@case("train: resume=false into a dir with checkpoints", ExitCode.RESUME, "already holds")
def _(ws: Ws):
    ck = ws.ck()
    yield ws.train_sets(f"checkpoint.dir={ck}", "checkpoint.resume=false")


@case("train: resume with another model", ExitCode.RESUME, "model.overrides.hidden_size")
def _(ws: Ws):
    ck = ws.ck()
    yield ws.train_sets(f"checkpoint.dir={ck}", "model.overrides.hidden_size=128")


@case("train: resume past train.steps", ExitCode.RESUME, "past this run's 1 steps")
def _(ws: Ws):
    ck = ws.ck()
    yield ws.train_sets(f"checkpoint.dir={ck}", "train.steps=1", f"data.path={ROWS}")


@case("train: every checkpoint damaged", ExitCode.CHECKPOINT, "no usable checkpoint")
def _(ws: Ws):
    ck = ws.ck()
    for shard in ck.glob("step_*/*.distcp"):
        damage(shard)
    yield ws.train_sets(f"checkpoint.dir={ck}")


@case("train: checkpoint save on a full disk", ExitCode.DISK_FULL, "cannot save checkpoint")
def _(ws: Ws):
    with small_disk(ws.tmp, 1 << 20) as disk:
        ck = (disk or ws.tmp) / "ck"
        argv = ["train", *(a for item in ("data.path=synthetic:rows=24", "data.seq_length=256",
                "train.steps=1", "train.warmup_steps=0", "output.progress_bar=false",
                "output.plot=false", f"output.dir={ws.tmp / 'run'}", f"checkpoint.dir={ck}",
                f"data.cache_dir={ws.tmp / 'cache'}", f"data.lock_dir={ws.tmp / 'locks'}")
                for a in ("--set", item))]  # fmt: skip
        yield argv if disk else Limited(argv=argv, max_bytes=8 << 20)


# --- export ---------------------------------------------------------------------------------


def _export(ws: Ws, run: Path | str, *args: str) -> list[str]:
    return ["export", "--run", str(run), "--out", str(ws.tmp / "out"), "--no-progress", *args]


@case("export: --run missing", ExitCode.CHECKPOINT, "not a directory")
def _(ws: Ws):
    yield _export(ws, ws.tmp / "none")


@case("export: --run of the wrong type (a file)", ExitCode.CHECKPOINT, "not a directory")
def _(ws: Ws):
    yield _export(ws, ws.file("f", ""))


@case("export: --run holds no checkpoint", ExitCode.CHECKPOINT, "holds no step_* checkpoints")
def _(ws: Ws):
    (ws.tmp / "empty").mkdir()
    yield _export(ws, ws.tmp / "empty")


@case("export: --run's config.yaml malformed", ExitCode.CONFIG, "not valid YAML")
def _(ws: Ws):
    (ws.tmp / "outdir").mkdir()
    (ws.tmp / "outdir" / "config.yaml").write_text("checkpoint: [\n")
    yield _export(ws, ws.tmp / "outdir")


@case("export: --step not present", ExitCode.CHECKPOINT, "no step 9 (present: step_00000001")
def _(ws: Ws):
    yield _export(ws, ws.ck(), "--step", "9")


@case("export: --step of the wrong type", ExitCode.USAGE, "invalid int value: 'two'")
def _(ws: Ws):
    yield _export(ws, ws.tmp, "--step", "two")


@case("export: --dtype unknown", ExitCode.USAGE, "invalid choice: 'fp4'")
def _(ws: Ws):
    yield _export(ws, ws.tmp, "--dtype", "fp4")


@case("export: --format peft with --dtype fp8", ExitCode.USAGE, "--format peft writes adapters")
def _(ws: Ws):
    yield _export(ws, ws.ck(), "--format", "peft", "--dtype", "fp8")


@case("export: --format peft of a run without LoRA", ExitCode.CONFIG, "model.lora.rank is 0")
def _(ws: Ws):
    yield _export(ws, ws.ck(), "--format", "peft")


@case("export: --max-shard-gb out of range", ExitCode.CONFIG, "--max-shard-gb 0.0: must be > 0")
def _(ws: Ws):
    yield _export(ws, ws.ck(), "--max-shard-gb", "0")


@case("export: named step damaged", ExitCode.CHECKPOINT, "corrupt (sha256 differs")
def _(ws: Ws):
    ck = ws.ck()
    damage(next((ck / "step_00000002").glob("*.distcp")))
    yield _export(ws, ck / "step_00000002")


@case("export: manifest missing", ExitCode.CHECKPOINT, "MANIFEST.json: missing")
def _(ws: Ws):
    ck = ws.ck()
    (ck / "step_00000002" / "MANIFEST.json").unlink()
    yield _export(ws, ck, "--step", "2")


@case("export: step's own config.yaml missing", ExitCode.CHECKPOINT, "config.yaml: missing")
def _(ws: Ws):
    ck = ws.ck()
    (ck / "step_00000002" / "config.yaml").unlink()
    yield _export(ws, ck / "step_00000002")


@case("export: shard unreadable", ExitCode.CHECKPOINT, "unreadable (Permission denied)")
def _(ws: Ws):
    ck = ws.ck()
    with unreadable(next((ck / "step_00000002").glob("*.distcp"))):
        yield _export(ws, ck / "step_00000002")


@case("export: --out exists", ExitCode.PATH, "is not empty; choose a new directory")
def _(ws: Ws):
    ck = ws.ck()
    (ws.tmp / "out").mkdir()
    (ws.tmp / "out" / "keep").write_text("mine")
    yield _export(ws, ck)


@case("export: --out under a read-only dir", ExitCode.PATH, "choose a directory you can write")
def _(ws: Ws):
    ck = ws.ck()
    with read_only_dir(ws.tmp) as ro:
        yield ["export", "--run", str(ck), "--out", str(ro / "out"), "--no-progress"]


@case("export: --out on a full disk", ExitCode.DISK_FULL, "nothing was left there")
def _(ws: Ws):
    ck = ws.ck()
    with small_disk(ws.tmp, 64 << 10) as disk:
        argv = ["export", "--run", str(ck), "--out", f"{disk or ws.tmp}/out", "--no-progress"]
        yield argv if disk else Limited(argv=argv, max_bytes=64 << 10)


# --- inspect --------------------------------------------------------------------------------


@case("inspect checkpoint: dir missing", ExitCode.CHECKPOINT, "does not exist")
def _(ws: Ws):
    yield ["inspect", "checkpoint", str(ws.tmp / "none")]


@case("inspect checkpoint: of the wrong type (a file)", ExitCode.CHECKPOINT, "not a directory")
def _(ws: Ws):
    yield ["inspect", "checkpoint", str(ws.file("f", ""))]


@case("inspect checkpoint --verify: damaged", ExitCode.VERIFY_FAILED, "corrupt (sha256")
def _(ws: Ws):
    ck = ws.ck()
    damage(next((ck / "step_00000001").glob("*.distcp")))
    yield ["inspect", "checkpoint", str(ck), "--verify"]


@case("inspect checkpoint: manifest unreadable", ExitCode.VERIFY_FAILED, "MANIFEST.json")
def _(ws: Ws):
    ck = ws.ck()
    with unreadable(ck / "step_00000002" / "MANIFEST.json"):
        yield ["inspect", "checkpoint", str(ck)]


@case("inspect checkpoint: manifest malformed", ExitCode.VERIFY_FAILED, "is unreadable")
def _(ws: Ws):
    ck = ws.ck()
    (ck / "step_00000002" / "MANIFEST.json").write_text("{")
    yield ["inspect", "checkpoint", str(ck)]


@case("inspect cache: dir missing", ExitCode.DATA, "pack cache dir")
def _(ws: Ws):
    yield ["inspect", "cache", "--cache-dir", str(ws.tmp / "none")]


@case("inspect model: unknown preset", ExitCode.CONFIG, "unknown model preset 'nope'")
def _(ws: Ws):
    yield ["inspect", "model", "nope"]


@case("inspect config: unknown section", ExitCode.USAGE, "invalid choice: 'nope'")
def _(ws: Ws):
    yield ["inspect", "config", "--section", "nope"]


@case("inspect memory: --device-memory malformed", ExitCode.CONFIG, "give GiB or one of")
def _(ws: Ws):
    yield ["inspect", "memory", "--device-memory", "lots"]


@case("inspect memory: --world-size out of range", ExitCode.CONFIG, "--world-size 0")
def _(ws: Ws):
    yield ["inspect", "memory", "--world-size", "0"]


@case("inspect memory: --config missing", ExitCode.CONFIG, "does not exist")
def _(ws: Ws):
    yield ["inspect", "memory", "--config", str(ws.tmp / "none.yaml")]


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_one_line_an_exit_status_and_no_leftovers(
    name: str, tmp_path: Path, trained: Path, release: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fn, code, says = CASES[name]
    ws = Ws(tmp=tmp_path, trained=trained, release_dir=release)
    steps = fn(ws)
    argv = next(steps)
    refused = code in (ExitCode.RESUME, ExitCode.CHECKPOINT) and name.startswith("train")
    before = snapshot(tmp_path) if refused else {}
    try:
        got, out, err = run_case(argv, capsys)
    finally:
        steps.close()  # undo the fault (unmount, restore modes) before looking around
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if ": error: " in line]
    if code == ExitCode.VERIFY_FAILED:  # a result, not an error: the damage is on stdout
        assert not errors and says in out, out
        line = next(text for text in out.splitlines() if says in text).strip()
    else:
        assert len(errors) == 1, err[-3000:]
        line = errors[0]
        assert line.startswith("primus-v4"), line
        assert says in line, line
    record(name, got, line)
    assert got == code, f"{name}: exit {got}, wanted {int(code)} ({code.name}): {line}"
    assert leftovers(tmp_path) == []
    if refused:
        assert snapshot(tmp_path) == before  # a refused run changes no checkpoint
