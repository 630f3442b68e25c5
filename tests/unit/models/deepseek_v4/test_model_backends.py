"""The whole tiny model with every op that has a fused backend on it (sparse attention on our
Triton kernels, grouped experts on torch's grouped_mm) equals the torch backend, forward and
backward, and keeps the packing contract: a pack equals its samples alone and no gradient
crosses a sample. On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py).

Legend: S = rows of the pack.

compressor_pool and indexer_topk have no fused backend (docs/DESIGN.md section 10 says why), so
they run the reference in both models. Tolerance: float32, 1e-5 of each tensor's scale, the
kernels' acceptance bound (only summation order differs).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton  # noqa: F401  (the test extra installs it: a missing triton fails, never skips)
from test_model import cross_sample_grad, make_pack, run, tiny_cfg

from primus_v4.kernels import registry
from primus_v4.models.deepseek_v4 import DeepseekV4Model

FUSED = "sparse_attention=triton,grouped_experts=grouped_mm"
REL = 1e-5
# A 1-row sample, one shorter than the CSA ratio, one past the window (8) and the top-k (4),
# and padding: every candidate kind and the clipped windows, on few rows (the interpreter
# runs one program per query row).
LENGTHS, PAD = [1, 3, 26], 2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


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
    results = {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        out, embs = run(
            model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
            labels=p["labels"], loss_mask=p["loss_mask"],
        )  # fmt: skip
        total = out.loss + out.mtp_loss + out.aux_loss
        (g_emb,) = torch.autograd.grad(total, embs[:1], retain_graph=True)
        total.backward()
        grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
        results[name] = (total.detach(), g_emb, grads)
    (t_ref, e_ref, g_ref), (t_got, e_got, g_got) = results["torch"], results["fused"]
    assert _rel(t_got, t_ref) <= REL
    assert _rel(e_got, e_ref) <= REL
    assert g_got.keys() == g_ref.keys()
    sinks = [n for n in g_ref if n.endswith("attn_sink")]
    assert sinks and all(float(g_ref[n].abs().max()) > 0 for n in sinks)
    for n, g in g_ref.items():
        assert _rel(g_got[n], g) <= REL, (n, _rel(g_got[n], g))


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
