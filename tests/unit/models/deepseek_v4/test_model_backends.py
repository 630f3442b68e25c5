"""The whole tiny model with every op that has a fused backend on it (sparse attention on our
Triton kernels, grouped experts on torch's grouped_mm) equals the torch backend, forward and
backward, and keeps the packing contract: a pack equals its samples alone and no gradient
crosses a sample. On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py).

Legend: S = rows of the pack.

compressor_pool and indexer_topk have no fused backend (docs/DESIGN.md section 10 says why), so
they run the reference in both models.

Tolerances. Fused against torch: each compared tensor (the loss, the embedding's and every
parameter's gradient) may differ by as much as kernel errors within the kernels' acceptance
bounds move it. The torch model runs again with every kernel output and kernel input gradient
off by up to its kernel test's float32 bound (1e-5 of the tensor's largest value for sparse
attention, 1e-6 for grouped experts), uniformly at random; the allowance is the RMS change over
three such runs, per element. Not a fixed fraction of each tensor's own scale: float32 noise in
a sum of signed terms scales with the terms, not with the sum, and an mHC scale's gradient sums
over every row and stream (the MTP head's is 1/7 of the sum of its terms' sizes), so kernel errors
move the MTP head's gradients by 3e-5 to 5e-5 of their own size. A pack against its samples
alone: 1e-5 of each head's scale (the same model; only summation order differs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton  # noqa: F401  (the test extra installs it: a missing triton fails, never skips)
from test_model import cross_sample_grad, make_pack, run, tiny_cfg

from primus_v4.kernels import registry
from primus_v4.models.deepseek_v4 import DeepseekV4Model
from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.moe import MoE

FUSED = "sparse_attention=triton,grouped_experts=grouped_mm"
REL = 1e-5  # a pack against its samples alone: float32, only summation order differs
# A 1-row sample, one shorter than the CSA ratio, one past the window (8) and the top-k (4),
# and padding: every candidate kind and the clipped windows, on few rows (the interpreter
# runs one program per query row).
LENGTHS, PAD = [1, 3, 26], 2
# runs with kernel errors whose RMS change is the allowance: one run's change can land near
# zero for a gradient of one or four entries; an RMS of three is below 0.2 of its typical
# size about 1% of the time (chi with 3 degrees of freedom)
ERROR_DRAWS = 3


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _error(x: torch.Tensor, rel: float, gen: torch.Generator) -> torch.Tensor:
    """Uniform in +-rel of x's largest value: an error a kernel's acceptance bound lets pass."""
    u = torch.rand(x.shape, generator=gen, dtype=x.dtype) * 2 - 1
    return u * (rel * x.detach().abs().max())


class _OutputError(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rel: float, gen: torch.Generator) -> torch.Tensor:
        return x + _error(x, rel, gen)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g, None, None


class _GradError(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rel: float, gen: torch.Generator) -> torch.Tensor:
        ctx.rel, ctx.gen = rel, gen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g + _error(g, ctx.rel, ctx.gen), None, None


def with_errors(kernel: Callable, rel: float, gen: torch.Generator) -> Callable:
    """`kernel` with an accepted error added to its output and to each input's gradient."""

    def erring(*args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(
            _GradError.apply(a, rel, gen) if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in args
        )
        return _OutputError.apply(kernel(*args, **kwargs), rel, gen)

    return erring


def forward_backward(model: DeepseekV4Model, p: dict) -> dict[str, torch.Tensor]:
    """{"total": loss, "embedding": its gradient, parameter name: gradient} of one pack."""
    model.zero_grad(set_to_none=True)
    out, embs = run(
        model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
        labels=p["labels"], loss_mask=p["loss_mask"],
    )  # fmt: skip
    total = out.loss + out.mtp_loss + out.aux_loss
    (g_emb,) = torch.autograd.grad(total, embs[:1], retain_graph=True)
    total.backward()
    grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
    return {"total": total.detach(), "embedding": g_emb, **grads}


def accepted_spread(model: DeepseekV4Model, p: dict, ref: dict) -> dict[str, torch.Tensor]:
    """Per element, the RMS over `ERROR_DRAWS` runs of how far kernel errors at the acceptance
    bound move each tensor of `forward_backward` from `ref`."""
    squares = {n: torch.zeros_like(t) for n, t in ref.items()}
    # each kernel's float32 acceptance bound, as its own test states it (tests/unit/kernels/):
    # 1e-5 of each tensor's largest value for sparse attention, 1e-6 for grouped experts
    kernels = [(m, "_attend", 1e-5) for m in model.modules() if isinstance(m, Attention)]
    kernels += [(m, "grouped_experts", 1e-6) for m in model.modules() if isinstance(m, MoE)]
    assert kernels
    for draw in range(ERROR_DRAWS):
        gen = torch.Generator().manual_seed(draw)
        with pytest.MonkeyPatch.context() as mp:
            for module, name, rel in kernels:
                mp.setattr(module, name, with_errors(getattr(module, name), rel, gen))
            moved = forward_backward(model, p)
        assert moved.keys() == ref.keys()
        for n, t in moved.items():
            squares[n] += (t - ref[n]) ** 2
    return {n: (s / ERROR_DRAWS).sqrt() for n, s in squares.items()}


@pytest.fixture(scope="module")
def models() -> dict[str, DeepseekV4Model]:
    torch.manual_seed(0)
    cfg = tiny_cfg(init_method_std=0.05)
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, spec in (("torch", "torch"), ("fused", FUSED)):
            mp.setenv(registry.ENV_VAR, spec)  # modules resolve their ops at construction
            built[name] = DeepseekV4Model(cfg)
    built["fused"].load_state_dict(built["torch"].state_dict())
    with torch.no_grad():  # nonzero sinks, so the sink's gradient path is exercised
        for model in built.values():
            for i, layer in enumerate(model.layers):
                layer.attn.attn_sink.copy_(torch.linspace(-1.0, 1.0, 4) * (i + 1))
    return built


def test_fused_backends_are_in_use(models) -> None:
    attn = models["fused"].layers[1].attn
    assert attn._attend.__name__ == "checked"  # the explicit backend's per-call check
    assert models["torch"].layers[1].attn._attend.__name__ == "sparse_attention_torch"


def test_fused_model_equals_the_torch_model_forward_and_backward(models) -> None:
    p = make_pack(LENGTHS, PAD)
    ref = forward_backward(models["torch"], p)
    got = forward_backward(models["fused"], p)
    assert got.keys() == ref.keys()
    sinks = [n for n in ref if n.endswith("attn_sink")]
    assert sinks and all(float(ref[n].abs().max()) > 0 for n in sinks)
    spread = accepted_spread(models["torch"], p, ref)
    for n, want in ref.items():
        err, allowed = float((got[n] - want).abs().max()), float(spread[n].max())
        assert err <= allowed, (n, err, allowed)  # no further than accepted kernel errors


def test_fused_model_pack_equals_each_sample_alone_and_is_isolated(models) -> None:
    model, p = models["fused"], make_pack(LENGTHS, PAD)
    with torch.no_grad():
        out, _ = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
        cu = p["cu"].tolist()
        for a, b in itertools.pairwise(cu[:-1]):  # every real sample
            alone, _ = run(model, p["ids"][a:b])
            heads, heads_alone = [out.logits, *out.mtp_logits], [alone.logits, *alone.mtp_logits]
            for h, ha in zip(heads, heads_alone, strict=True):
                assert _rel(h[0, a:b], ha[0]) <= REL, (a, b)
    # exact zeros: masked candidates are never loaded, so nothing carries a gradient across
    assert cross_sample_grad(model, p, 2, 1) == 0.0
    assert cross_sample_grad(model, p, 2, 0) == 0.0
    assert cross_sample_grad(model, p, 2, 2) > 0.0  # the probe is live
