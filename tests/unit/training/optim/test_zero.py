"""ShardedAdamW (training.zero) on one process: torch's AdamW bit for bit with and without host
offload, the offload split, parameter groups, clipping, the warmup/cosine schedule, and its
state round trip across offload fractions."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from train_fakes import tiny_run

from primus_v4.errors import ConfigError
from primus_v4.parallel.groups import ParallelContext
from primus_v4.training.optim.lr_schedule import warmup_cosine
from primus_v4.training.optim.zero import (
    ShardedAdamW,
    build_sharded_optimizer,
    no_decay,
    pick_offloaded,
)
from primus_v4.training.optim.zero_state import load_optimizer_state, optimizer_state

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SCHEDULE = dict(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=10)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4)
    )


def _sharded(model: nn.Module, offload: float = 0.0) -> tuple[ShardedAdamW, LambdaLR]:
    opt = ShardedAdamW(list(model.named_parameters()), ParallelContext.single(), **HYPER,
                       offload_fraction=offload)  # fmt: skip
    return opt, LambdaLR(opt, warmup_cosine(**SCHEDULE))


def _torch_adamw(model: nn.Module) -> tuple[torch.optim.AdamW, LambdaLR]:
    """The oracle: torch's AdamW on the parameters, weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    keep = [p for p in model.parameters() if p.ndim < 2]
    hyper = {k: v for k, v in HYPER.items() if k != "weight_decay"}
    groups = [{"params": decay, "weight_decay": HYPER["weight_decay"]},
              {"params": keep, "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, **hyper)
    return opt, LambdaLR(opt, warmup_cosine(**SCHEDULE))


def _train(model, opt, sched, *, steps: int = 5, seed: int = 1, clip: float | None = None):
    """`steps` steps of two micro-batches each; (losses, grad norms before clipping)."""
    sharded = isinstance(opt, ShardedAdamW)
    gen = torch.Generator().manual_seed(seed)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        if sharded:
            opt.begin(2)
        for x in torch.randn(6, 8, generator=gen).chunk(2):
            loss = model(x).pow(2).mean()
            loss.backward()  # accumulates: into the fp32 buckets, or into .grad
            losses.append(loss.item())
        if sharded:
            opt.reduce_gradients()
            if clip is not None:
                norms.append(opt.clip_grad_norm(clip))
        elif clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
    return losses, norms


@pytest.mark.parametrize("offload", [0.0, 0.5, 1.0])
def test_steps_torch_adamw_bit_for_bit(offload: float) -> None:
    ref = _model()
    ref_losses, _ = _train(ref, *_torch_adamw(ref))
    model = _model()
    losses, _ = _train(model, *_sharded(model, offload))
    assert losses == ref_losses
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name  # exact: fp32 masters step torch's CPU AdamW code
    assert not torch.equal(ref[0].weight, _model()[0].weight)  # the weights did move


def test_clipping_matches_torch() -> None:
    ref = _model()
    _, ref_norms = _train(ref, *_torch_adamw(ref), clip=0.05)
    model = _model()
    _, norms = _train(model, *_sharded(model), clip=0.05)
    assert all(n > 0.05 for n in ref_norms)  # every step clips
    # torch's norm accumulates in float32, ours in float64: the norms (and so the clipped
    # gradients) differ by float32 rounding, ~1e-7 relative.
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_offload_split_by_numel() -> None:
    assert pick_offloaded([100, 10, 50, 40], 0.0) == set()
    assert pick_offloaded([100, 10, 50, 40], 1.0) == {0, 1, 2, 3}
    assert pick_offloaded([100, 10, 50, 40], 0.5) == {0}  # 100 of 200
    assert pick_offloaded([100, 10, 50, 40], 0.75) == {0, 2}  # 150 of 200
    # 516 parameters; half is 258: the 16 x 16 weight (256) fits, nothing else does beside it.
    opt, _ = _sharded(_model(), offload=0.5)
    assert opt.state_bytes() == {
        "master_device": 0,  # float32 parameters on the device are their own masters
        "master_host": 4 * 256,
        "moments_device": 8 * 260,
        "moments_host": 8 * 256,
        "grad_buffers": 4 * 516,
    }
    on_host = [s for s in opt.slots if id(s) in opt._on_host]
    assert [s.name for s in on_host] == ["3.weight"] and not on_host[0].aliased
    assert on_host[0].master.data_ptr() != on_host[0].param.data_ptr()  # a copy, stepped apart


def test_no_decay_on_norms_biases_vectors() -> None:
    opt, _ = _sharded(_model())
    decay, keep = opt.param_groups
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert [s.name for s in opt.slots if s.group == 0] == ["0.weight", "3.weight", "4.weight"]
    assert len(keep["params"]) == 5  # 3 linear biases + LayerNorm weight and bias
    assert no_decay("layers.0.attn_norm.weight", torch.zeros(4, 4))  # a matrix named norm
    assert not no_decay("layers.0.attn.wq", torch.zeros(4, 4))


def test_warmup_then_cosine(tmp_path) -> None:
    run = tiny_run(tmp_path, "train.lr=1e-2", "train.min_lr=1e-3", "train.warmup_steps=2",
                   "train.steps=10")  # fmt: skip
    opt, sched = build_sharded_optimizer(run, _model())
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
def test_state_round_trip_across_offload(save_frac: float, load_frac: float) -> None:
    ref = _model()
    ref_opt, ref_sched = _sharded(ref, save_frac)
    _train(ref, ref_opt, ref_sched, steps=3)
    saved, sched_saved = copy.deepcopy(optimizer_state(ref_opt)), ref_sched.state_dict()
    resumed, fresh = _model(seed=5), _model(seed=5)
    for model in (resumed, fresh):
        model.load_state_dict(ref.state_dict())
    opt, sched = _sharded(resumed, load_frac)
    load_optimizer_state(opt, saved)
    sched.load_state_dict(sched_saved)
    _train(ref, ref_opt, ref_sched, steps=2, seed=7)
    _train(resumed, opt, sched, steps=2, seed=7)
    _train(fresh, *_sharded(fresh, load_frac), steps=2, seed=7)  # the moments start from zero
    for (name, a), b in zip(ref.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert not torch.equal(ref[3].weight, fresh[3].weight)  # so the state did matter


def test_bad_settings_raise() -> None:
    with pytest.raises(ConfigError, match="offload_fraction"):
        _sharded(_model(), offload=1.5)
    frozen = [(n, p.requires_grad_(False)) for n, p in _model().named_parameters()]
    with pytest.raises(ConfigError, match="no trainable parameters"):
        ShardedAdamW(frozen, ParallelContext.single(), **HYPER, offload_fraction=0.0)
    with pytest.raises(ConfigError, match="warmup_steps"):
        warmup_cosine(**{**SCHEDULE, "warmup_steps": 20})
    with pytest.raises(ConfigError, match="min_lr"):
        warmup_cosine(**{**SCHEDULE, "min_lr": 0.1})


def _lean_pair(micro: int) -> tuple[list[torch.Tensor], list[torch.Tensor], ShardedAdamW]:
    """Reduced gradients of one step of `micro` micro-batches: float32 buckets vs bf16 ones."""
    out, lean_opt = [], None
    for accum in (torch.float32, torch.bfloat16):
        model = _model().to(torch.bfloat16)
        opt = ShardedAdamW(list(model.named_parameters()), ParallelContext.single(), **HYPER,
                           offload_fraction=0.0, accum_dtype=accum)  # fmt: skip
        opt.zero_grad()
        opt.begin(micro)
        gen = torch.Generator().manual_seed(3)
        for x in torch.randn(3 * micro, 8, generator=gen).chunk(micro):
            model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.reduce_gradients()
        out.append([s.grad.clone() for s in opt.slots])
        lean_opt = opt
    return out[0], out[1], lean_opt


def test_bf16_buckets_hold_the_bf16_rounding_of_the_float32_sum() -> None:
    # One micro-batch: a bf16 gradient is exact in a bf16 bucket, so both paths agree bit for bit.
    full, lean, _ = _lean_pair(1)
    assert all(torch.equal(a, b) for a, b in zip(full, lean, strict=True))
    # Three: the bf16 bucket rounds each running sum once (float32 buckets do not).
    full, lean, opt = _lean_pair(3)
    assert not all(torch.equal(a, b) for a, b in zip(full, lean, strict=True))
    for a, b in zip(full, lean, strict=True):
        assert b.dtype == torch.float32
        # Two bf16 roundings of the running sum: within 2 x 2^-8 of the float32 sum's scale.
        assert (a - b).abs().max() <= 2 * 2**-8 * a.abs().max()
    fp32_bytes = sum(4 * s.param.numel() for s in opt.slots)
    assert opt.state_bytes()["grad_buffers"] == fp32_bytes // 2 + fp32_bytes  # + the copies
    opt.step()  # the float32 copies exist from the reduction to the step only
    assert opt.state_bytes()["grad_buffers"] == fp32_bytes // 2
    assert all(s.grad is None for s in opt.slots)


def test_bf16_buckets_need_float32_reduction() -> None:
    model = _model().to(torch.bfloat16)
    with pytest.raises(ConfigError, match="float32"):
        ShardedAdamW(list(model.named_parameters()), ParallelContext.single(), **HYPER,
                     offload_fraction=0.0, accum_dtype=torch.bfloat16,
                     grad_dtype=torch.float64)  # fmt: skip
