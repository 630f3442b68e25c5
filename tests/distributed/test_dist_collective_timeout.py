"""parallel.collective_timeout_s reaches every process group: on 2 gloo ranks whose rank 1 never
joins, rank 0's collective fails after the configured seconds, on the default group and on
megatron's data-parallel group alike (the error that torchrun's elastic agent turns into a
restart, instead of a hang until the scheduler's own limit)."""

from __future__ import annotations

import time

from harness import run_ranks

TIMEOUT_S = 2.0


def _rank(rank: int, world: int) -> dict[str, tuple[float, str]]:
    import torch
    import torch.distributed as dist

    from primus_v4.parallel.dims import ParallelDims
    from primus_v4.training.runtime import init_runtime

    runtime = init_runtime(ParallelDims(world=world), collective_timeout_s=TIMEOUT_S)
    waits: dict[str, tuple[float, str]] = {}
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)  # a hung peer: never enters the collectives below
        return waits
    for name, group in (("world", None), ("dp", runtime.ctx.dp.group)):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            waits[name] = (time.monotonic() - start, "completed")
        except RuntimeError as exc:
            waits[name] = (time.monotonic() - start, str(exc))
    return waits


def test_a_hung_collective_fails_after_the_configured_timeout() -> None:
    rank0, rank1 = run_ranks(_rank, 2, timeout_s=60, init_process_group=False)
    assert rank1 == {}
    for name in ("world", "dp"):
        waited, message = rank0[name]
        # gloo names its timeout in ms; the wait is the timeout plus scheduling noise.
        assert "Timed out" in message and "2000ms" in message, (name, message)
        assert TIMEOUT_S <= waited < TIMEOUT_S + 3, (name, waited)
