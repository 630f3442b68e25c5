"""fp32 master weights (training.zero) on one process.

float32: the trainer steps exactly what a plain trainer steps (the oracle: torch's AdamW on the
parameters, autograd `.grad` accumulation, the same float64 clip), bit for bit, with and without
host offload. bfloat16: the masters of a random-init run
start from the float32 draws (the bf16 weights hold their rounding); at lr 1e-6 (a fine-tune's lr,
whose updates are below half a bf16 ulp) the fp32 masters still learn and the bf16 weights are the
rounded masters; at the default lr the bf16 loss tracks the float32 one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from train_fakes import RAGGED_PACKS, FakeCorpus, FakeLM, tiny_run

from primus_v4.training.loss import StepLoss, count_tokens, reduce_counts
from primus_v4.training.trainer import Trainer


class PlainTrainer(Trainer):
    """The trainer on torch's AdamW and autograd's `.grad`: the oracle of float32 bit-identity."""

    def __init__(self, run, **kwargs) -> None:
        super().__init__(run, **kwargs)
        from torch.optim.lr_scheduler import LambdaLR

        from primus_v4.training.optim.lr_schedule import warmup_cosine
        from primus_v4.training.optim.zero import no_decay

        self.optimizer.remove_hooks()
        t, o = run.cfg.train, run.cfg.optim
        named = list(self.model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": t.weight_decay},
            {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        schedule = warmup_cosine(
            lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps
        )
        self.scheduler = LambdaLR(self.optimizer, schedule)

    def forward_backward(self, rows):
        counts = reduce_counts(count_tokens(rows, mtp_depths=self.mtp_depths), None)
        step_loss = StepLoss(counts, mtp_scale=self.mtp_scale)
        for row in rows:
            out = self.model(**self.model_inputs(row))
            step_loss.objective(out, samples=row.num_samples).backward()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return step_loss

    def _clip(self) -> float:
        from primus_v4.parallel.grad_norm import square_sum

        # torch's clip_grad_norm_ with the float64 norm (float32 would differ in the last bits).
        grads = [p.grad for p in self.params]
        norm = float(square_sum(grads, torch.device("cpu")).sqrt())
        coef = (self.cfg.train.clip_grad or math.inf) / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm


def _rows(result) -> list[tuple[float, ...]]:
    return [(r.loss, r.mtp_loss, r.aux_loss, r.grad_norm, r.lr) for r in result.rows]


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_float32_fake_model_is_bit_identical_to_torch_adamw(tmp_path, offload) -> None:
    settings = ("train.steps=4", "train.global_batch_size=2", "train.warmup_steps=1",
                "train.weight_decay=0.1", f"optim.offload_fraction={offload}")  # fmt: skip
    runs = {}
    for kind in (Trainer, PlainTrainer):
        trainer = kind(tiny_run(tmp_path / kind.__name__, *settings),
                       corpus=FakeCorpus(RAGGED_PACKS[:4]), model=FakeLM())  # fmt: skip
        runs[kind] = (_rows(trainer.train()), [p.detach() for p in trainer.model.parameters()])
    assert runs[Trainer][0] == runs[PlainTrainer][0]  # exact: same float32 ops, same order
    pairs = zip(runs[Trainer][1], runs[PlainTrainer][1], strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_float32_tiny_model_is_bit_identical_to_torch_adamw(tmp_path: Path) -> None:
    settings = ("train.steps=2", "train.global_batch_size=2", "train.warmup_steps=1",
                "optim.offload_fraction=0.5", f"model.overrides.vocab_size={512}")  # fmt: skip
    runs = {}
    for kind in (Trainer, PlainTrainer):
        trainer = kind(tiny_run(tmp_path / kind.__name__, *settings),
                       corpus=FakeCorpus(RAGGED_PACKS[:4]))  # fmt: skip
        runs[kind] = (_rows(trainer.train()), dict(trainer.model.named_parameters()))
    assert runs[Trainer][0] == runs[PlainTrainer][0]
    for name, p in runs[Trainer][1].items():
        assert torch.equal(p, runs[PlainTrainer][1][name]), name


SHORT_PACKS = [[60, 40, 28], [100, 20], [33, 90], [128], [70, 50], [64, 64]]  # seq 128 rows


def _changed_at_tiny_lr(tmp_path: Path, dtype: str, *settings: str) -> tuple[Trainer, int, int]:
    """(trainer, master weights changed, weights that ever had a nonzero gradient)."""
    run = tiny_run(tmp_path / f"{dtype}{len(settings)}", f"model.dtype={dtype}",
                   "data.seq_length=128", "train.global_batch_size=1", "train.lr=1e-6",
                   "train.min_lr=1e-7", "train.steps=20", "train.warmup_steps=1",
                   *settings)  # fmt: skip
    trainer = Trainer(run, corpus=FakeCorpus(SHORT_PACKS, seq_length=128))
    opt = trainer.optimizer
    before = [s.master.clone() for s in opt.slots]
    # Weights whose gradient is never nonzero (embedding rows of tokens absent from the packs)
    # stay put in any precision: they are counted apart.
    touched = [torch.zeros_like(s.master, dtype=torch.bool) for s in opt.slots]
    clip = opt.clip_grad_norm

    def recording_clip(max_norm: float, **parts: Any) -> float:
        for t, s in zip(touched, opt.slots, strict=True):
            t |= s.grad != 0
        return clip(max_norm, **parts)

    opt.clip_grad_norm = recording_clip
    trainer.train()
    changed = sum(int((s.master != b).sum()) for s, b in zip(opt.slots, before, strict=True))
    return trainer, changed, sum(int(t.sum()) for t in touched)


def test_bf16_masters_learn_at_a_fine_tuning_lr(tmp_path: Path) -> None:
    trainer, changed, touched = _changed_at_tiny_lr(tmp_path, "bfloat16")
    _, changed32, touched32 = _changed_at_tiny_lr(tmp_path, "float32")
    print(f"\nlr 1e-6, 20 steps: bf16 run: {changed:,} fp32 masters changed of {touched:,} with "
          f"a gradient; float32 run: {changed32:,} of {touched32:,}")  # fmt: skip
    # float32 leaves only weights whose Adam step stays below half an fp32 ulp (mHC mixer rows
    # with gradients ~1e-12); the masters must move as many (a bf16 AdamW moves ~2%).
    assert changed >= 0.99 * changed32 and changed32 >= 0.9 * touched32
    for s in trainer.optimizer.slots:
        assert s.master.dtype == torch.float32 and s.param.dtype == torch.bfloat16
        assert torch.equal(s.param.detach().view(-1), s.master.to(torch.bfloat16)), s.name


def test_bf16_masters_take_a_weight_decay_far_below_half_a_bf16_ulp(tmp_path: Path) -> None:
    # decoupled decay at lr 1e-6 scales a weight by 1 - 1e-7 per step: ~1 fp32 ulp, 1/20000 of
    # half a bf16 ulp, on every decayed weight (also embedding rows no gradient reaches)
    trainer, changed, _ = _changed_at_tiny_lr(tmp_path, "bfloat16", "train.weight_decay=0.1")
    slots = trainer.optimizer.slots
    total = sum(s.size for s in slots)
    print(f"\nlr 1e-6, weight decay 0.1, 20 steps: {changed:,} of {total:,} masters changed")
    assert changed >= 0.99 * total
    for s in slots:
        assert torch.equal(s.param.detach().view(-1), s.master.to(torch.bfloat16)), s.name


def test_bf16_masters_start_from_the_float32_init_not_its_rounding(tmp_path: Path) -> None:
    corpus = FakeCorpus(RAGGED_PACKS[:2])
    bf16 = Trainer(tiny_run(tmp_path / "bf16", "model.dtype=bfloat16"), corpus=corpus)
    fp32 = Trainer(tiny_run(tmp_path / "fp32", "model.dtype=float32"), corpus=corpus)
    init = dict(fp32.model.named_parameters())
    unrounded = 0
    for s in bf16.optimizer.slots:
        want = init[s.name].detach().view(-1)[s.lo : s.hi]
        assert torch.equal(s.master, want), s.name  # the float32 run's exact initial values
        assert torch.equal(s.param.detach().view(-1), s.master.to(torch.bfloat16)), s.name
        unrounded += int((s.master != s.master.to(torch.bfloat16).float()).sum())
    assert unrounded > 0.9 * sum(s.size for s in bf16.optimizer.slots)  # the draws, not 1s and 0s


def test_bf16_loss_tracks_float32_at_the_default_lr(tmp_path: Path) -> None:
    losses = {}
    for dtype in ("float32", "bfloat16"):
        run = tiny_run(tmp_path / dtype, f"model.dtype={dtype}", "data.seq_length=128",
                       "train.global_batch_size=1", "train.steps=6")  # fmt: skip
        corpus = FakeCorpus(SHORT_PACKS, seq_length=128)
        losses[dtype] = [r.loss for r in Trainer(run, corpus=corpus).train().rows]
    pairs = zip(losses["float32"], losses["bfloat16"], strict=True)
    deviation = max(abs(b - a) / a for a, b in pairs)
    print(f"\nbf16 vs float32 loss over 6 steps: max relative deviation {100 * deviation:.3f}%")
    assert deviation < 0.01  # bf16 activations: ~0.1% per step early in training


def _accumulated(grads: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """The reduced fp32 gradient ShardedAdamW hands AdamW after `grads` as micro-batches."""
    from primus_v4.parallel.groups import ParallelContext
    from primus_v4.training.optim.zero import ShardedAdamW

    p = torch.nn.Parameter(torch.zeros(grads[0].numel()))
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    opt = ShardedAdamW([("w", p)], ParallelContext.single(), **hyper, offload_fraction=0.0,
                       grad_dtype=dtype)  # fmt: skip
    opt.zero_grad()
    opt.begin(len(grads))
    for g in grads:
        (p * g).sum().backward()  # p.grad = g exactly
    opt.reduce_gradients()
    return opt.slots[0].grad.clone(), opt.state_bytes()


def test_float64_gradient_sums_do_not_depend_on_the_micro_batch_grouping() -> None:
    """What makes dp=2 reproduce dp=1 (training.zero): the float32 gradient of a step summed in
    float64 is the same whichever order the micro-batches arrive in."""
    gen = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-4, 4, (4, 4096), generator=gen)  # magnitudes 1e-4..1e3
    grads = list(torch.randn(4, 4096, generator=gen) * scale)
    orders = (grads, grads[2:] + grads[:2], grads[::-1])
    f32 = [_accumulated(list(o), torch.float32)[0] for o in orders]
    f64, buffers = zip(*(_accumulated(list(o), torch.float64) for o in orders), strict=True)
    assert not torch.equal(f32[0], f32[1])  # float32 sums do depend on the order (the premise)
    exact = torch.stack(grads).double().sum(0).float()
    assert all(g.dtype == torch.float32 and torch.equal(g, exact) for g in f64)
    # float64 buckets (here the bucket is its own shard) plus the fp32 copy AdamW steps on.
    assert buffers[0]["grad_buffers"] == 4096 * (8 + 4)
    assert _accumulated(grads, torch.float32)[1]["grad_buffers"] == 4096 * 4
