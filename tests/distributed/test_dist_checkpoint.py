"""Checkpoint on 2 gloo ranks: per-rank RNG and data position survive; resumed == uninterrupted."""

from __future__ import annotations

from pathlib import Path

import torch
from harness import run_ranks
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel
from primus_v4.training.checkpoint.store import CheckpointManager
from primus_v4.training.optim.lr_schedule import warmup_cosine
from primus_v4.training.optim.zero import ShardedAdamW


class RankData:
    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next(self) -> torch.Tensor:
        self.position += 1
        return torch.randn(
            4, 8, generator=torch.Generator().manual_seed(97 * self.rank + self.position)
        )

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _state(ctx, rank: int, seed: int) -> dict:
    torch.manual_seed(seed)  # replicas start equal; DP keeps them equal
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    # Optimizer state sharded over the two replicas (each rank owns half of every parameter).
    opt = ShardedAdamW(list(model.named_parameters()), ctx, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                       weight_decay=0.1, offload_fraction=0.5)  # fmt: skip
    sched = LambdaLR(opt, warmup_cosine(lr=1e-2, min_lr=1e-3, warmup_steps=1, total_steps=6))
    torch.manual_seed(1000 + rank)  # dropout masks differ per rank: RNG state is per rank
    return {"model": model, "optimizer": opt, "scheduler": sched, "data": RankData(rank)}


def _train(state: dict, start: int, stop: int, manager: CheckpointManager | None) -> list[float]:
    losses = []
    for step in range(start, stop):
        state["optimizer"].zero_grad()
        loss = state["model"](state["data"].next()).pow(2).mean()
        loss.backward()
        state["optimizer"].reduce_gradients()  # summed over both replicas
        state["optimizer"].step()
        state["scheduler"].step()
        losses.append(loss.item())
        if manager is not None:
            manager.maybe_save(step + 1, final=step + 1 == stop, **state)
    return losses


def _resume(rank: int, world: int, root: str) -> tuple[list[float], list[float]]:
    ctx = init_parallel(ParallelDims(world=world), backend="gloo")
    reference = _train(_state(ctx, rank, 0), 0, 6, None)
    first = _train(_state(ctx, rank, 0), 0, 3, CheckpointManager(root, interval=3))
    state = _state(ctx, rank, 42)
    manager = CheckpointManager(root, interval=3)
    assert manager.load_latest(**state) == 3
    resumed = first + _train(state, 3, 6, manager)
    destroy_parallel()
    return reference, resumed


def test_two_rank_resume(tmp_path: Path) -> None:
    for reference, resumed in run_ranks(_resume, 2, str(tmp_path), timeout_s=90):
        assert resumed == reference  # exact on each rank
    assert (tmp_path / "latest").read_text().strip() == "step_00000006"
