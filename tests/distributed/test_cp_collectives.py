"""CP collectives on real gloo process groups: exact (bitwise) forward and backward.

Legend: T = rows per rank, n = boundary rows, C = pool slots per rank, X = feature dims.
Every tensor holds small integers (exact in float32 under any summation order), so the expected
values are compared with `torch.equal`, not a tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from primus_v4.parallel.context_parallel import ContextParallelError, CpComm

T, N, C, X = 12, 5, 3, 4


def _ints(rank: int, rows: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-50, 50, (rows, X), generator=g).to(torch.float32)


def _collectives(rank: int, world: int) -> dict[str, torch.Tensor]:
    comm = CpComm(dist.group.WORLD)
    assert (comm.rank, comm.size) == (rank, world)
    out: dict[str, torch.Tensor] = {}

    x = _ints(rank, T, 1).requires_grad_(True)
    left = comm.left_rows(x, N)
    left.backward(_ints(rank, N, 2))
    out["left"], out["left_grad"] = left.detach(), x.grad

    p = _ints(rank, C, 3).requires_grad_(True)
    pool = comm.gather_rows(p)
    g = _ints(rank, world * C, 4)
    g_before = g.clone()
    pool.backward(g)
    assert torch.equal(g, g_before), "the gather backward mutated grad_output"
    out["pool"], out["pool_grad"] = pool.detach(), p.grad

    s = _ints(rank, 2, 5).requires_grad_(True)
    total = comm.all_reduce_sum(s)
    total.backward(_ints(rank, 2, 6))
    out["sum"], out["sum_grad"] = total.detach(), s.grad

    try:
        comm.left_rows(x, T + 1)
    except ContextParallelError as e:
        out["error"] = torch.tensor(int("fewer" in str(e) or "only" in str(e)))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_boundary_gather_and_sum_are_exact(world: int) -> None:
    res = run_ranks(_collectives, world, timeout_s=60)
    zeros_n = torch.zeros(N, X)
    for r in range(world):
        # Forward: the previous rank's last N rows; rank 0 receives zeros.
        want = zeros_n if r == 0 else _ints(r - 1, T, 1)[T - N :]
        assert torch.equal(res[r]["left"], want)
        # Backward: my tail rows get the next rank's boundary gradient; the last rank gets none,
        # and rank 0's gradient of its zero rows is dropped.
        grad = torch.zeros(T, X)
        if r + 1 < world:
            grad[T - N :] = _ints(r + 1, N, 2)
        assert torch.equal(res[r]["left_grad"], grad)

        pool = torch.cat([_ints(q, C, 3) for q in range(world)])
        assert torch.equal(res[r]["pool"], pool)
        # Reduce-scatter: the sum over ranks of every rank's gradient of my block.
        summed = sum(_ints(q, world * C, 4) for q in range(world))
        assert torch.equal(res[r]["pool_grad"], summed[r * C : (r + 1) * C])

        assert torch.equal(res[r]["sum"], sum(_ints(q, 2, 5) for q in range(world)))
        assert torch.equal(res[r]["sum_grad"], sum(_ints(q, 2, 6) for q in range(world)))
        assert int(res[r]["error"]) == 1


def _reduce_scatter_equivalence(rank: int, world: int) -> torch.Tensor:
    """The gather's backward equals an explicit reduce-scatter built from all-reduce + slice on
    random (non-integer) values: the same additions in the same order, so bitwise."""
    comm = CpComm(dist.group.WORLD)
    torch.manual_seed(rank)
    p = torch.randn(C, X, requires_grad=True)
    g = torch.randn(world * C, X)
    comm.gather_rows(p).backward(g)
    ref = g.clone()
    dist.all_reduce(ref)
    return (p.grad - ref[rank * C : (rank + 1) * C]).abs().max()


def test_gather_backward_is_reduce_scatter() -> None:
    for diff in run_ranks(_reduce_scatter_equivalence, 2, timeout_s=60):
        assert float(diff) == 0.0
