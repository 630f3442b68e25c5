"""fp32 master weights and a ZeRO-1 AdamW: optimizer state sharded over each parameter's replicas.

Legend: n = ranks of a parameter's replica axis, N = a parameter's numel, c = ceil(N / n) its
chunk, S = one rank's segment of a bucket (sum of its parameters' chunks).

Per parameter (docs/DESIGN.md section 9):
  * gradients accumulate in fp32 over the step's micro-batches: a post-accumulate-grad hook adds
    each micro-batch's gradient (bf16 or fp32) into an fp32 bucket buffer and frees `p.grad`
    (`grad_dtype` float64 instead: see "Split-independent sums" below);
  * replicas: everything but expert shards over DP x CP (`ctx.dp_cp`), expert shards over
    expert-DP (`ctx.expert_dp`). Rank r of n owns the flat range [r c, (r + 1) c) of each
    parameter (torch.chunk / DTensor Shard(0) semantics), so a checkpoint stores each state
    tensor as a flat DTensor and DCP reshards it into any other n;
  * a bucket is laid out rank-major ([chunk r of every parameter] for r = 0..n-1), so one
    `reduce_scatter_tensor` leaves rank r the summed fp32 gradient of exactly what it owns.
    Buckets launch asynchronously as soon as the last micro-batch's backward has produced all of
    their gradients, strictly in bucket order (every replica then issues the same sequence of
    collectives even when a parameter got no gradient on one rank, e.g. an idle expert);
  * the rank steps torch AdamW on its fp32 master chunk (fp32 parameters: the chunk is a view of
    the parameter itself, so float32 runs step exactly the tensors and math they always did);
    `offload_fraction` keeps the largest chunks, masters and moments, on the host;
  * after the step each bucket's updated chunks, rounded to the parameter dtype, are all-gathered.

Split-independent sums (`optim.grad_reduce_dtype: float64`, opt-in). In float32 the step's
gradient depends on how micro-batches are split over DP ranks: one rank of dp=1 folds four
micro-batches ((m0 + m1) + m2) + m3, dp=2 sums (m0 + m1) + (m2 + m3), and no order of the
replica sums can rebuild the fold without keeping every micro-batch's gradient. Measured on the
tiny model under cp=2 (one step, 415k elements): the two groupings differ in 26% of the
elements, by up to 2.5e-3 relative where terms cancel; AdamW divides by sqrt(v) + eps, so an
element with |g| near eps (1e-8) turns that into a weight difference of ~lr x 1e-3 after one
step (2.7e-5 at lr 1e-2), and by step 3 a router near-tie (top-2 scores 1.2e-7 apart) picks
another expert. float64 buckets and replica sums are exact for fp32 summands within 2^29 of
each other, so both groupings give the same float64 value and the same rounded fp32 gradient
(0 of the 415k elements differ): dp=N reproduces dp=1 bit for bit, for twice the gradient-buffer
bytes and twice the reduce-scatter bytes. The default stays float32, the sums AdamW always got.

Lean buckets (`optim.grad_accum_dtype: bfloat16`, opt-in, bf16 models). The micro-batches'
gradients add into bf16 buckets (the parameters' dtype: half the bytes of the full-size fp32
buckets, the largest term of a Flash stage's plan after the weights). Each bucket is upcast to
float32 only to be reduced: over replicas, as one float32 reduce-scatter into a float32 shard
(1/n of the bucket) when its last gradient arrives; without replicas (n = 1, e.g. every expert
shard at expert-DP 1) after backward, as the float32 copy AdamW steps on, freed after the step.
Cost: each added micro-batch rounds the running sum to bf16 (2^-9 relative; the first one is
exact, it already is bf16), measured as the tiny model's 30-step loss curve against float32
buckets (benchmarks/bench_grad_buffers.py).

Why not torch FSDP2 (`fully_shard` + MixedPrecisionPolicy), which does run on gloo CPU here: it
turns parameters into DTensors sharded for compute (ZeRO-3), while this engine's expert shards
are plain tensors already sliced over EP and tagged for the grad norm and checkpoints, the
pipeline stage keeps a tied MTP embedding whose gradient is summed across stages before the DP
reduction, and `offload_fraction` offloads part of the optimizer state (FSDP2's CPUOffloadPolicy
moves whole modules, parameters included). ZeRO-1 keeps all of that as it was and adds only the
optimizer-side sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import AdamW, Optimizer

from primus_v4.errors import ConfigError
from primus_v4.log import get_logger
from primus_v4.parallel.data_parallel import BUCKET_BYTES, is_expert_param, replica_axis
from primus_v4.parallel.grad_norm import global_grad_norm
from primus_v4.parallel.groups import ParallelContext
from primus_v4.training.optim.buckets import Bucket, Slot, gather_flat, scatter_flat
from primus_v4.training.optim.lr_schedule import warmup_cosine

log = get_logger(__name__)


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm gains, biases and other vectors are not weight-decayed (decay pulls gains to 0)."""
    return param.ndim < 2 or name.endswith(".bias") or "norm" in name.lower()


