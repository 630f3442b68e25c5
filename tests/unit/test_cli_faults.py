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

import json
import os
import socket
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


@case(
    "train: LoRA on random weights",
    ExitCode.CONFIG,
    "model.lora.rank=4 with no model.pretrained trains adapters on random weights",
)
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.lora.rank=4"]


@case(
    "train: a preset of another family beside model.pretrained",
    ExitCode.CONFIG,
    "model.preset: 'tiny_v41' is a 'deepseek_v41' preset",
)
def _(ws: Ws):
    yield ["train", "--dry-run", "--set", "model.preset=tiny_v41",
           "--set", f"model.pretrained={ws.release()}"]  # fmt: skip


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


@case("export: --max-shard-gb infinite", ExitCode.CONFIG, "--max-shard-gb inf: must be > 0 and")
def _(ws: Ws):  # was an OverflowError (exit 70) after reading the checkpoint
    yield _export(ws, ws.ck(), "--max-shard-gb", "inf")


@case("export: --max-shard-gb not a number", ExitCode.CONFIG, "--max-shard-gb nan: must be > 0")
def _(ws: Ws):
    yield _export(ws, ws.ck(), "--max-shard-gb", "nan")


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


@case("inspect memory: --device-memory not finite", ExitCode.CONFIG, "positive finite number")
def _(ws: Ws):  # nan and inf used to plan against nothing, silently
    yield ["inspect", "memory", "--device-memory", "nan"]


@case("inspect memory: --supervised-fraction out of range", ExitCode.USAGE, "is not a fraction")
def _(ws: Ws):  # 2 was taken and nan was an exit 70
    yield ["inspect", "memory", "--supervised-fraction", "nan"]


@case("inspect kernels: --backend unknown", ExitCode.CONFIG, "--backend='cuda': unknown kernel")
def _(ws: Ws):  # was a table of errors naming PRIMUS_V4_KERNEL_BACKEND, exit 1
    yield ["inspect", "kernels", "--backend", "cuda"]


@case("inspect memory: --world-size out of range", ExitCode.CONFIG, "--world-size 0")
def _(ws: Ws):
    yield ["inspect", "memory", "--world-size", "0"]


@case(
    "inspect memory: a stage over the device",
    ExitCode.OVER_MEMORY,
    "memory plan: pipeline stage 0 needs",
)
def _(ws: Ws):
    yield ["inspect", "memory", "--device-memory", "0.01"]


@case("inspect memory: --config missing", ExitCode.CONFIG, "does not exist")
def _(ws: Ws):
    yield ["inspect", "memory", "--config", str(ws.tmp / "none.yaml")]


# --- one writer per run, paths taken literally, interrupts -----------------------------------


