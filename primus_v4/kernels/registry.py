"""One dispatch per hot op: the torch reference is always registered and defines the op; faster
backends register with a probe (can it run on this machine at all) and a per-call check (does it
take these tensors: device, dtype, alignment, shape).

Modules resolve their ops once at construction (`resolve(op)`), never inside `forward`.
Backend choice: the `backend` argument, else `PRIMUS_V4_KERNEL_BACKEND`, else auto. The variable
holds one backend for every op and/or `op=backend` entries, comma separated
(`triton`, `auto,sparse_attention=triton`, `sparse_attention=triton,grouped_experts=grouped_mm`).
Auto on a machine with a GPU tries, per call, the backends of `AUTO_ORDER` whose probe accepts
them, fastest first, and runs the first that takes the call (torch takes every call); on CPU it
runs the torch reference (the Triton interpreter is for correctness checks, far slower). The
choice and every refusal are logged once. An explicit backend that cannot run (unknown, not
registered for the op, its probe refuses, or it refuses a call) is an error that says why.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from primus_v4.environment import KERNEL_BACKEND_ENV, KERNEL_BACKENDS
from primus_v4.errors import ConfigError
from primus_v4.log import get_logger

log = get_logger(__name__)

BACKENDS = KERNEL_BACKENDS
AUTO_ORDER = ("primus_turbo", "triton", "grouped_mm", "torch")
"""Auto's preference on GPUs, fastest first: vendor kernels, our Triton kernels, torch's own
fused kernels, the reference."""
ENV_VAR = KERNEL_BACKEND_ENV

Probe = Callable[[], "str | None"]
Refuses = Callable[..., "str | None"]


@dataclass(frozen=True, kw_only=True)
class _Impl:
    fn: Callable
    probe: Probe
    """None when the backend can run on this machine, else why not (installed, version, GPU)."""
    refuses: Refuses | None
    """Called with the op's arguments: None when it takes this call, else why not."""


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What `resolve(op)` picks here: the backends tried in order, and why each other one was
    refused (the view `primus-v4 inspect kernels` prints)."""

    op: str
    wanted: str
    order: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def chosen(self) -> str:
        return self.order[0]

    def describe(self) -> str:
        tried = " -> ".join(self.order)
        why = "; ".join(f"{b}: {r}" for b, r in self.refused.items())
        return f"{self.op}: {tried} ({self.wanted})" + (f"; refused {why}" if why else "")


_OPS: dict[str, dict[str, _Impl]] = {}
_LOGGED: set[tuple[str, ...]] = set()


def _always() -> str | None:
    return None


def _log_once(*key: str, message: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("%s", message)


def has_gpu() -> bool:
    return torch.cuda.is_available()


def interpreting() -> bool:
    """Whether Triton kernels built from now on run in its interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def turbo_importable() -> str | None:
    """None when primus_turbo can be imported, else why not."""
    if importlib.util.find_spec("primus_turbo") is None:
        return "primus_turbo is not installed"
    return None


TRITON_MIN = (3, 0)  # tl.dot's input_precision and the reductions our kernels call
# Our Triton kernels: one program holds [BH, D] of q, do, dq and acc, so D stays in registers.
TRITON_MAX_HEAD_DIM = 1024


def triton_probe() -> str | None:
    """None when Triton kernels can run here: a GPU, or CPU tensors through the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not (has_gpu() or interpreting()):
        return "no GPU, and Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1)"
    import triton

    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])
    if version < TRITON_MIN:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, TRITON_MIN))}"
    return None


def register(
    op: str,
    backend: str,
    fn: Callable,
    *,
    probe: Probe = _always,
    refuses: Refuses | None = None,
) -> None:
    """Register `fn` as `backend`'s implementation of `op` (the torch one must always exist)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r} for op {op!r}; known: {BACKENDS}")
    _OPS.setdefault(op, {})[backend] = _Impl(fn=fn, probe=probe, refuses=refuses)


def available_ops() -> list[str]:
    return sorted(_OPS)


