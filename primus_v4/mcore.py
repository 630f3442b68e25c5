"""The one way this package imports megatron-core: quietly, and without paying for what we skip.

Importing `megatron.core.transformer` costs about 4.5 s of CPU per process before any work is
done (measured on 2 cores: torch 2.3 s, then megatron-core 6.8 s plain, 2.5 s through here),
and every rank of every launch and every dry-run subprocess pays it. Two parts of it are work
this package never uses:

- megatron-core decorates its fused bias/activation helpers with `torch.compile` at import
  (`megatron.core.jit.jit_fuser`), which loads dynamo and inductor (~3.5 s). The model here
  uses its own kernels, never those helpers; during the import `torch.compile` is replaced by
  a wrapper that compiles on first call, so a helper that is called still compiles, as before.
- `megatron.core.inference` probes for wandb (~1.2 s) for its own inference logging. During
  the import wandb reads as absent; the trackers (training/metrics) import it themselves later.

It also silences the import-time warnings that Transformer Engine / Apex are absent: the torch
fallbacks are what we use on CPU and ROCm. Both patches are undone when the import returns.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["megatron_import"]


def _compile_on_first_call(real: Callable[..., Any]) -> Callable[..., Any]:
    """A `torch.compile` look-alike that defers `real(fn, **options)` to fn's first call."""

    def compile_later(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:  # used as @torch.compile(mode=...)
            return lambda f: compile_later(f, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later


@contextlib.contextmanager
def megatron_import() -> Iterator[None]:
    """Wrap `from megatron.core... import ...` in this; a no-op once megatron-core is loaded."""
    if "megatron.core" in sys.modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
        return
    import torch  # here, not at module level: a dry run that never builds a model skips torch

    real_compile = torch.compile
    hide_wandb = "wandb" not in sys.modules
    torch.compile = _compile_on_first_call(real_compile)  # type: ignore[assignment]
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` -> ImportError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.compile = real_compile
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
