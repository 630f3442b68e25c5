"""Optimizer: parameter grouping, warmup/cosine schedule, offload bit-identity, state_dict."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from primus_v4.errors import ConfigError
from primus_v4.training.optim import build_optimizer, pick_offloaded

HYPER = dict(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=10, weight_decay=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4)
    )


def _train(offload: float, steps: int = 5) -> tuple[nn.Module, list[float]]:
    model = _model()
    opt, sched = build_optimizer(model.named_parameters(), offload_fraction=offload, **HYPER)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 8, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offload_is_bit_identical(fraction: float) -> None:
    ref, ref_losses = _train(0.0)
    off, losses = _train(fraction)
    assert losses == ref_losses
    for (name, a), b in zip(ref.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b), name  # exact: both sides run the same CPU AdamW code


def test_offload_split_by_numel() -> None:
    params = [torch.zeros(n) for n in (100, 10, 50, 40)]
    assert pick_offloaded(params, 0.0) == set()
    assert pick_offloaded(params, 1.0) == {0, 1, 2, 3}
    assert pick_offloaded(params, 0.5) == {0}  # 100 of 200
    assert pick_offloaded(params, 0.75) == {0, 2}  # 150 of 200


def test_no_decay_on_norms_biases_vectors() -> None:
    model = _model()
    opt, _ = build_optimizer(model.named_parameters(), **HYPER)
    decay, keep = opt.param_groups
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(keep["params"]) == 5  # 3 linear biases + LayerNorm weight and bias


def test_warmup_then_cosine() -> None:
    model = _model()
    opt, sched = build_optimizer(model.parameters(), **HYPER)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.5e-2) and lrs[1] == pytest.approx(1e-2)
    mid = 1e-3 + 0.5 * 9e-3 * (1 + math.cos(math.pi * 4 / 8))  # step 6 of the 8 cosine steps
    assert lrs[6] == pytest.approx(mid)
    assert lrs[10] == pytest.approx(1e-3) and lrs[11] == pytest.approx(1e-3)


@pytest.mark.parametrize(("save_frac", "load_frac"), [(0.0, 0.5), (1.0, 0.0), (0.5, 0.5)])
def test_state_dict_roundtrip_across_offload(save_frac: float, load_frac: float) -> None:
    ref, _ = _train(save_frac, steps=3)
    ref_opt, ref_sched = build_optimizer(
        ref.named_parameters(), offload_fraction=save_frac, **HYPER
    )
    # Give the saved optimizer real state, then continue both copies identically.
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(7))
    ref(x).sum().backward()
    ref_opt.step()
    ref_sched.step()
    ref_opt.zero_grad()
    sd, sched_sd = ref_opt.state_dict(), ref_sched.state_dict()

    other = _model()
    other.load_state_dict(ref.state_dict())
    opt, sched = build_optimizer(other.named_parameters(), offload_fraction=load_frac, **HYPER)
    opt.load_state_dict(sd)
    sched.load_state_dict(sched_sd)
    for model, o, s in ((ref, ref_opt, ref_sched), (other, opt, sched)):
        model(x * 2).sum().backward()
        o.step()
        s.step()
    for a, b in zip(ref.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_bad_settings_raise() -> None:
    model = _model()
    with pytest.raises(ConfigError, match="offload_fraction"):
        build_optimizer(model.parameters(), offload_fraction=1.5, **HYPER)
    with pytest.raises(ConfigError, match="warmup_steps"):
        build_optimizer(model.parameters(), **{**HYPER, "warmup_steps": 20})
