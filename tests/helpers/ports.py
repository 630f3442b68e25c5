"""A free TCP port for a test's rendezvous (torchrun's --master_port, a gloo MASTER_PORT).

Asking the OS for port 0 and closing the socket leaves a window in which another process may be
handed the same ephemeral port, and with two pytest-xdist workers starting launches side by
side that window is hit. So each worker draws from its own block below Linux's ephemeral range
(32768-60999: the OS never hands those out on its own): worker gwN takes 20000 + 1000 N to
20999 + 1000 N, and a port is returned only after a bind to it succeeded.
"""

from __future__ import annotations

import os
import random
import socket

_BASE, _BLOCK = 20000, 1000


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = _BASE + _BLOCK * (int(worker) % 12 if worker.isdigit() else 0)
    candidates = random.sample(range(start, start + _BLOCK), 200)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + _BLOCK - 1} after 200 tries")
