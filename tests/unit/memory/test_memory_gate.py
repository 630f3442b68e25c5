"""The launch gate: a plan over the device's memory stops a dry run and a launch with one line
naming the stage, the planned and the available GiB, unless the named override is set."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from primus_v4.commands import train
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ConfigError
from primus_v4.memory import gate as memory_gate
from primus_v4.memory.plan import GIB, plan_memory


def _train(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    rc = train.run(parser.parse_args(["--set", "data.seq_length=256", *argv]))
    out, err = capsys.readouterr()
    return rc, out, err


def _planned_gib(*settings: str) -> float:
    run = resolve_run(load_config(overrides=["data.seq_length=256", *settings]), world=1)
    return max(p.device_total for p in plan_memory(run)) / GIB


def test_a_dry_run_over_the_device_stops_with_one_line(capsys) -> None:
    need = _planned_gib()
    rc, out, err = _train(capsys, "--dry-run", "--device-memory", f"{need * 0.9:.6f}")
    assert rc == 3 and out == ""  # no resolved config: the run would not fit
    assert "pipeline stage 0:" in err  # the plan is printed first
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(r"primus-v4 train: error: memory plan: pipeline stage 0 needs "
                         r"([\d.]+) GiB per GPU, more than the ([\d.]+) GiB of the device .*",
                         last)  # fmt: skip
    assert match, last
    assert float(match.group(1)) == pytest.approx(need, abs=0.05)  # printed to 0.1 GiB
    assert float(match.group(2)) == pytest.approx(need * 0.9, abs=0.05)
    assert memory_gate.OVERRIDE in last and memory_gate.RECIPE_OVERRIDE in last
    assert sum("error" in line for line in err.splitlines()) == 1


def test_the_override_launches_anyway_and_a_fitting_plan_passes(capsys) -> None:
    need = _planned_gib()
    small = f"{need * 0.9:.6f}"
    rc, out, err = _train(capsys, "--dry-run", "--device-memory", small,
                          "--set", "train.ignore_memory_plan=true")  # fmt: skip
    assert rc == 0 and "error" not in err
    assert json.loads(out)["train"]["ignore_memory_plan"] is True
    rc, out, err = _train(capsys, "--dry-run", "--device-memory", f"{need * 1.1:.6f}")
    assert rc == 0 and "busiest stage vs MI300X" in err and json.loads(out)


def test_a_dry_run_without_a_device_plans_nothing(capsys) -> None:
    rc, _, err = _train(capsys, "--dry-run")
    assert rc == 0 and "pipeline stage" not in err


def test_every_stage_is_checked_and_the_busiest_named() -> None:
    run = resolve_run(load_config(overrides=["data.seq_length=256", "parallel.pp=2",
                                             "model.overrides.num_layers=2",
                                             "model.overrides.compress_ratios=[0,4]"]),
                      world=2)  # fmt: skip
    plans = plan_memory(run)
    low = min(p.device_total for p in plans) / GIB
    busiest = max(plans, key=lambda p: p.device_total)
    with pytest.raises(memory_gate.MemoryPlanError, match=f"stage {busiest.stage} needs") as exc:
        memory_gate.check_fits(plans, device="X", gib=low * 0.99, ignore=False)
    assert "(2 of 2 stages over)" in str(exc.value) and "\n" not in str(exc.value)
    memory_gate.check_fits(plans, device="X", gib=low * 0.99, ignore=True)


def test_device_names_and_sizes() -> None:
    assert memory_gate.parse_device("mi355x") == ("MI355X", 288.0)
    assert memory_gate.parse_device("100") == ("the device", 100.0)
    with pytest.raises(ConfigError, match="MI300X"):
        memory_gate.parse_device("H100")
