"""The environment variables the package reads, checked in one place before any command works.

A launcher (torchrun, SLURM, Kubernetes, a shell recipe) or a user sets these; a value of the
wrong kind used to surface as a traceback deep inside a run (`RANK=x` after packing), or was
ignored. `check_environment()` is called by the CLI before every command and names each bad
value in one line; the readers below it stay simple because the values were checked.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from primus_v4.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The levels the docs name; logging's other names (WARN, FATAL, NOTSET) are taken too."""
KERNEL_BACKENDS = ("torch", "grouped_mm", "triton", "primus_turbo")
KERNEL_BACKEND_ENV = "PRIMUS_V4_KERNEL_BACKEND"
TURBO_FP8_ENV = "PRIMUS_V4_TURBO_FP8"
TURBO_FP8_MODES = ("", "0", "off", "bf16", "tensorwise", "rowwise", "blockwise")

# name -> (smallest allowed value, largest or None, whether an empty value counts as unset): the
# launchers leave the restart counts and NODE_RANK empty at times, and their readers take that as
# 0; RANK, WORLD_SIZE and LOCAL_RANK are read with int(), MASTER_PORT by torch's env://
# rendezvous, where an empty value fails
_INTEGERS: dict[str, tuple[int, int | None, bool]] = {
    "WORLD_SIZE": (1, None, False),
    "RANK": (0, None, False),
    "LOCAL_WORLD_SIZE": (1, None, True),
    "LOCAL_RANK": (0, None, False),
    "NODE_RANK": (0, None, True),
    "MASTER_PORT": (1, 65535, False),
    "TORCHELASTIC_RESTART_COUNT": (0, None, True),
    "SLURM_RESTART_COUNT": (0, None, True),
}
_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,17}")
"""An integer as the launchers write one. int() also takes ' 0', '00', '+0' and '-0', but the
commands compare RANK and NODE_RANK with '0' as text, where those would make rank 0 a follower
that never claims output.dir."""
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,255}")
"""A host name or an IPv4/IPv6 address (a zone and brackets included) for MASTER_ADDR; set at
all, it sends a single process to torch's env:// rendezvous, which fails on an empty one."""
# name -> the values it takes (any case); the package's switches are off for "0" (or empty) and
# on for anything else, so "false" or "off" would turn them on. Triton reads TRITON_INTERPRET
# (unstripped) as on for 1/true/on/yes/y, the kernel registry (stripped) for 1/true/on/yes: the
# words taken are those both read alike.
_SWITCHES: dict[str, tuple[str, ...]] = {
    "PRIMUS_V4_NATIVE_QUANT": ("", "0", "1"),
    "PRIMUS_V4_TRACEBACK": ("", "0", "1"),
    "PRIMUS_LOG_ALL_RANKS": ("", "0", "1"),
    "TRITON_INTERPRET": ("", "0", "1", "true", "false", "on", "off", "yes", "no"),
}


def _integer(env: Mapping[str, str], name: str, empty_unset: bool) -> int | None:
    raw = env.get(name)
    if raw is None or (empty_unset and raw == ""):
        return None
    if not _INTEGER.fullmatch(raw):
        raise ConfigError(
            f"{name}={raw!r} is not an integer as a launcher writes one (digits, '-' for a "
            "negative; no '+', spaces or leading zeros)"
        )
    return int(raw)


def _problems(env: Mapping[str, str]) -> list[str]:
    problems, values = [], {}
    for name, (low, high, empty_unset) in _INTEGERS.items():
        try:
            value = _integer(env, name, empty_unset)
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
    host = env.get("MASTER_ADDR")
    if host is not None and not _HOST.fullmatch(host):
        problems.append(f"MASTER_ADDR={host!r} is not a host name or address")
    for name, accepted in _SWITCHES.items():
        raw = env.get(name, "")
        if raw.lower() not in accepted:
            problems.append(f"{name}={raw!r} is not a switch; use 1 or 0")
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
    integers or out of range, a rank not below its world size, a MASTER_ADDR that is no host, a
    switch that is not 0 or 1, an unknown log level, FP8 mode or kernel backend)."""
    problems = _problems(os.environ if env is None else env)
    if problems:
        raise ConfigError("environment: " + "; ".join(problems))
