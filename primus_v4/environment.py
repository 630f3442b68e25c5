"""The environment variables the package reads, checked in one place before any command works.

A launcher (torchrun, SLURM, Kubernetes, a shell recipe) or a user sets these; a value of the
wrong kind used to surface as a traceback deep inside a run (`RANK=x` after packing), or was
ignored. `check_environment()` is called by the CLI before every command and names each bad
value in one line; the readers below it stay simple because the values were checked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from primus_v4.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The levels the docs name; logging's other names (WARN, FATAL, NOTSET) are taken too."""
KERNEL_BACKENDS = ("torch", "grouped_mm", "triton", "primus_turbo")
KERNEL_BACKEND_ENV = "PRIMUS_V4_KERNEL_BACKEND"
TURBO_FP8_ENV = "PRIMUS_V4_TURBO_FP8"
TURBO_FP8_MODES = ("", "0", "off", "bf16", "tensorwise", "rowwise", "blockwise")

# name -> (smallest allowed value, largest or None); an empty value counts as unset, as the
# launchers leave some of them empty
_INTEGERS: dict[str, tuple[int, int | None]] = {
    "WORLD_SIZE": (1, None),
    "RANK": (0, None),
    "LOCAL_WORLD_SIZE": (1, None),
    "LOCAL_RANK": (0, None),
    "MASTER_PORT": (1, 65535),
    "TORCHELASTIC_RESTART_COUNT": (0, None),
    "SLURM_RESTART_COUNT": (0, None),
}


def _integer(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.lstrip("-").isdigit() or len(raw) > 18:
        raise ConfigError(f"{name}={raw!r} is not an integer")
    return int(raw)


def _problems(env: Mapping[str, str]) -> list[str]:
    problems, values = [], {}
    for name, (low, high) in _INTEGERS.items():
        try:
            value = _integer(env, name)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if value is None:
            continue
        values[name] = value
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            problems.append(f"{name}={value} must be {bound}")
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in values and size in values and not 0 <= values[rank] < values[size]:
            problems.append(f"{rank}={values[rank]} is not below {size}={values[size]}")
    level = env.get("PRIMUS_LOG_LEVEL", "").strip()
    if level and level.upper() not in logging.getLevelNamesMapping():
        levels = ", ".join(LOG_LEVELS)
        problems.append(f"PRIMUS_LOG_LEVEL={level!r} is not a log level; use {levels}")
    fp8 = env.get(TURBO_FP8_ENV, "").strip().lower()
    if fp8 not in TURBO_FP8_MODES:
        problems.append(
            f"{TURBO_FP8_ENV}={fp8!r} is not an FP8 mode; use tensorwise, rowwise, blockwise or "
            "leave it unset"
        )
    problems += kernel_spec_problems(env.get(KERNEL_BACKEND_ENV, ""))
    return problems


def kernel_spec_problems(spec: str, source: str = KERNEL_BACKEND_ENV) -> list[str]:
    """The backend names in `PRIMUS_V4_KERNEL_BACKEND` (`auto`, `triton`, `auto,op=backend`);
    the op names are checked against the registered ops where the kernels are loaded."""
    known = ("auto", *KERNEL_BACKENDS)
    problems = []
    for item in filter(None, (s.strip() for s in spec.strip().lower().split(","))):
        name, eq, value = item.partition("=")
        backend = value.strip() if eq else name.strip()
        if eq and not name.strip():
            problems.append(f"{source}={spec!r}: entry {item!r} names no op")
        elif backend not in known:
            problems.append(
                f"{source}={spec!r}: unknown kernel backend {backend!r}; use one of "
                f"{', '.join(known)}"
            )
    return problems


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError naming every environment value of the wrong kind (integers that are not
    integers or out of range, a rank not below its world size, an unknown log level, FP8 mode or
    kernel backend)."""
    problems = _problems(os.environ if env is None else env)
    if problems:
        raise ConfigError("environment: " + "; ".join(problems))
