"""LoRA under every parallel axis: `primus-v4 train` with rank-8 adapters (routed ones per
expert) on 4 gloo processes, PP2 x CP2 and CP2 x EP2 (DP 2), logs the same losses and grad norms
as one process for 3 steps, and resumes exactly from its step-2 checkpoint (adapters only, expert
adapters sharded like the experts). The learning rate is large enough that the adapters move the
losses visibly after step 1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from harness import train_metrics

from primus_v4.training.checkpoint.store import LATEST, step_dir

LORA = (
    "model.lora.rank=8",
    "model.lora.allow_random_base=true",
    "model.lora.alpha=16",
    "train.lr=0.02",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("lora")
    return train_metrics(tmp / "one", tmp, 1, *LORA), tmp


@pytest.mark.parametrize(
    "parallel",
    [("parallel.pp=2", "parallel.cp=2"), ("parallel.cp=2", "parallel.ep=2")],
    ids=["pp2xcp2", "cp2xep2"],
)
def test_lora_on_four_ranks_matches_one_process(reference, parallel: tuple[str, ...]) -> None:
    one, tmp = reference
    assert one[2]["loss"] != one[0]["loss"]  # the adapters learn
    name = "_".join(parallel)
    ckpt = tmp / name / "ckpt"
    saving = (f"checkpoint.dir={ckpt}", "checkpoint.interval=2")
    got = train_metrics(tmp / name, tmp, 4, *LORA, *parallel, *saving)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(one, got, strict=True):
        for key in ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr"):
            # float32 model: only summation order (CP/DP sums, all-to-all regrouping) differs.
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
    shutil.rmtree(step_dir(ckpt, 3))
    (ckpt / LATEST).write_text(step_dir(ckpt, 2).name + "\n")
    resumed = train_metrics(tmp / f"{name}_resumed", tmp, 4, *LORA, *parallel, *saving)
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "mtp_loss", "aux_loss", "grad_norm"):
        assert resumed[0][key] == got[2][key], key  # same layout, restored state: exact


def test_a_base_kept_as_released_on_four_ranks_matches_one_process(tmp_path: Path) -> None:
    """model.lora.base: release, PP2 x EP2 (DP 2): each rank quantizes its own stage and expert
    shard of the drawn base (FP4 scales per row, FP8 blocks within a weight), so the layouts
    hold the same bytes and log the same metrics as one process."""
    kept = (*LORA, "model.lora.base=release")
    one = train_metrics(tmp_path / "one", tmp_path, 1, *kept)
    got = train_metrics(tmp_path / "pp2_ep2", tmp_path, 4, *kept, "parallel.pp=2", "parallel.ep=2")
    assert [r["step"] for r in got] == [1, 2, 3] and one[2]["loss"] != one[0]["loss"]
    for a, b in zip(one, got, strict=True):
        for key in ("loss", "mtp_loss", "aux_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
