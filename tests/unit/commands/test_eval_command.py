"""`primus-v4 eval`: a checkpoint's held-out loss is the one its run's own evaluation logged for
that step (==, float32 on CPU), an export's is within its bf16 rounding, a partial checkpoint (LoRA
adapters, a drafter alone) and one whose rows hold pictures load as a resume loads them, every
refusal is one line with its exit status, and evaluating writes nothing into the run's dirs.

The run: the tiny DeepSeek-V4 preset on the synthetic corpus packed into 256-token rows, 4 steps
with a quarter of the rows held out, evaluated and checkpointed every 2 steps. It and its newest
checkpoint's evaluation are made once per session, shared by the pytest-xdist workers (no test
writes into the run's dirs: one asserts that evaluating writes nothing there)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from image_corpus import GoldenImageCorpus, image_run
from lora_runs import LORA
from shared_once import _shared
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus, tiny_run

from primus_v4.cli import main
from primus_v4.errors import ExitCode
from primus_v4.training.checkpoint.store import step_dir
from primus_v4.training.metrics.writer import read_metrics

REPO = Path(__file__).resolve().parents[3]
V41 = REPO / "tests" / "fixtures" / "dsv41_dspark_golden" / "checkpoint"
EVAL_PACKS = [[120, 60], [200], [90, 90, 70]]


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _trained_run(tmp: Path, kind: str) -> tuple[Any, Any, Any]:
    """The resolved run of `kind`, its training corpus and a fresh copy of its evaluation one."""
    from primus_v4.config import load_config, resolve_run

    ck = ("checkpoint.interval=2", f"checkpoint.dir={tmp / 'ck'}", "train.steps=2",
          "train.warmup_steps=1", "train.eval_interval=1")  # fmt: skip
    fakes = (FakeCorpus(RAGGED_PACKS), lambda: FakeCorpus(EVAL_PACKS, seed=7))
    if kind == "lora":
        return tiny_run(tmp, *LORA, *ck), *fakes
    if kind == "images":
        run = image_run(tmp, *ck, "train.global_batch_size=1")
        return run, GoldenImageCorpus(), GoldenImageCorpus
    items = [
        "model.preset=null", f"model.pretrained={V41}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        "train.global_batch_size=1", "model.draft.train=only", "model.draft.anchor_rate=0.5", *ck,
    ]  # fmt: skip
    return resolve_run(load_config(overrides=items), world=1), *fakes


# First in the module: these need no `run`, so the xdist worker handed them is busy while the
# other one trains it (the second half of the module, handed on, waits for it less or not at all).
@pytest.mark.parametrize("kind", ["lora", "drafter_only", "images"])
def test_a_checkpoint_loads_as_a_resume_loads_it(tmp_path: Path, kind: str) -> None:
    """A LoRA checkpoint holds the adapters, a drafter-only one the drafter: the rest is built
    again (drawn from the seed, read from the release) before the step's part is loaded; rows
    with pictures read the release's image encoder as training did."""
    from primus_v4.training.trainer import Trainer

    resolved, corpus, eval_corpus = _trained_run(tmp_path, kind)
    row = Trainer(resolved, corpus=corpus, eval_corpus=eval_corpus()).train().rows[-1]
    evaluating = Trainer(resolved, eval_corpus=eval_corpus(), evaluate_only=True)
    assert evaluating.optimizer is None and evaluating.checkpoints is None
    untrained = evaluating.evaluator.run(evaluating)
    assert evaluating.load_weights(step_dir(tmp_path / "ck", 2)) == 2
    got = evaluating.evaluator.run(evaluating)
    print(f"{kind}: eval {got}, logged {row.eval_loss!r}")
    assert got == {key: getattr(row, key) for key in got}
    assert got != untrained
    assert ("eval_draft_loss" in got) == (kind == "drafter_only")


