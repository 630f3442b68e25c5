"""Preemption: SIGTERM (what schedulers send before killing a job) or SIGUSR1 (a common
`--signal` choice for an early warning) asks the run to stop after the current step, save a
checkpoint and exit 0 (a run without checkpoint.dir saves nothing and exits 128 + the signal's
number, so a scheduler sees an unfinished run); a second signal exits at once.

Ranks may receive the signal at different moments, so the stop is agreed: after each step every
rank contributes its flag to one MAX all-reduce (a single scalar), and all ranks stop after the
same step. Handlers are installed only while the training loop runs, on the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from primus_v4.log import get_logger

log = get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """The flag the handlers set; `agreed()` is the collective decision."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.signal_name: str | None = None
        self.signum: int | None = None
        """The signal's number (the highest one when ranks got different signals)."""
        self.device = device

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            # Second signal: the user (or scheduler) insists; no save, no cleanup.
            os.write(2, f"{name} again: exiting now without saving\n".encode())
            os._exit(128 + signum)
        self.signal_name, self.signum = name, signum
        os.write(2, f"{name} received: finishing the current step, then saving\n".encode())

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (collective when distributed)."""
        local = self.signum or 0
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local > 0
        flag = torch.tensor([float(local)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        got = int(flag.item())
        if got > 0 and self.signal_name is None:
            self.signum = got
            self.signal_name = f"{signal.Signals(got).name} on another rank"
        return got > 0


@contextmanager
def stop_on_signals(device: torch.device | str = "cpu") -> Iterator[StopRequest]:
    """Install the handlers for the duration of the block (main thread only: elsewhere Python
    cannot install handlers, and the block runs without them)."""
    request = StopRequest(device)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous: dict[int, Any] = {s: signal.signal(s, request._handle) for s in SIGNALS}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
