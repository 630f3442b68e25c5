"""Fault injection over the recipes (DRY_RUN=1): a bad knob, a missing or unusable path, a
malformed value, one out of range. Each is exactly one error line on stderr naming the knob or
the config key, with primus-v4's exit status for that kind of failure (a knob of the recipe: 3,
a tokenizer: 4, a release directory: 7; a failed validation: the trainer's own status), no
traceback and no stdout. `PRIMUS_FAULT_TABLE=FILE` appends the table of cases as it runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from faults import read_only_dir
from recipe_runner import run_recipe

from primus_v4.errors import ExitCode

MULTI = "run_full_4k_thd_multinode.sh"
NODE = {"MASTER_ADDR": "10.1.2.3", "NODE_RANK": "0"}
CASES = {
    "run_local.sh: NPROC malformed": (
        "run_local.sh", {"NPROC": "abc"}, ExitCode.CONFIG, "must be a positive integer, got 'abc'"
    ),
    "run_local.sh: PRIMUS_CONFIG missing": (
        "run_local.sh", {"PRIMUS_CONFIG": "{tmp}/none.yaml"}, ExitCode.CONFIG, "no such file"
    ),
    "run_local.sh: PRIMUS_DEVICE unknown": (
        "run_local.sh", {"PRIMUS_DEVICE": "tpu"}, ExitCode.CONFIG, "must be auto, cpu or gpu"
    ),
    "run_local.sh: corpus missing": (
        "run_local.sh", {"PRIMUS_DATA_PATH": "{tmp}/none.jsonl"}, ExitCode.PATH,
        "data.path: corpus file",
    ),
    "run_local.sh: TRAIN_STEPS malformed": (
        "run_local.sh", {"TRAIN_STEPS": "many"}, ExitCode.CONFIG, "train.steps: expected"
    ),
    "run_local.sh: output dir unwritable": (
        "run_local.sh", {"PRIMUS_OUTPUT_DIR": "{ro}/out"}, ExitCode.PATH, "output.dir: "
    ),
    f"{MULTI}: MASTER_ADDR missing": (
        MULTI, {"NODE_RANK": "0"}, ExitCode.CONFIG, "MASTER_ADDR is not set"
    ),
    f"{MULTI}: NODE_RANK out of range": (
        MULTI, {**NODE, "NODE_RANK": "5"}, ExitCode.CONFIG, "NODE_RANK=5 must be an integer in"
    ),
    f"{MULTI}: PRIMUS_PRETRAINED missing": (
        MULTI, {**NODE, "PRIMUS_PRETRAINED": "{tmp}/none"}, ExitCode.PRETRAINED,
        "has no config.json",
    ),
    f"{MULTI}: V4_TOKENIZER without tokenizer.json": (
        MULTI, {**NODE, "V4_TOKENIZER": "{tmp}"}, ExitCode.DATA, "has no tokenizer.json"
    ),
    f"{MULTI}: PRIMUS_EXTRA_SETS malformed": (
        MULTI, {**NODE, "PRIMUS_EXTRA_SETS": "oops"}, ExitCode.CONFIG, "is not key=value"
    ),
    "run_lora_flash_1node.sh: adapters on random weights": (
        "run_lora_flash_1node.sh", {}, ExitCode.CONFIG,
        "model.lora.rank=16 with no model.pretrained trains adapters on random weights",
    ),
    f"{MULTI}: PRIMUS_CP out of range for the world": (
        MULTI, {**NODE, "PRIMUS_CP": "5"}, ExitCode.CONFIG, "parallel.cp=5"
    ),
}  # fmt: skip

# Values taken literally, documented commands as written (a real launch: DRY_RUN=0).
CASES.update({
    "run_local.sh: PRIMUS_DATA_PATH holding ' #'": (
        "run_local.sh", {"PRIMUS_DATA_PATH": "{tmp}/rc/run #2/c.json"}, ExitCode.PATH,
        "rc/run #2/c.json",
    ),
    "run_local.sh: GBS not divisible by dp at a real launch": (
        "run_local.sh", {"DRY_RUN": "0", "NPROC": "2", "GBS": "1", "PRIMUS_DEVICE": "cpu"},
        ExitCode.CONFIG, "train.global_batch_size=1 must be divisible by",
    ),
})  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_knob_is_one_line_and_an_exit_status(name: str, tmp_path: Path) -> None:
    script, env, code, says = CASES[name]
    with read_only_dir(tmp_path) as ro:
        knobs = {k: v.format(tmp=tmp_path, ro=ro) for k, v in env.items()}
        run = run_recipe(script, tmp_path, **knobs)
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, run.stderr
    table = os.environ.get("PRIMUS_FAULT_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(json.dumps({"case": name, "exit": run.returncode, "message": errors[0]}) + "\n")
    assert says in errors[0], errors[0]
    assert run.returncode == code, f"exit {run.returncode}, wanted {int(code)}: {errors[0]}"
    assert run.stdout == ""
