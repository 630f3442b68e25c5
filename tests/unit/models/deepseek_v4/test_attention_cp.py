"""Simulated context parallel: contiguous 2- and 4-way shards reproduce the unsharded attention.

Legend: S = pack rows, T = rows per shard, D = hidden.

Each shard runs in its own thread with an in-process comm: `left_rows` hands over the previous
shard's actual tensor rows and `gather_rows` concatenates every shard's pool in rank order, both
as plain autograd ops, so one backward over all shards is exactly what the real collectives
(boundary send / pool all-gather with a reduce-scatter backward) must reproduce.
"""

from __future__ import annotations

import threading

import pytest
import torch

from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import RowLayout

RATIOS = {"dense": 0, "csa": 4, "hca": 128}


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size


class ThreadComm:
    """SeqComm over threads of one process (tests only)."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.world.slots[self.rank] = x
        self.world.barrier.wait()
        got = list(self.world.slots)
        self.world.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got

    def left_rows(self, x_TX: torch.Tensor, n: int) -> torch.Tensor:
        got = self._exchange(x_TX)
        if self.rank == 0:
            return x_TX.new_zeros((n, *x_TX.shape[1:]))
        prev = got[self.rank - 1]
        assert prev.shape[0] >= n, "a shard must hold at least the boundary rows"
        return prev[prev.shape[0] - n :]

    def gather_rows(self, x_PX: torch.Tensor) -> torch.Tensor:
        got = self._exchange(x_PX)
        assert len({g.shape for g in got}) == 1, "pool capacity must be equal on all ranks"
        return torch.cat(got, dim=0)


def _run_sharded(att: Attention, x_SD, pos_S, cu, size: int) -> torch.Tensor:
    world, t = _World(size), x_SD.shape[0] // size
    outs: list[torch.Tensor | None] = [None] * size
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            comm = ThreadComm(world, rank)
            layout = RowLayout.from_cu_seqlens(cu, local_rows=t, comm=comm)
            rows = slice(rank * t, (rank + 1) * t)
            outs[rank] = att(x_SD[rows], positions_T=pos_S[rows], layout=layout)
        except BaseException as e:  # surface the first failure instead of a barrier timeout
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return torch.cat(outs)


# Lengths straddle shard edges; 640 rows = 4 x 160 so every shard holds >= 128 boundary rows.
LENS = [1, 3, 37, 130, 9, 300, 20, 140]


@pytest.mark.parametrize("kind", ["dense", "csa", "hca"])
@pytest.mark.parametrize("size", [2, 4])
def test_sharded_equals_unsharded(kind: str, size: int) -> None:
    cfg = DeepseekV4Config.preset(
        "tiny", attn_sliding_window=16, init_method_std=0.2, index_topk=8, index_topk_chunk=16
    )
    torch.manual_seed(0)
    att = Attention(cfg, compress_ratio=RATIOS[kind], layer_idx=1)
    with torch.no_grad():
        att.attn_sink.normal_()
    cu = torch.tensor([0, *LENS]).cumsum(0)
    s = int(cu[-1])
    full = RowLayout.from_cu_seqlens(cu, local_rows=s)
    pos = torch.arange(s) - full.seq_start_T
    x = torch.randn(s, cfg.hidden_size, requires_grad=True)
    g = torch.randn(s, cfg.hidden_size)

    y = att(x, positions_T=pos, layout=full)
    (y * g).sum().backward()
    ref_x, ref_p = (
        x.grad.clone(),
        {n: p.grad.clone() for n, p in att.named_parameters() if p.grad is not None},
    )
    x.grad = None
    att.zero_grad()

    y_cp = _run_sharded(att, x, pos, cu, size)
    (y_cp * g).sum().backward()
    # float32, O(1) values; only chunk boundaries and summation order differ.
    torch.testing.assert_close(y_cp, y, rtol=0, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_x, rtol=0, atol=1e-5)
    for n, ref in ref_p.items():  # sums over 640 rows: relative to the largest entry
        p = dict(att.named_parameters())[n]
        assert (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max(), n
