"""Parallel sizes, their validation, and the process groups of one rank.

The rank layout is megatron-core's (`parallel_state.initialize_model_parallel`, order
tp-cp-ep-dp-pp): neighbouring ranks share a CP group first, then DP, then PP. Experts are laid
out as megatron does too: expert-DP x EP x ETP x PP covers the world, independent of CP, so an
EP group folds over the DP x CP ranks of one pipeline stage.

megatron-core 0.16's `initialize_model_parallel` only touches `torch.cuda` for SHARP and
`update_pg_timeout`, neither of which we use, so it runs unchanged on CPU with gloo (checked by
tests/distributed/test_dist_groups.py). We ask it not to create its duplicate gloo groups: we do
not use megatron's distributed optimizer, the only consumer of those.

The groups are handed to layers through `ParallelContext`; model code never calls
`parallel_state.get_*` inside `forward`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from primus_v4.errors import PrimusError
from primus_v4.mcore import megatron_import

with megatron_import():
    from megatron.core import parallel_state as ps
from primus_v4.log import get_logger
from primus_v4.parallel.dims import ParallelDims

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class Axis:
    """One parallel axis as seen by this rank: its group (None = this rank alone), rank in the
    group, group size, and the global ranks of the group in group order."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: tuple[int, ...]

    @classmethod
    def alone(cls, global_rank: int = 0) -> Axis:
        return cls(group=None, rank=0, size=1, ranks=(global_rank,))

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Axis:
        ranks = tuple(dist.get_process_group_ranks(group))
        return cls(group=group, rank=dist.get_rank(group), size=len(ranks), ranks=ranks)


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """Everything a layer needs to know about parallelism, passed explicitly.

    An axis of size 1 may carry `group=None` (see `ParallelContext.single`); collectives over
    such an axis are no-ops and layers should test `axis.size == 1` before communicating.
    """

    dims: ParallelDims
    rank: int
    device: torch.device
    pp: Axis
    cp: Axis
    dp: Axis
    dp_cp: Axis
    ep: Axis
    expert_dp: Axis

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        """One process, no torch.distributed needed (unit tests, tiny CPU runs)."""
        alone = Axis.alone()
        return cls(
            dims=ParallelDims(world=1),
            rank=0,
            device=torch.device(device),
            pp=alone,
            cp=alone,
            dp=alone,
            dp_cp=alone,
            ep=alone,
            expert_dp=alone,
        )

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.cp.group

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        return self.dp_cp.group

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.dims.world}: pp {self.pp.rank}/{self.pp.size} "
            f"cp {self.cp.rank}/{self.cp.size} dp {self.dp.rank}/{self.dp.size} "
            f"ep {self.ep.rank}/{self.ep.size} expert_dp {self.expert_dp.rank}/"
            f"{self.expert_dp.size}"
        )


def default_backend() -> str:
    # On ROCm builds torch.cuda is HIP and "nccl" selects RCCL.
    return "nccl" if torch.cuda.is_available() else "gloo"


def _ensure_process_group(world: int, backend: str, timeout: timedelta) -> None:
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise PrimusError(
                f"parallel.world={world} but torch.distributed was initialized with "
                f"{dist.get_world_size()} ranks; launch with torchrun --nproc-per-node/--nnodes "
                "matching the configured sizes"
            )
        return
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # A single process needs no rendezvous; an in-memory store avoids picking a port.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    launcher_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    missing = [k for k in launcher_vars if k not in os.environ]
    if missing:
        raise PrimusError(
            f"world size {world} needs a launcher: environment variables {missing} are unset "
            "(start with torchrun)"
        )
    if int(os.environ["WORLD_SIZE"]) != world:
        raise PrimusError(
            f"parallel.world={world} but WORLD_SIZE={os.environ['WORLD_SIZE']} from the launcher"
        )
    dist.init_process_group(backend, timeout=timeout)


def init_parallel(
    dims: ParallelDims, backend: str | None = None, *, timeout_minutes: float = 30.0
) -> ParallelContext:
    """Initialize torch.distributed (if needed) and megatron's rank layout; return the groups.

    Call `destroy_parallel()` before initializing a different layout in the same process.
    """
    backend = backend or default_backend()
    timeout = timedelta(minutes=timeout_minutes)
    device = torch.device("cpu")
    if backend != "gloo" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    _ensure_process_group(dims.world, backend, timeout)
    if ps.model_parallel_is_initialized():
        raise PrimusError(
            "megatron parallel_state is already initialized in this process; call "
            "primus_v4.parallel.groups.destroy_parallel() before init_parallel again"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep,
            expert_tensor_parallel_size=dims.etp,
            distributed_timeout_minutes=timeout_minutes,  # a timedelta's minutes: any float
            order="tp-cp-ep-dp-pp",
            create_gloo_process_groups=False,
        )
    ctx = ParallelContext(
        dims=dims,
        rank=dist.get_rank(),
        device=device,
        pp=Axis.of(ps.get_pipeline_model_parallel_group()),
        cp=Axis.of(ps.get_context_parallel_group()),
        dp=Axis.of(ps.get_data_parallel_group()),
        dp_cp=Axis.of(ps.get_data_parallel_group(with_context_parallel=True)),
        ep=Axis.of(ps.get_expert_model_parallel_group()),
        expert_dp=Axis.of(ps.get_expert_data_parallel_group()),
    )
    log.info("parallel layout (%s, backend %s): %s", _dims_str(dims), backend, ctx.describe())
    return ctx


def destroy_parallel(*, process_group: bool = False) -> None:
    """Forget megatron's groups (and, if asked, the default process group)."""
    ps.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def _dims_str(dims: ParallelDims) -> str:
    return (
        f"world {dims.world} = pp {dims.pp} x cp {dims.cp} x dp {dims.dp}; "
        f"ep {dims.ep} x expert_dp {dims.expert_dp}"
    )
