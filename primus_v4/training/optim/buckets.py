"""The gradient buckets of the sharded optimizer: where each parameter's chunk sits in a rank-major
bucket, and the flat scatter / gather between a parameter and its chunks (zero.py uses them).

Legend: n = ranks of a parameter's replica axis, N = a parameter's numel, c = ceil(N / n) its
chunk, S = one rank's segment of a bucket (sum of its parameters' chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from primus_v4.parallel.groups import Axis


@dataclass(kw_only=True, eq=False)
class Slot:
    """One parameter in its bucket; `lo:hi` is this rank's flat range of it."""

    name: str
    param: nn.Parameter
    group: int  # 0 = weight-decayed, 1 = not decayed
    expert: bool
    bucket: int = -1
    offset: int = 0  # start of its chunk inside a rank segment
    chunk: int = 0  # c
    lo: int = 0
    hi: int = 0
    master: torch.Tensor | None = None  # fp32 [hi - lo]: a view of the parameter or a copy
    aliased: bool = False  # the master is the parameter's own storage (fp32, not offloaded)
    grad: torch.Tensor | None = None  # fp32 [hi - lo]: this rank's reduced gradient
    calls: int = 0  # hook calls this step (one per micro-batch that reached the parameter)

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(kw_only=True, eq=False)
class Bucket:
    axis: Axis
    index: int
    slots: list[Slot] = field(default_factory=list)
    segment: int = 0  # S
    grad: torch.Tensor | None = None  # grad_dtype (lean: bf16) [n * S], rank-major
    shard: torch.Tensor | None = None  # grad_dtype [S]: this rank's reduced segment
    lean: bool = False  # bf16 `grad`; `shard` / `reduced` exist from the reduction to the step
    send: torch.Tensor | None = None  # lean, n > 1: the float32 copy being reduce-scattered
    reduced: torch.Tensor | None = None  # fp32 [S]: `shard` rounded (is `shard` in fp32)
    work: Any = None
    launched: bool = False
    deferred: bool = False  # holds a parameter whose gradient is finished after backward
    expected: int = 0
    done: int = 0

    def buffer_bytes(self) -> int:
        held = [t for t in (self.grad, self.shard, self.reduced, self.send) if t is not None]
        distinct = {id(t): t for t in held}.values()
        return sum(t.numel() * t.element_size() for t in distinct)

    def itemsize(self, opt: Any) -> int:
        """Bytes per gradient element in this bucket under `opt` (a `ShardedAdamW`)."""
        return (opt.grad_dtype if self.deferred else opt.accum_dtype).itemsize

    def chunk_view(self, slot: Slot, buffer: torch.Tensor) -> torch.Tensor:
        """[n, c] strided view of `slot`'s chunks inside a rank-major [n * S] buffer."""
        n = self.axis.size
        return buffer.view(n, self.segment)[:, slot.offset : slot.offset + slot.chunk]


def scatter_flat(dst_nc: torch.Tensor, src_N: torch.Tensor, *, add: bool) -> None:
    """dst[r, j] (op)= src[r c + j] for the N valid entries (the last chunk may be short)."""
    c = dst_nc.shape[1]
    full, rem = divmod(src_N.numel(), c)
    op = torch.Tensor.add_ if add else torch.Tensor.copy_
    if full:
        op(dst_nc[:full], src_N[: full * c].view(full, c))
    if rem:
        op(dst_nc[full, :rem], src_N[full * c :])


def gather_flat(dst_N: torch.Tensor, src_nc: torch.Tensor) -> None:
    c = src_nc.shape[1]
    full, rem = divmod(dst_N.numel(), c)
    if full:
        dst_N[: full * c].view(full, c).copy_(src_nc[:full])
    if rem:
        dst_N[full * c :].copy_(src_nc[full, :rem])