def _train(tmp: Path) -> str:
    out = tmp / "run"
    items = [
        # 20 rows: 5 held out (3 packs of several samples), each evaluation a few forwards
        "data.path=synthetic:rows=20", "data.seq_length=256", "data.eval_fraction=0.25",
        f"data.cache_dir={tmp / 'cache'}", f"data.lock_dir={tmp / 'locks'}",
        "train.steps=4", "train.warmup_steps=1", "train.eval_interval=2",
        f"checkpoint.dir={out / 'ck'}", "checkpoint.interval=2",
        f"output.dir={out}", "output.progress_bar=false", "output.plot=false",
    ]  # fmt: skip
    assert main(["train", *_sets(*items)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(
        _shared(tmp_path_factory, "eval_run", lambda: _train(tmp_path_factory.mktemp("eval_run")))
    )


@pytest.fixture(scope="module")
def logged(run: Path) -> dict[int, dict[str, Any]]:
    """The trainer's own evaluations, by step."""
    rows = read_metrics(run / "metrics.jsonl")
    return {r["step"]: r for r in rows if r["eval_loss"] is not None}


def _eval(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _newest(run: Path) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["eval", "--run", str(run), "--json"]) == 0
    return buffer.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def newest(run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`eval --run` of the newest checkpoint (step 4, the last), its stdout read here (capsys
    is one test's)."""
    return json.loads(_shared(tmp_path_factory, "eval_newest", lambda: _newest(run)))


def test_a_steps_evaluation_is_the_one_its_run_logged(
    run: Path,
    logged: dict[int, dict[str, Any]],
    newest: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert sorted(logged) == [2, 4]
    second = _eval(capsys, "--run", str(run), "--step", "2")
    for step, got in ((2, second), (4, newest)):
        print(f"step {step}: eval {got['eval_loss']!r} logged {logged[step]['eval_loss']!r}")
        assert got["step"] == step and got["source"] == str(step_dir(run / "ck", step))
        assert got["eval_loss"] == logged[step]["eval_loss"]
        assert got["eval_mtp_loss"] == logged[step]["eval_mtp_loss"]
    assert second["eval_loss"] != newest["eval_loss"]  # two steps' weights, not one
    assert newest["data"] == "synthetic:rows=20 (held-out 0.25 of its rows)"
    assert newest["tokens"] == 256 * newest["rows"] > newest["supervised_tokens"] > 0
    assert newest["samples"] >= newest["rows"] > 0 and newest["tokens_per_s"] > 0
    assert not any(k.startswith("eval_draft") for k in newest)  # no drafter in the tiny model


def test_an_export_evaluates_as_its_step_within_bf16_rounding(
    run: Path,
    logged: dict[int, dict[str, Any]],
    newest: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """export writes bfloat16 (or FP8) only: the run's float32 weights, rounded."""
    out = tmp_path / "export"
    assert main(["export", "--run", str(run), "--out", str(out), "--no-progress"]) == 0
    got = _eval(capsys, "--model", str(out), "--config", str(run / "config.yaml"))
    print(f"export: eval {got['eval_loss']!r}, the run's step 4 {newest['eval_loss']!r}")
    assert got["step"] is None and got["source"] == str(out)
    assert (got["rows"], got["supervised_tokens"]) == (newest["rows"], newest["supervised_tokens"])
    moved = abs(logged[4]["eval_loss"] - logged[2]["eval_loss"])
    assert abs(got["eval_loss"] - newest["eval_loss"]) < min(2e-3, moved / 100)
    assert abs(got["eval_mtp_loss"] - newest["eval_mtp_loss"]) < 2e-3


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], code: int, text: str) -> None:
    capsys.readouterr()
    try:
        got = main(["eval", *argv])
    except SystemExit as exc:  # argparse's own refusals
        got = exc.code
    assert got == code, argv
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("primus-v4")]
    assert len(lines) == 1 and text in lines[0], (argv, lines)


def test_each_refusal_is_one_line_with_its_exit_status(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = run / "ck"
    present = "present: step_00000002, step_00000004"
    cases = [
        ([], ExitCode.USAGE, "one of the arguments --run --model is required"),
        (["--run", str(run), "--model", str(run)], ExitCode.USAGE, "not allowed with argument"),
        (["--run", str(run), "--step", "3"], ExitCode.CHECKPOINT, f"{ck}: no step 3 ({present})"),
        (["--model", str(run), "--step", "2"], ExitCode.USAGE, "--step names a checkpoint"),
        (["--run", str(run), "--config", "tiny_cpu_thd"], ExitCode.USAGE, "step's own config.yaml"),
        (["--model", str(tmp_path / "nowhere")], ExitCode.PRETRAINED, "not a directory"),
        (["--run", str(run), "--data", "x.jsonl", "--set", "data.eval_fraction=0.1"],
         ExitCode.USAGE, "--set data.eval_fraction chooses held-out rows instead"),
        (["--run", str(run), *_sets("data.eval_fraction=0")], ExitCode.USAGE,
         f"nothing to evaluate: {step_dir(ck, 4) / 'config.yaml'} sets neither data.eval_path "
         "nor data.eval_fraction; pass --data PATH (a corpus), or --set data.eval_path=PATH"),
        (["--run", str(run), "--data", str(tmp_path / "missing.jsonl")], ExitCode.DATA,
         "missing.jsonl does not exist"),
    ]  # fmt: skip
    for argv, code, text in cases:
        _refused(capsys, argv, code, text)
    damaged = tmp_path / "step_00000002"
    shutil.copytree(step_dir(ck, 2), damaged)
    shard = next(damaged.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(capsys, ["--run", str(damaged)], ExitCode.CHECKPOINT,
             f"cannot evaluate {damaged}: {shard}: corrupt")  # fmt: skip


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in [root, *root.rglob("*")]}


def test_eval_writes_nothing_into_the_runs_dirs_and_data_is_the_whole_corpus(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _listing(run)
    assert _eval(capsys, "--run", str(run / "ck"), "--step", "2")["step"] == 2
    got = _eval(capsys, "--run", str(run), "--data", "synthetic:rows=4")
    assert got["data"] == "synthetic:rows=4" and got["samples"] == 4
    capsys.readouterr()
    assert main(["eval", "--run", str(run), *_sets("data.path=synthetic:rows=4")]) == 0
    table = capsys.readouterr().out
    assert f"evaluation of {step_dir(run / 'ck', 4)}" in table
    assert "synthetic:rows=4" in table and f"{got['eval_loss']:,.4f}" in table
    assert _listing(run) == before
