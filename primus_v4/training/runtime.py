"""Process-level state of a run: the rank's `ParallelContext` (groups, device), torchrun-ready.

One process: `ParallelContext.single`, no torch.distributed. Under torchrun (WORLD_SIZE > 1):
`primus_v4.parallel.groups.init_parallel` starts the process group (gloo on CPU, RCCL/NCCL on
GPUs) and megatron-core's rank layout, and the trainer reads every group from the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from primus_v4.log import get_logger
from primus_v4.parallel.groups import ParallelContext, ParallelDims, destroy_parallel, init_parallel

log = get_logger(__name__)


@dataclass(kw_only=True)
class Runtime:
    ctx: ParallelContext
    sizes: ParallelDims
    owns_process_group: bool = False

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        return self.ctx.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp.rank

    @property
    def dp_size(self) -> int:
        return self.ctx.dp.size

    @property
    def count_group(self) -> Any:
        """Ranks whose tokens share one loss denominator (DP x CP); None = this rank alone."""
        return self.ctx.dp_cp.group if self.ctx.dp_cp.size > 1 else None

    def close(self) -> None:
        if self.owns_process_group:
            destroy_parallel(process_group=True)
            self.owns_process_group = False


def _local_device() -> torch.device:
    if torch.cuda.is_available():
        import os

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_runtime(sizes: ParallelDims, *, collective_timeout_s: float = 1800.0) -> Runtime:
    """Start (or join) the process groups described by the launcher's environment; every
    collective fails after `collective_timeout_s` (parallel.collective_timeout_s) instead of
    hanging."""
    if sizes.world == 1:
        return Runtime(ctx=ParallelContext.single(_local_device()), sizes=sizes)
    import torch.distributed as dist

    owns = not dist.is_initialized()
    ctx = init_parallel(sizes, timeout_minutes=collective_timeout_s / 60)
    log.info("parallel layout: %s", ctx.describe())
    return Runtime(ctx=ctx, sizes=sizes, owns_process_group=owns)
