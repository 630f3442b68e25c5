"""A module fixture's value made once per test session, shared by the pytest-xdist workers."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

import pytest


def _shared(factory: pytest.TempPathFactory, name: str, make: Callable[[], str]) -> str:
    """`make()`, made once per session: the first pytest-xdist worker to ask makes it under a
    lock in the session's temp dir, the others wait for it and read it there."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    made = root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not made.exists():
            made.write_text(make())
        return made.read_text()
