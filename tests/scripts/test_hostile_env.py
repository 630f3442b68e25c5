"""Launchers check every integer knob of the environment before any arithmetic: bash evaluates a
variable's value as an expression there, so `HOME[$(cmd)]` in NNODES would run cmd. Each script
stops in one line (exit 3) naming the knob, and the planted command never runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_runner import SCRIPTS, run_recipe

RECIPES = sorted(p.name for p in SCRIPTS.glob("*.sh"))
LAUNCHERS = [*RECIPES, "slurm/sbatch_recipe.sh", "k8s/entrypoint.sh"]
# what each launcher reads first; the recipes share the same knobs
KNOBS = ["NNODES", "PRIMUS_SEQ_LENGTH", "SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "GBS"]


@pytest.mark.parametrize("script", LAUNCHERS)
def test_a_hostile_integer_knob_runs_nothing(script: str, tmp_path: Path) -> None:
    for knob in KNOBS:
        marker = tmp_path / f"ran-{knob}"
        hostile = f"HOME[$(touch {marker})]"
        env = {knob: hostile, "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0",
               "PRIMUS_K8S_RECIPE": "run_local.sh"}  # fmt: skip
        run = run_recipe(script, tmp_path, timeout=60, **env)
        assert run.returncode == 3, (knob, run.stderr)
        line = f"error: {knob} must be a non-negative integer (decimal, no leading zero), got "
        line += f"'{hostile}'"
        assert run.stderr.strip().endswith(line) and run.stderr.count("\n") == 1, run.stderr
        assert not marker.exists(), f"{script} ran the command planted in {knob}"


@pytest.mark.parametrize("script", LAUNCHERS)
def test_a_leading_zero_is_refused_before_bash_reads_it_as_octal(
    script: str, tmp_path: Path
) -> None:
    """`SLURM_JOB_ID=09` was a raw bash error (exit 1); `010` would have been port offset 8."""
    for knob, value in (("SLURM_JOB_ID", "09"), ("PRIMUS_MAX_RESTARTS", "010")):
        env = {knob: value, "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0",
               "PRIMUS_K8S_RECIPE": "run_local.sh"}  # fmt: skip
        run = run_recipe(script, tmp_path, timeout=60, **env)
        assert run.returncode == 3, (knob, run.stderr)
        assert run.stderr.strip().endswith(f"no leading zero), got '{value}'"), run.stderr
