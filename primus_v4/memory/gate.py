"""The launch gate on the memory plan: print the per-rank plan, stop when a stage does not fit.

`primus-v4 train --dry-run --device-memory MI300X` (what the recipes' validation runs) and every
real launch on an accelerator (its own total memory) compute `memory_plan.plan_memory` for every
pipeline stage and stop with ONE line naming the stage, its planned GiB and the device's GiB when
any stage plans more than the device holds. `train.ignore_memory_plan: true` (recipes:
`PRIMUS_IGNORE_MEMORY_PLAN=1`) is the explicit override, named in the message.
"""

from __future__ import annotations

import math
from typing import Any

from primus_v4.errors import ConfigError
from primus_v4.memory.plan import GIB, MemoryPlan, plan_memory

DEVICES_GB = {"MI300X": 192.0, "MI308X": 192.0, "MI355X": 288.0}
OVERRIDE = "train.ignore_memory_plan=true"
RECIPE_OVERRIDE = "PRIMUS_IGNORE_MEMORY_PLAN=1"


class MemoryPlanError(ConfigError):
    """A pipeline stage plans more device memory than the device has."""


def parse_device(text: str) -> tuple[str, float]:
    """(name, GiB) of `MI300X` / `MI308X` / `MI355X` or a number of GiB."""
    if text.upper() in DEVICES_GB:
        return text.upper(), DEVICES_GB[text.upper()]
    try:
        gib = float(text)
    except ValueError:
        raise ConfigError(
            f"--device-memory {text!r}: give GiB or one of {sorted(DEVICES_GB)}"
        ) from None
    if not 0 < gib < math.inf:  # nan and inf fail this too
        raise ConfigError(f"--device-memory {text!r} must be a positive finite number of GiB")
    return "the device", gib


def accelerator_memory() -> tuple[str, float] | None:
    """(name, GiB) of this process's accelerator, None without one (a CPU run has no gate)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name or "GPU", props.total_memory / GIB


def header(run: Any, device: str, gib: float) -> str:
    s, c = run.sizes, run.cfg
    model = c.model.pretrained or c.model.preset  # a release is the model (its preset ignored)
    return (
        f"memory plan per rank: world {s.world} = pp {s.pp} x cp {s.cp} x dp "
        f"{s.world // (s.pp * s.cp)}, ep {s.ep}; {model} {c.model.dtype}, seq "
        f"{c.data.seq_length}, offload {c.optim.offload_fraction}, device "
        f"{device.removeprefix('the device')} ({gib:.0f} GiB), recompute "
        f"{recompute_label(run.model)}, gradient buffers {c.optim.grad_accum_dtype}"
    )


def recompute_label(model_cfg: Any) -> str:
    granularity = getattr(model_cfg, "recompute_granularity", None)
    if granularity == "selective":
        return "selective:" + ",".join(model_cfg.recompute_modules)
    return granularity or "none"


def summary(plans: list[MemoryPlan]) -> str:
    """One line: every stage's device peak and its share of each known device."""
    peaks = " / ".join(f"{p.device_total / GIB:.1f}" for p in plans)
    top = max(p.device_total for p in plans) / GIB
    shares = ", ".join(f"{name} {100 * top / gb:.0f}%" for name, gb in DEVICES_GB.items()
                       if name != "MI308X")  # fmt: skip
    return f"device GiB per stage: {peaks}; busiest stage vs {shares}"


def report(run: Any, plans: list[MemoryPlan], device: str, gib: float) -> str:
    """The printed plan: the header, one table per stage, the summary line."""
    lines = [header(run, device, gib), f"  {plans[0].attention}" if plans[0].attention else ""]
    return "\n".join([*filter(None, lines), *(p.table() for p in plans), summary(plans)])


def check_fits(plans: list[MemoryPlan], *, device: str, gib: float, ignore: bool) -> None:
    """Raise `MemoryPlanError` (one line) when a stage plans more than `gib` GiB."""
    over = [p for p in plans if p.device_total > gib * GIB]
    if not over or ignore:
        return
    worst = max(over, key=lambda p: p.device_total)
    raise MemoryPlanError(
        f"memory plan: pipeline stage {worst.stage} needs {worst.device_total / GIB:.1f} GiB "
        f"per GPU, more than the {gib:.1f} GiB of {device} ({len(over)} of {len(plans)} "
        f"stages over); "
        f"recompute more (model.recompute), offload more (optim.offload_fraction) or change "
        f"the layout, or set {OVERRIDE} ({RECIPE_OVERRIDE}) to launch anyway"
    )


def gate(run: Any, device: tuple[str, float], *, printer: Any = None) -> list[MemoryPlan]:
    """Plan every stage of `run` for `device`, print it with `printer` (None: quiet), then stop
    when a stage does not fit (unless `train.ignore_memory_plan`)."""
    name, gib = device
    plans = plan_memory(run, device_gb=gib)
    if printer is not None:
        printer(report(run, plans, name, gib))
    check_fits(plans, device=name, gib=gib, ignore=run.cfg.train.ignore_memory_plan)
    return plans