def _hold(directory: Path, **holder: object) -> None:
    """A lock file of a run that is not this test's: `holder` names it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".primus-v4.lock").write_text(json.dumps(holder))


def _other_runs_outputs(run: Path) -> None:
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"checkpoint:\n  dir: {run / 'elsewhere'}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')


@case("train: checkpoint.dir in use by a live run", ExitCode.RESUME,
      f"is in use by another run: pid {os.getpid()} on host")  # fmt: skip
def _(ws: Ws):
    import fcntl

    ck = ws.ck()
    _hold(ck, host=socket.gethostname(), pid=os.getpid(), since="2026-01-01 00:00:00")
    fd = os.open(ck / ".primus-v4.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other run: this process, through another open file
    try:
        yield ws.train_sets(f"checkpoint.dir={ck}", "train.steps=3")
    finally:
        os.close(fd)


@case("train --dry-run: output.dir held by a run on another host", ExitCode.PATH,
      "pid 4242 on host node-7")  # fmt: skip
def _(ws: Ws):
    _hold(ws.tmp / "run", host="node-7", pid=4242, since="2026-01-01 00:00:00")
    yield ["train", "--dry-run", "--set", f"output.dir={ws.tmp / 'run'}"]


@case("train: output.dir holds another run's outputs", ExitCode.PATH,
      "already holds another run's outputs (config.yaml, metrics.jsonl)")  # fmt: skip
def _(ws: Ws):
    _other_runs_outputs(ws.tmp / "run")
    yield ws.train_sets()


@case("train --dry-run: output.dir holds another run's outputs", ExitCode.PATH,
      "set output.overwrite=true to replace them")  # fmt: skip
def _(ws: Ws):
    _other_runs_outputs(ws.tmp / "run")
    yield ["train", "--dry-run", "--set", f"output.dir={ws.tmp / 'run'}"]


@case("train: --set data.path holding ' #'", ExitCode.PATH, "rc/run #2/c.json")
def _(ws: Ws):
    (ws.tmp / "rc" / "run").mkdir(parents=True)  # what the path cut at ' #' would name
    (ws.tmp / "rc" / "run" / "other.jsonl").write_text(GOOD_ROW)
    yield ["train", "--dry-run", "--set", f"data.path={ws.tmp}/rc/run #2/c.json"]


@case("train: --set checkpoint.dir holding ' #' under a file", ExitCode.PATH, "is under the file")
def _(ws: Ws):
    ws.file("f #1", "")
    yield ["train", "--dry-run", "--set", f"checkpoint.dir={ws.tmp}/f #1/ck"]


@case("train: --set output.dir holding ': ' under a file", ExitCode.PATH, "is under the file")
def _(ws: Ws):
    ws.file("f: 1", "")
    yield ["train", "--dry-run", "--set", f"output.dir={ws.tmp}/f: 1/run"]


@case("train: Ctrl-C during a checkpoint save", ExitCode.INTERRUPTED,
      "removed the partial .tmp_step_00000002; a rerun of the same command resumes from "
      "step_00000001")  # fmt: skip
def _(ws: Ws):
    import signal

    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def interrupted(state, *, checkpoint_id, **kwargs):  # type: ignore[no-untyped-def]
        real(state, checkpoint_id=checkpoint_id, **kwargs)
        if Path(checkpoint_id).name.endswith("2"):
            try:  # torch's writers turn Ctrl-C into an error of their own
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                raise RuntimeError(
                    "PytorchStreamWriter failed writing file: unexpected pos"
                ) from None

    dcp.save = interrupted
    # Ctrl-C as a terminal's process gets it: Python's own SIGINT handler, whatever an earlier
    # test in this process left installed
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    sets = ("data.path=synthetic:rows=24", "data.seq_length=256", "train.steps=2",
            "train.warmup_steps=0", "checkpoint.interval=1", "output.progress_bar=false",
            "output.plot=false", f"output.dir={ws.tmp / 'run'}", f"checkpoint.dir={ws.tmp / 'ck'}",
            f"data.cache_dir={ws.tmp / 'cache'}", f"data.lock_dir={ws.tmp / 'locks'}")  # fmt: skip
    try:
        yield ["train", *(a for item in sets for a in ("--set", item))]
    finally:
        dcp.save = real
        signal.signal(signal.SIGINT, handler)


@case("export: newest checkpoint damaged", ExitCode.CHECKPOINT,
      "step_00000002: ")  # fmt: skip
def _(ws: Ws):
    ck = ws.ck()
    damage(next((ck / "step_00000002").glob("*.distcp")))
    yield _export(ws, ck)


@case("export: --run of a copied run whose newest checkpoint is damaged", ExitCode.CHECKPOINT,
      "copy/ck/step_00000002: ")  # fmt: skip
def _(ws: Ws):
    import shutil

    run = ws.tmp / "work" / "outputs" / "r"
    shutil.copytree(ws.trained / "ck", run / "ck")
    (run / "config.yaml").write_text(
        "output:\n  dir: outputs/r\ncheckpoint:\n  dir: outputs/r/ck\n"
    )
    copy = Path(shutil.copytree(run, ws.tmp / "copy"))
    damage(next((copy / "ck" / "step_00000002").glob("*.distcp")))
    here = os.getcwd()
    os.chdir(ws.tmp / "work")  # where the original run was started
    try:
        yield _export(ws, copy)
    finally:
        os.chdir(here)


@case("export: --out inside --run", ExitCode.PATH, "it is inside --run")
def _(ws: Ws):
    ck = ws.ck()
    yield ["export", "--run", str(ck), "--out", str(ck / "hf"), "--no-progress"]


@case("export: a killed export's partial dir beside --out", ExitCode.CHECKPOINT, "no step 9")
def _(ws: Ws):
    ck = ws.ck()
    (ws.tmp / ".out.partial-4f2a9c1e").mkdir()  # what export killed with -9 left
    (ws.tmp / ".out.partial-4f2a9c1e" / "model-00001.safetensors").write_bytes(b"x" * 1024)
    yield _export(ws, ck, "--step", "9")


@case("pack: --export-jsonl is the corpus", ExitCode.PATH, "it is the corpus (--data)")
def _(ws: Ws):
    corpus = ws.file("rows.jsonl", GOOD_ROW)
    yield pack_argv(ws, "--data", str(corpus), "--export-jsonl", str(corpus))


@case("pack: --stats-json is a mixed corpus", ExitCode.PATH, "it is the corpus (--data #2)")
def _(ws: Ws):
    a, b = ws.file("a.jsonl", GOOD_ROW), ws.file("b.jsonl", GOOD_ROW)
    yield pack_argv(ws, "--data", f"{a}::weight=1", "--data", f"{b}::weight=2",
                    "--stats-json", str(b))  # fmt: skip


@case("pack: --stats-json inside the corpus dir", ExitCode.PATH, "it is inside the corpus")
def _(ws: Ws):
    (ws.tmp / "shards").mkdir()
    (ws.tmp / "shards" / "part-0.jsonl").write_text(GOOD_ROW)
    yield pack_argv(ws, "--data", str(ws.tmp / "shards"), "--stats-json",
                    str(ws.tmp / "shards" / "stats.json"))  # fmt: skip


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