def requested(op: str, backend: str | None = None) -> tuple[str, str]:
    """(backend name, where it came from) for `op`: the argument, the env spec, or auto."""
    if backend is not None:
        return backend.strip().lower(), "the backend argument"
    spec = os.environ.get(ENV_VAR, "").strip().lower()
    default, per_op = "auto", {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            default = name
            continue
        if name.strip() not in _OPS:
            raise ConfigError(
                f"{ENV_VAR}={spec!r} names unknown kernel op {name.strip()!r}; "
                f"registered ops: {available_ops()}"
            )
        per_op[name.strip()] = value.strip()
    return per_op.get(op, default), ENV_VAR


def _cpu_reason(backend: str, probe_reason: str | None) -> str:
    if probe_reason is not None:
        return probe_reason
    if backend == "triton":
        return "auto runs the torch reference on CPU (ask for triton explicitly to interpret it)"
    return "auto runs the torch reference on CPU"


def choose(op: str, backend: str | None = None) -> Choice:
    """Which backends `resolve(op, backend)` would try, in order, and why the others are refused.
    Raises ConfigError for an explicit backend that cannot run here."""
    if op not in _OPS:
        raise ConfigError(f"unknown kernel op {op!r}; registered ops: {available_ops()}")
    wanted, source = requested(op, backend)
    if wanted not in ("auto", *BACKENDS):
        raise ConfigError(
            f"unknown kernel backend {wanted!r} for op {op!r} (from {source}); "
            f"use one of auto, {', '.join(BACKENDS)}"
        )
    impls = _OPS[op]
    if wanted != "auto":
        impl = impls.get(wanted)
        reason = impl.probe() if impl else f"no {wanted} kernel is registered for this op"
        if reason is not None:
            raise ConfigError(
                f"kernel backend {wanted!r} was requested for op {op!r} (from {source}) but "
                f"cannot run: {reason}. Use 'auto' or 'torch'."
            )
        return Choice(op=op, wanted=wanted, order=(wanted,))
    order, refused = [], {}
    gpu = has_gpu()
    for name in AUTO_ORDER:
        impl = impls.get(name)
        if impl is None:
            refused[name] = f"no {name} kernel is registered for this op"
            continue
        reason = impl.probe()
        if name != "torch" and not gpu:
            refused[name] = _cpu_reason(name, reason)
        elif reason is not None:
            refused[name] = reason
        else:
            order.append(name)
    return Choice(op=op, wanted="auto", order=tuple(order), refused=refused)


def kernel_table(backend: str | None = None) -> list[Choice]:
    """Every registered op's choice on this machine (ops living in other modules included once
    they are imported; `primus_v4.kernels` imports them all)."""
    return [choose(op, backend) for op in available_ops()]


def _explicit(op: str, name: str, impl: _Impl) -> Callable:
    if impl.refuses is None:
        return impl.fn
    fn, refuses = impl.fn, impl.refuses

    def checked(*args: Any, **kwargs: Any) -> Any:
        reason = refuses(*args, **kwargs)
        if reason is not None:
            raise ConfigError(
                f"kernel backend {name!r} was requested for op {op!r} but refuses this call: "
                f"{reason}. Use 'auto' or 'torch'."
            )
        return fn(*args, **kwargs)

    return checked


def _auto(op: str, impls: list[tuple[str, _Impl]]) -> Callable:
    """The first backend that takes each call (torch, last, takes all); refusals logged once."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        for name, impl in impls:
            reason = impl.refuses(*args, **kwargs) if impl.refuses else None
            if reason is None:
                return impl.fn(*args, **kwargs)
            _log_once(op, name, reason, message=f"kernel {op}: {name} refused a call: {reason}")
        raise AssertionError(f"no backend took a call of {op}")  # torch takes every call

    return dispatch


def resolve(op: str, backend: str | None = None) -> Callable:
    """The implementation of `op` to use. The choice is logged once per (op, choice), at INFO
    only where it is not the default (auto taking the torch reference); `primus-v4 inspect
    kernels` shows why each other backend was refused."""
    choice = choose(op, backend)
    impls = _OPS[op]
    if choice.wanted == "auto" and choice.order == ("torch",):
        log.debug("kernel %s", choice.describe())
    else:
        _log_once(op, *choice.order, message=f"kernel {op}: {' -> '.join(choice.order)} "
                  f"({choice.wanted}; `primus-v4 inspect kernels` says why)")  # fmt: skip
    if choice.wanted != "auto":
        return _explicit(op, choice.chosen, impls[choice.chosen])
    if len(choice.order) == 1:
        return impls[choice.chosen].fn
    return _auto(op, [(name, impls[name]) for name in choice.order])
