"""LoRA adapters (models/deepseek_v4/lora.py) on the tiny model, float32 unless said:
- fresh adapters (B = 0) leave every logit bit for bit the base model's, in float32 and bf16;
- with trained (random) adapters the model equals the base model with merged weights
  W + (alpha / r) B A, for every target, per-expert and shared routed adapters;
- only adapters get gradients; a pack equals its samples alone and no gradient crosses a sample;
- the routed adapters run as grouped GEMMs (torch grouped_mm) equal to the per-expert loop.

Legend: M = expert-sorted rows, E = experts, D = hidden, F = expert ffn, r = rank.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from test_model import cross_sample_grad, make_pack, run, tiny_cfg

from primus_v4.config.schema import LORA_TARGETS
from primus_v4.kernels.grouped_experts import (
    ExpertLoRA,
    grouped_experts_grouped_mm,
    grouped_experts_reference,
    grouped_mm_refuses,
)
from primus_v4.models.deepseek_v4 import DeepseekV4Model
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora, merged_weights

REL = 1e-5  # float32: merged and adapter paths differ in summation order only


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _targets(seed: int) -> tuple[str, ...]:
    """A random non-empty subset of the targets (seed 0: all of them)."""
    if seed == 0:
        return LORA_TARGETS
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(len(LORA_TARGETS), generator=gen) < 0.5
    chosen = tuple(t for t, k in zip(LORA_TARGETS, keep.tolist(), strict=True) if k)
    return chosen or LORA_TARGETS[:1]


def _pair(seed: int, *, experts: str = "per_expert", dtype=torch.float32, trained: bool = True):
    """(base model, the same model with adapters); trained adapters get random B (and A)."""
    torch.manual_seed(seed)
    base = DeepseekV4Model(tiny_cfg(init_method_std=0.05)).to(dtype)
    model = copy.deepcopy(base)
    spec = LoraSpec(rank=4, alpha=8.0, targets=_targets(seed), expert_adapters=experts)
    apply_lora(model, spec, seed=seed)
    if trained:
        gen = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return base, model


def _heads(model, p) -> list[torch.Tensor]:
    with torch.no_grad():
        out, _ = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
    return [out.logits, *out.mtp_logits]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", ["per_expert", "shared"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fresh_adapters_leave_the_base_model_bit_for_bit(seed, experts, dtype) -> None:
    base, model = _pair(seed, experts=experts, dtype=dtype, trained=False)
    p = make_pack(seed=seed)
    for got, want in zip(_heads(model, p), _heads(base, p), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
@pytest.mark.parametrize("seed", [0, 3, 4, 5])
def test_adapters_equal_the_merged_weights(seed, experts) -> None:
    base, model = _pair(seed, experts=experts)
    merged = merged_weights(model)
    assert merged, "no adapted weight"
    state = base.state_dict()
    assert merged.keys() <= state.keys()
    changed = 0
    for name, w in merged.items():
        changed += int(not torch.equal(w, state[name]))
        state[name] = w
    assert changed == len(merged)  # every adapted weight moved
    base.load_state_dict(state)
    p = make_pack(seed=seed)
    for got, want in zip(_heads(model, p), _heads(base, p), strict=True):
        assert _rel(got, want) <= REL


def test_only_adapters_learn_and_packs_stay_isolated() -> None:
    _, model = _pair(0)
    p = make_pack()
    out, _ = run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
                 labels=p["labels"], loss_mask=p["loss_mask"])  # fmt: skip
    (out.loss + out.mtp_loss + out.aux_loss).backward()
    grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
    trainable = {n for n, q in model.named_parameters() if q.requires_grad}
    assert grads.keys() == trainable and trainable
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "gate_A", "gate_B", "up_A", "up_B",
                                        "down_A", "down_B") for n in trainable)  # fmt: skip
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    heads = _heads(model, p)
    cu = p["cu"].tolist()
    for a, b in itertools.pairwise(cu[:-1]):  # every real sample alone
        alone = _heads(model, {"ids": p["ids"][a:b], "cu": None, "pos": None, "padding": None})
        for h, ha in zip(heads, alone, strict=True):
            assert _rel(h[0, a:b], ha[0]) <= REL, (a, b)
    assert cross_sample_grad(model, p, 2, 1) == 0.0
    assert cross_sample_grad(model, p, 2, 2) > 0.0  # the probe is live


def _expert_case(dtype, shared: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    counts, d, f, r = [5, 0, 9, 2], 16, 8, 8  # rows of r bf16 values: 16 bytes, as grouped_mm needs
    m, e, n = sum(counts), len(counts), 1 if shared else len(counts)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype).requires_grad_()

    weights = [rnd(m, d), rnd(e, 2 * f, d), rnd(e, d, f)]
    pairs = {"gate": (rnd(n, r, d), rnd(n, f, r)), "up": (rnd(n, r, d), rnd(n, f, r)),
             "down": (rnd(n, r, f), rnd(n, d, r))}  # fmt: skip
    return counts, weights, pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared"])
def test_routed_adapters_as_grouped_gemms_equal_the_loop(dtype, shared) -> None:
    counts, weights, pairs = _expert_case(dtype, shared)
    results = []
    for fn in (grouped_experts_reference, grouped_experts_grouped_mm):
        ins = [w.detach().clone().requires_grad_() for w in weights]
        ps = {k: tuple(t.detach().clone().requires_grad_() for t in v) for k, v in pairs.items()}
        lora = ExpertLoRA(**ps, scale=2.0)
        y = fn(ins[0], counts, ins[1], ins[2], limit=1.0, lora=lora)
        y.float().square().sum().backward()
        grads = [t.grad for t in ins] + [t.grad for v in ps.values() for t in v]
        results.append([y.detach(), *grads])
    # fp32: the same products in the same order; bf16: each GEMM rounds its output once
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for got, want in zip(*results, strict=True):
        assert _rel(got.float(), want.float()) <= tol


def test_grouped_mm_refuses_adapter_rows_it_cannot_align() -> None:
    counts, weights, pairs = _expert_case(torch.bfloat16, shared=False)
    narrow = {k: (a[:, :4].contiguous(), b[..., :4].contiguous()) for k, (a, b) in pairs.items()}
    x, w_gu, w_d = weights
    assert grouped_mm_refuses(x, counts, w_gu, w_d, limit=1.0, lora=ExpertLoRA(**pairs)) is None
    why = grouped_mm_refuses(x, counts, w_gu, w_d, limit=1.0, lora=ExpertLoRA(**narrow))
    assert why == "LoRA rank 4 x 2 bytes is not a multiple of 16"
