"""Run a function on N gloo processes and collect per-rank results.

    results = run_ranks(fn, 4, arg1, arg2, timeout_s=90)

`fn(rank, world_size, *args)` should be a module-level function (spawned workers import it by
name; forked ones, the default, inherit it). Each worker gets RANK/WORLD_SIZE/MASTER_* like
torchrun, one torch thread, and an initialized gloo process group whose timeout is the harness
timeout, so a hung collective fails instead of hanging. The first failing rank's traceback is
raised in the parent; a rank that dies without reporting (segfault, SIGKILL) or a run past
`timeout_s` also raises, and every worker still alive is killed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ports import free_port


class RankFailed(RuntimeError):
    """A worker raised, died or timed out; the message carries its traceback."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    timeout_s: float,
    init: bool,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N workers share 2 cores with other test runs
    try:
        if init:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if init and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    init_process_group: bool = True,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; results in rank order.

    start_method: "fork" (default on Linux: workers inherit the imported torch/megatron, which
    saves ~4 CPU-seconds of imports per worker) or "spawn" (`PRIMUS_TEST_START=spawn`).
    """
    ctx = mp.get_context(start_method or os.environ.get("PRIMUS_TEST_START", "fork"))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, results, timeout_s, init_process_group),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 30  # spawn + imports take a few seconds
    try:
        while len(done) < world_size:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                _check_alive(procs, done, deadline)
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            done[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(world_size)]


def _check_alive(procs: list[Any], done: dict[int, Any], deadline: float) -> None:
    for rank, p in enumerate(procs):
        # Exit code 0 means the worker reported; its message may still be in the queue.
        if rank not in done and not p.is_alive() and p.exitcode != 0:
            raise RankFailed(f"rank {rank} died without reporting (exit code {p.exitcode})")
    if time.monotonic() > deadline:
        missing = [r for r in range(len(procs)) if r not in done]
        raise RankFailed(f"ranks {missing} did not finish before the timeout")


REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "primus_v4" / "configs" / "runs" / "tiny_cpu_thd.yaml"
# The tiny run at seq 512 (256 rows per rank at CP 2 >= the 128 boundary rows), 2 packs a step,
# 3 steps, quiet: small enough for 4 gloo ranks on 2 cores.
TINY_SETTINGS = (
    "data.seq_length=512",
    "train.global_batch_size=2",
    "train.steps=3",
    "output.progress_bar=false",
    "output.plot=false",
)


def train_metrics(out: Path, cache: Path, world: int, *settings: str) -> list[dict]:
    """Run `primus-v4 train` on the tiny config (torchrun with `world` gloo processes when
    world > 1) writing to `out`, and return its metrics.jsonl rows."""
    items = [*TINY_SETTINGS, *settings, f"output.dir={out}"]
    module = ["-m", "primus_v4", "train", "--config", str(TINY_CONFIG)]
    module += [a for s in items for a in ("--set", s)]
    launcher = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world)]
    launcher += ["--master_port", str(free_port())]
    cmd = [sys.executable, *(launcher if world > 1 else []), *module]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # up to 4 ranks share 2 cores
        "PRIMUS_PACK_CACHE_DIR": str(cache / "packs"),
        "PRIMUS_PACK_LOCK_DIR": str(cache / "locks"),
    }
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