def pick_offloaded(numels: list[int], fraction: float) -> set[int]:
    """Indices of the chunks kept on the host: largest first, while they fit in fraction x the
    total numel (also what the memory plan counts)."""
    total = sum(numels)
    budget = fraction * total
    chosen: set[int] = set()
    used = 0
    # Largest-first reaches the budget with the fewest tensors (fewer, larger host copies).
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        if used + numels[i] <= budget + 1e-9 * total:
            chosen.add(i)
            used += numels[i]
    return chosen


def _adamw(params: list[list[torch.Tensor]], groups: list[dict], foreach: bool | None):
    present = [{**groups[i], "params": ps} for i, ps in enumerate(params) if ps]
    if not present:
        return None
    opt = AdamW(present, foreach=foreach)
    opt._mirror = [i for i, ps in enumerate(params) if ps]  # type: ignore[attr-defined]
    return opt


class ShardedAdamW(Optimizer):
    """AdamW over fp32 master chunks of this rank's share of every parameter (module docstring).

    `param_groups` (for the LR scheduler) hold the master chunks of the decayed and the
    non-decayed parameters; two torch AdamWs do the work, one on the device, one on the host.
    Call order per step: `zero_grad`, `begin(micro_batches)`, backward(s), `reduce_gradients`,
    `clip_grad_norm`, `step`.
    """

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        ctx: ParallelContext,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        offload_fraction: float,
        foreach: bool | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        deferred: Callable[[nn.Parameter], bool] | None = None,
        grad_dtype: torch.dtype = torch.float32,
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        self.ctx = ctx
        if accum_dtype not in (None, grad_dtype) and (
            accum_dtype != torch.bfloat16 or grad_dtype != torch.float32
        ):
            raise ConfigError(
                f"ShardedAdamW accum_dtype {accum_dtype} with grad_dtype {grad_dtype}: lean "
                "(bfloat16) accumulation reduces in float32; set optim.grad_reduce_dtype float32"
            )
        self.accum_dtype = accum_dtype or grad_dtype
        if grad_dtype not in (torch.float32, torch.float64):
            raise ConfigError(
                f"ShardedAdamW grad_dtype must be float32 or float64, got {grad_dtype}: set "
                "optim.grad_reduce_dtype to one of them"
            )
        self.grad_dtype = grad_dtype
        if not 0.0 <= offload_fraction <= 1.0:
            raise ConfigError(f"optim.offload_fraction must be in [0, 1], got {offload_fraction}")
        slots = [
            Slot(name=n, param=p, group=int(no_decay(n, p)), expert=is_expert_param(p))
            for n, p in named
            if p.requires_grad
        ]
        if not slots:
            raise ConfigError("ShardedAdamW got no trainable parameters (all requires_grad=False)")
        self.slots = slots
        self.buckets = self._layout(bucket_bytes, deferred or (lambda p: False))
        hyper = {"lr": lr, "betas": betas, "eps": eps}
        self._groups = [{**hyper, "weight_decay": weight_decay}, {**hyper, "weight_decay": 0.0}]
        on_host = self._make_masters(offload_fraction)
        groups = [
            {**g, "params": [s.master for s in slots if s.group == i]}
            for i, g in enumerate(self._groups)
        ]
        super().__init__([g for g in groups if g["params"]], hyper)
        self._index = [i for i, g in enumerate(groups) if g["params"]]
        pick = [[[s.master for s in slots if s.group == i and (id(s) in on_host) == host]
                 for i in range(2)] for host in (False, True)]  # fmt: skip
        self._device, self._host = (_adamw(p, self._groups, foreach) for p in pick)
        self._on_host = on_host
        self._init_state()
        self._micro_batches: int | None = None
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._hook(s)) for s in slots]
        log.info("optimizer: %s", self.describe())

    # -- layout ---------------------------------------------------------------------------

    def _layout(self, bucket_bytes: int, deferred: Callable[[nn.Parameter], bool]) -> list[Bucket]:
        """Buckets in reverse model order (the order backward produces gradients)."""
        buckets: list[Bucket] = []
        current: dict[tuple[bool, tuple[int, ...]], Bucket] = {}
        for slot in reversed(self.slots):
            axis = replica_axis(slot.param, self.ctx)
            key = (slot.expert, axis.ranks)  # a bucket is reduced over one axis
            b = current.get(key)
            n = axis.size
            slot.chunk = -(-slot.numel // n)
            alone = deferred(slot.param)  # in a bucket of its own, exposed as `main_grad`
            full = b is not None and b.segment * n * b.itemsize(self) >= bucket_bytes
            if alone or b is None or b.deferred or full:
                b = current[key] = Bucket(axis=axis, deferred=alone, index=len(buckets))
                buckets.append(b)
            slot.bucket, slot.offset = b.index, b.segment
            b.segment += slot.chunk
            b.slots.append(slot)
            rank = axis.rank
            slot.lo, slot.hi = min(rank * slot.chunk, slot.numel), min((rank + 1) * slot.chunk,
                                                                      slot.numel)  # fmt: skip
        for b in buckets:
            dev = b.slots[0].param.device
            kind = {"dtype": self.grad_dtype, "device": dev}
            # The tied embedding's bucket (summed across stages first) stays in grad_dtype.
            b.lean = self.accum_dtype != self.grad_dtype and not b.deferred
            if b.lean:
                b.grad = torch.zeros(b.axis.size * b.segment, dtype=self.accum_dtype, device=dev)
                continue
            b.grad = torch.zeros(b.axis.size * b.segment, **kind)
            b.shard = b.grad if b.axis.size == 1 else torch.zeros(b.segment, **kind)
            wide = self.grad_dtype != torch.float32
            b.reduced = torch.zeros(b.segment, device=dev) if wide else b.shard
            for s in b.slots:
                s.grad = b.reduced[s.offset : s.offset + s.size]
            if b.deferred:
                # The flat parameter padded to n x c (rank-major of one parameter = flat order),
                # the same layout on every pipeline stage that holds a copy.
                b.slots[0].param.main_grad = b.grad  # type: ignore[attr-defined]
        return buckets

    def _make_masters(self, offload_fraction: float) -> set[int]:
        """fp32 master chunks; the largest ones (by numel) up to the fraction live on the host."""
        chunks = [s.size for s in self.slots]
        host = {id(self.slots[i]) for i in pick_offloaded(chunks, offload_fraction)}
        for s in self.slots:
            own = s.param.detach().view(-1)[s.lo : s.hi]
            if id(s) in host:
                s.master = own.to("cpu", torch.float32, copy=True)
                if own.is_cuda:
                    s.master = s.master.pin_memory()  # async-capable host<->device copies
            elif own.dtype == torch.float32:
                s.master, s.aliased = own, True  # the parameter itself: no copy, no rounding
            else:
                s.master = own.to(torch.float32, copy=True)
        return host

    def _init_state(self) -> None:
        """Moments allocated up front (what a memory plan counts, what a checkpoint loads into);
        the same zeros and step counter AdamW would create at its first step."""
        for s in self.slots:
            self.state[s.master] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(s.master, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(s.master, memory_format=torch.preserve_format),
            }
        for sub in (self._device, self._host):
            if sub is not None:
                for g in sub.param_groups:
                    for m in g["params"]:
                        sub.state[m] = self.state[m]

    @torch.no_grad()
    def seed_masters(self, pieces: Iterable[tuple[torch.Tensor, int, torch.Tensor]]) -> int:
        """Masters of non-float32 parameters from float32 values given as (parameter, flat
        offset, values) pieces, e.g. the random init's draws: a bf16 parameter holds only their
        rounding, and masters started from it would follow a perturbed trajectory (FSDP2's
        float32 sharded parameters keep the unrounded init the same way). Every parameter stays
        its rounded master. Returns the master elements set on this rank."""
        slots = {id(s.param): s for s in self.slots if not s.aliased}
        done = 0
        for param, offset, value in pieces:
            s = slots.get(id(param))
            lo, hi = (max(offset, s.lo), min(offset + value.numel(), s.hi)) if s else (0, 0)
            if lo >= hi:
                continue
            src = value.reshape(-1)[lo - offset : hi - offset]
            own = s.param.detach().view(-1)[lo:hi]
            if not torch.equal(src.to(own.device, own.dtype), own):
                raise ValueError(f"seed_masters: {s.name}[{lo}:{hi}] is not the rounding of the "
                                 "given values (seed the masters from the draws the "
                                 "parameters were initialized with)")  # fmt: skip
            s.master[lo - s.lo : hi - s.lo].copy_(src)
            done += hi - lo
        return done

    @torch.no_grad()
    def refresh_host_copies(self) -> None:
        """Re-read the masters from the parameters (after the model's weights were loaded)."""
        for s in self.slots:
            if not s.aliased:
                s.master.copy_(s.param.detach().view(-1)[s.lo : s.hi])

    def remove_hooks(self) -> None:
        """Stop routing the parameters' gradients into this optimizer's buffers."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- gradients ------------------------------------------------------------------------

    def _hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        bucket = self.buckets[slot.bucket]

        @torch.no_grad()
        def accumulate(p: torch.Tensor) -> None:
            # fp32 accumulation of a bf16 gradient; the parameter-dtype grad is freed at once.
            scatter_flat(bucket.chunk_view(slot, bucket.grad), p.grad.view(-1), add=True)
            p.grad = None
            slot.calls += 1
            if slot.calls == self._micro_batches:
                bucket.done += 1
                self._launch_ready()

        return accumulate

    def begin(self, micro_batches: int) -> None:
        """Before the step's first backward: every parameter's hook fires once per micro-batch
        that reaches it; a bucket whose parameters all fired `micro_batches` times is final and
        is reduced while backward goes on (without `begin`, everything waits for
        `reduce_gradients`)."""
        self._micro_batches = micro_batches

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        if b.lean:
            if b.axis.size > 1:  # reduce in float32 now; n = 1 upcasts after backward
                b.send = b.grad.float()
                b.shard = torch.empty(b.segment, device=b.grad.device)
                b.work = dist.reduce_scatter_tensor(b.shard, b.send, group=b.axis.group,
                                                    async_op=True)  # fmt: skip
            return
        if b.axis.size > 1:
            b.work = dist.reduce_scatter_tensor(b.shard, b.grad, group=b.axis.group,
                                                async_op=True)  # fmt: skip

    def _launch_ready(self) -> None:
        for b in self.buckets:
            if b.launched:
                continue
            if b.deferred or b.done < len(b.slots):
                return  # strictly in order: later buckets wait for this one
            self._launch(b)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """After the step's last backward (and cross-stage sums): sum every bucket over its
        replicas; rank r keeps the summed fp32 gradient of its chunks (`Slot.grad`)."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            if b.lean:
                b.reduced = b.shard if b.axis.size > 1 else b.grad.float()
                b.send = None
                for s in b.slots:
                    s.grad = b.reduced[s.offset : s.offset + s.size]
            elif b.reduced is not b.shard:
                b.reduced.copy_(b.shard)  # float64 sums rounded once, to what AdamW steps on
            b.done, b.launched, b.work = 0, False, None
            for s in b.slots:
                s.calls = 0
        self._micro_batches = None

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The full fp32 accumulated gradient of `param` before reduction, as [n, c] chunks."""
        slot = next(s for s in self.slots if s.param is param)
        b = self.buckets[slot.bucket]
        return b.chunk_view(slot, b.grad)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        for b in self.buckets:
            b.grad.zero_()
            if b.lean:
                self._free_lean(b)
                continue
            if b.shard is not b.grad:
                b.shard.zero_()
            if b.reduced is not b.shard:
                b.reduced.zero_()
        for s in self.slots:
            s.param.grad = None

    @staticmethod
    def _free_lean(b: Bucket) -> None:
        """A lean bucket's float32 copies live from its reduction to the step."""
        b.shard = b.reduced = b.send = None
        for s in b.slots:
            s.grad = None

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, *, apart: tuple[str, ...] = ()) -> float:
        """Global grad norm over every rank's owned chunks (parallel.grad_norm), then clip them
        to `max_norm` as torch's clip_grad_norm_ does; returns the norm before clipping.

        `apart`: name prefixes of parameters clipped on their own norm (a drafter trained beside
        the model: its gradients never scale the model's); their norms go to `apart_norms`."""
        self.apart_norms: dict[str, float] = {}
        rest = [s for s in self.slots if not s.name.startswith(apart)] if apart else self.slots
        for prefix in apart:
            part = [s for s in self.slots if s.name.startswith(prefix)]
            self.apart_norms[prefix] = self._clip(part, max_norm)
        return self._clip(rest, max_norm)

    def _clip(self, slots: list[Slot], max_norm: float) -> float:
        dense = [s.grad for s in slots if not s.expert
                 and not getattr(s.param, "pipeline_duplicate", False)]  # fmt: skip
        experts = [s.grad for s in slots if s.expert]
        norm = global_grad_norm(dense, experts, self.ctx)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for s in slots:
                s.grad.mul_(coef)
        return norm

    # -- step -----------------------------------------------------------------------------

    def _sync_hyperparams(self) -> None:
        for mine, i in zip(self.param_groups, self._index, strict=True):
            self._groups[i].update({k: v for k, v in mine.items() if k != "params"})
        for sub in (self._device, self._host):
            if sub is not None:
                for sub_group, i in zip(sub.param_groups, sub._mirror, strict=True):  # type: ignore[attr-defined]
                    sub_group.update({k: v for k, v in self._groups[i].items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        self._sync_hyperparams()
        for s in self.slots:
            s.master.grad = s.grad if id(s) not in self._on_host else s.grad.to("cpu")
        for sub in (self._device, self._host):
            if sub is not None:
                sub.step()
        for s in self.slots:
            s.master.grad = None
        for b in self.buckets:
            if b.lean:
                self._free_lean(b)
        self.write_back()
        return None

    def write_back(self) -> None:
        """Parameters = their rounded masters: own chunks copied in, then all-gathered."""
        for b in self.buckets:
            n = b.axis.size
            if n == 1:
                for s in b.slots:
                    if not s.aliased:
                        s.param.detach().view(-1).copy_(s.master)
                continue
            dtype = b.slots[0].param.dtype
            if any(s.param.dtype != dtype for s in b.slots):
                raise ConfigError(f"bucket of {b.slots[0].name} mixes parameter dtypes")
            mine = torch.zeros(b.segment, dtype=dtype, device=b.grad.device)
            for s in b.slots:
                mine[s.offset : s.offset + s.size].copy_(s.master)
            full = torch.empty(n * b.segment, dtype=dtype, device=b.grad.device)
            dist.all_gather_into_tensor(full, mine, group=b.axis.group)
            for s in b.slots:
                gather_flat(s.param.detach().view(-1), b.chunk_view(s, full))

    # -- accounting and checkpoints --------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: fp32 masters that are not the parameters, moments, grads."""
        out = {"master_device": 0, "master_host": 0, "moments_device": 0, "moments_host": 0}
        for s in self.slots:
            where = "host" if id(s) in self._on_host else "device"
            size = s.size * 4
            if not s.aliased:
                out[f"master_{where}"] += size
            out[f"moments_{where}"] += 2 * size
        out["grad_buffers"] = sum(b.buffer_bytes() for b in self.buckets)
        return out

    def describe(self) -> str:
        b = self.state_bytes()
        host = b["master_host"] + b["moments_host"]
        dev = b["master_device"] + b["moments_device"]
        return (
            f"{len(self.slots)} parameters in {len(self.buckets)} buckets, masters + moments "
            f"{dev / 2**20:.1f} MiB device + {host / 2**20:.1f} MiB host, "
            f"{str(self.accum_dtype).removeprefix('torch.')} grads "
            f"{b['grad_buffers'] / 2**20:.1f} MiB (dp x cp {self.ctx.dp_cp.size}, expert-dp "
            f"{self.ctx.expert_dp.size})"
        )

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise NotImplementedError(
            "ShardedAdamW state is sharded over ranks: save and load it with "
            "primus_v4.training.checkpoint.store (zero_state.optimizer_state), not state_dict()"
        )


def build_sharded_optimizer(
    run: Any,
    model: nn.Module,
    ctx: ParallelContext | None = None,
    *,
    total_steps: int | None = None,
    foreach: bool | None = None,
) -> tuple[ShardedAdamW, Any]:
    """`ShardedAdamW` over `model` for a resolved run, plus its warmup/cosine LR schedule over
    `total_steps` (default train.steps; the trainer passes the steps train.epochs derives)."""
    from torch.optim.lr_scheduler import LambdaLR

    t, o = run.cfg.train, run.cfg.optim
    steps = total_steps or t.steps
    schedule = warmup_cosine(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                             total_steps=steps)  # fmt: skip
    optimizer = ShardedAdamW(
        list(model.named_parameters()),
        ctx or ParallelContext.single(next(model.parameters()).device),
        lr=t.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=t.weight_decay,
        offload_fraction=o.offload_fraction,
        foreach=foreach,
        # The tied MTP embedding of a pipeline's first and last stage: its gradient is summed
        # across the two stages after the schedule, before the replicas reduce it.
        deferred=lambda p: bool(getattr(p, "pipeline_tied", False)),
        grad_dtype=getattr(torch, o.grad_reduce_dtype),
        # float32 means "accumulate in grad_dtype" (float64 with grad_reduce_dtype: float64).
        accum_dtype=torch.bfloat16 if o.grad_accum_dtype == "bfloat16" else None,
    )
    return optimizer, LambdaLR(optimizer, schedule)
