"""Selective activation recompute: named parts of a layer rerun in backward instead of saving.

`recompute_granularity: selective` with `recompute_modules` (Megatron's names where the concept is
the same) picks what each decoder layer and MTP depth recomputes:

  layernorm       the mHC collapse + RMSNorm before attention and before the MoE (MTP: also
                  enorm / hnorm); drops their inputs and outputs, 4 x hidden x 2 B = 32 KiB
  mla_up_proj     the query up-projection wq_b, its per-head RMS norm and RoPE; drops q before
                  and after RoPE, 2 x heads x head dim x 2 B = 128 KiB
  core_attn       sparse attention, the inverse RoPE and the output-group split; drops the
                  attention output, heads x head dim x 2 B = 64 KiB
  shared_experts  the shared expert; drops its gate/up and SwiGLU outputs, 3 x ffn x 2 B = 12 KiB
  moe             the whole MoE (router, dispatch, experts, combine, shared expert); drops all
                  it saves but its input
(bytes per token in bf16 at Flash widths.)

`layernorm`, `mla_up_proj` and `core_attn` are "checkpoints without output" (Megatron's
CheckpointWithoutOutput): the part runs without autograd, its output's storage is released once
its consumer has saved it, and a hook on the consumer's output gradient recomputes the part and
refills that storage before the consumer's backward reads it. `shared_experts` and `moe` are
non-reentrant `torch.utils.checkpoint` regions (their inputs are saved anyway). The recomputed
forward is the same ops on the same inputs, so the gradients are the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from primus_v4.models.common.recompute_choice import DEFAULT_MODULES


def selected(cfg: Any) -> frozenset[str]:
    """The modules a layer built from `cfg` recomputes (empty unless granularity selective)."""
    if getattr(cfg, "recompute_granularity", None) != "selective":
        return frozenset()
    return frozenset(cfg.recompute_modules or DEFAULT_MODULES)


_TENSOR = object()  # marks a tensor argument (saved in ctx) in the argument template


class _Detached(torch.autograd.Function):
    """Runs `part.fn(*args)` without autograd; backward differentiates the graph the part's
    recompute built. The part's parameters come as extra inputs, so their gradients leave
    through this node like any other (backward() and autograd.grad alike)."""

    @staticmethod
    def forward(ctx: Any, part: DiscardedPart, n_args: int, *inputs: Any) -> Any:  # type: ignore[override]
        ctx.part = part
        args = inputs[:n_args]
        ctx.template = [_TENSOR if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))
        with torch.no_grad():
            out = part.fn(*args)
        part.ctx = ctx
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        part = ctx.part
        outs, inputs = part.recomputed
        part.recomputed = None
        wanted = [x for x in (*inputs, *part.params) if torch.is_tensor(x) and x.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad]  # fmt: skip
        found = iter(())
        if pairs and wanted:
            outs_, grads_ = [o for o, _ in pairs], [g for _, g in pairs]
            found = iter(torch.autograd.grad(outs_, wanted, grads_, allow_unused=True))
        got = [next(found, None) if torch.is_tensor(x) and x.requires_grad else None
               for x in (*inputs, *part.params)]  # fmt: skip
        return (None, None, *got)


class DiscardedPart:
    """One run of a part whose output is dropped after use and rebuilt before its consumer's
    backward. Usage: `out = part(*args)`; feed `out` to its consumers; then
    `part.discard(after=consumer_output)`. `params`: the parameters `fn` uses (their gradients
    flow through the part)."""

    def __init__(self, fn: Callable[..., Any], params: Sequence[torch.Tensor] = ()) -> None:
        self.fn = fn
        self.params = tuple(params)
        self.ctx: Any = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.recomputed: Any = None
        self.sizes: list[int] = []

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.fn(*args)
        out = _Detached.apply(self, len(args), *args, *self.params)
        self.outputs = out if isinstance(out, tuple) else (out,)
        return out

    def discard(self, *, after: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Release the outputs' storage now; recompute them when the first gradient of `after`
        (every tensor through which gradients reach the consumers) arrives, i.e. before the
        backward of any consumer."""
        afters = [after] if torch.is_tensor(after) else list(after)
        afters = [t for t in afters if t.requires_grad]
        # Outputs without a graph (no input or parameter needs a gradient: the first layer of a
        # LoRA run, its embedding frozen) have no saved inputs to be rebuilt from: kept.
        if self.ctx is None or not afters or not any(o.requires_grad for o in self.outputs):
            return
        self.sizes = [o.untyped_storage().nbytes() for o in self.outputs]
        for o in self.outputs:
            o.untyped_storage().resize_(0)
        for t in afters:
            t.register_hook(self._recompute)

    def _recompute(self, grad: torch.Tensor) -> torch.Tensor:
        if self.recomputed is not None:
            return grad  # another of the `after` tensors came first
        saved = iter(self.ctx.saved_tensors)
        needs = self.ctx.needs_input_grad[2:]  # the forward's arguments after `part, n_args`
        inputs: list[Any] = []
        for arg, need in zip(self.ctx.template, needs, strict=False):
            if arg is not _TENSOR:
                inputs.append(arg)
                continue
            x = next(saved).detach()
            inputs.append(x.requires_grad_(True) if need else x)
        with torch.enable_grad():
            out = self.fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        for old, new, size in zip(self.outputs, outs, self.sizes, strict=True):
            old.untyped_storage().resize_(size)
            old.untyped_storage().copy_(new.untyped_storage())
        self.recomputed = (outs, inputs)
        return grad


def checkpointed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, recomputed in backward (non-reentrant checkpoint) under grad."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
