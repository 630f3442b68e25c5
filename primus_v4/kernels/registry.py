"""One dispatch per hot op: the torch reference is always registered; faster backends register
themselves with a probe that says whether they can run here.

Modules resolve their ops once at construction (`resolve(op)`), never inside `forward`.
Backend choice: the `backend` argument, else `PRIMUS_V4_KERNEL_BACKEND` (auto | torch |
primus_turbo), else auto. Auto picks primus_turbo when it is importable and its probe accepts the
op, otherwise torch; the choice is logged once per op. Asking explicitly for a backend that cannot
run (not installed, op not wired, unknown name) is an error that says why.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

from primus_v4.errors import ConfigError
from primus_v4.log import get_logger

log = get_logger(__name__)

BACKENDS = ("torch", "primus_turbo")
ENV_VAR = "PRIMUS_V4_KERNEL_BACKEND"


@dataclass(frozen=True)
class _Impl:
    fn: Callable
    probe: Callable[[], str | None]
    """Returns None when the implementation can run here, else the reason it cannot."""


_OPS: dict[str, dict[str, _Impl]] = {}
_LOGGED: set[tuple[str, str]] = set()


def _always() -> str | None:
    return None


def turbo_importable() -> str | None:
    """None when primus_turbo can be imported, else why not."""
    if importlib.util.find_spec("primus_turbo") is None:
        return "primus_turbo is not installed"
    return None


def register(op: str, backend: str, fn: Callable, *, probe: Callable[[], str | None] = _always):
    """Register `fn` as `backend`'s implementation of `op` (the torch one must always exist)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r} for op {op!r}; known: {BACKENDS}")
    _OPS.setdefault(op, {})[backend] = _Impl(fn, probe)


def available_ops() -> list[str]:
    return sorted(_OPS)


def resolve(op: str, backend: str | None = None) -> Callable:
    """The implementation of `op` to use; logs the selection once per (op, backend)."""
    if op not in _OPS:
        raise ConfigError(f"unknown kernel op {op!r}; registered ops: {available_ops()}")
    wanted = (backend or os.environ.get(ENV_VAR, "auto")).strip().lower()
    if wanted not in ("auto", *BACKENDS):
        raise ConfigError(
            f"unknown kernel backend {wanted!r} for op {op!r} (from the argument or {ENV_VAR}); "
            f"use one of auto, {', '.join(BACKENDS)}"
        )
    impls = _OPS[op]
    if wanted == "auto":
        turbo = impls.get("primus_turbo")
        reason = turbo.probe() if turbo else "no primus_turbo kernel is wired for this op"
        chosen = "primus_turbo" if reason is None else "torch"
        note = "" if reason is None else f" (primus_turbo not used: {reason})"
    else:
        chosen, note = wanted, ""
        impl = impls.get(wanted)
        reason = impl.probe() if impl else f"no {wanted} kernel is registered for this op"
        if reason is not None:
            raise ConfigError(
                f"kernel backend {wanted!r} was requested for op {op!r} but cannot run: {reason}. "
                f"Use backend 'auto' or 'torch'."
            )
    if (op, chosen) not in _LOGGED:
        _LOGGED.add((op, chosen))
        log.info("kernel %s: using the %s backend%s", op, chosen, note)
    return impls[chosen].fn
