"""`inspect memory`: the static terms follow the optimizer layout exactly; the CLI prints a plan."""

from __future__ import annotations

import pytest

from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.training.memory_plan import plan_memory
from primus_v4.training.trainer import build_model


def _rows(*settings: str, world: int = 1) -> dict[str, tuple[float, float]]:
    run = resolve_run(load_config(overrides=["data.seq_length=1024", *settings]), world=world)
    (plan,) = plan_memory(run)
    return {name.split(" (")[0]: (d, h) for name, d, h, _ in plan.rows}


def test_static_terms_follow_the_sharded_optimizer() -> None:
    run = resolve_run(load_config(), world=1)
    total = sum(p.numel() for p in build_model(run).parameters() if p.requires_grad)  # meta
    one = _rows()
    assert one["weights"] == (4 * total, 0)  # float32
    assert one["fp32 Adam moments"] == (8 * total, 0)
    assert "fp32 master chunks" not in one  # float32 parameters are their own masters
    two = _rows("train.global_batch_size=2", world=2)
    # dp=2: each rank holds ceil(N / 2) of every parameter's moments.
    assert two["fp32 Adam moments"][0] == pytest.approx(4 * total, rel=1e-4)
    bf16 = _rows("model.dtype=bfloat16", "optim.offload_fraction=0.5")
    dev, host = bf16["fp32 master chunks"]
    assert bf16["weights"][0] == 2 * total and dev + host == 4 * total
    assert host == pytest.approx(2 * total, rel=0.2)  # whole tensors, largest first, up to half


def test_cli_prints_the_plan(capsys) -> None:
    assert main(["inspect", "memory", "--set", "data.seq_length=512", "--device-memory",
                 "MI355X"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "memory plan per rank: world 1 = pp 1 x cp 1 x dp 1" in out
    assert "device MI355X (288 GiB)" in out and "3 saved activations" not in out
    assert "1 csa layers: saved activations x 1 micro-batch" in out
