"""`primus-v4 train` on 4 gloo processes combining axes logs the same losses and grad norms as one
process for 3 steps: PP2 x CP2 (1F1B over the step's 2 packs, each split over 2 CP ranks) and
CP2 x EP2 (DP 2 replicas, experts sharded over pairs of ranks that span DP and CP). Each layout
also saves at step 2 and resumes from it (stage-local parameter names under PP, expert shards
replicated over expert-DP under EP): the resumed step 3 equals the uninterrupted one exactly.
The router bias update runs at a rate large enough to change the routing after step 1, so the
later steps also show that every layout applies the same update from the same global loads and
that a resume restores the updated bias.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from harness import train_metrics

from primus_v4.training.checkpoint.store import LATEST, step_dir

# A 0.05 step changes the tiny model's routing: steps 2-3 aux loss moves ~0.5% vs no update.
BIAS_UPDATE = "model.router_bias_update_rate=0.05"


def _train(out: Path, cache: Path, world: int, *parallel: str) -> list[dict]:
    return train_metrics(out, cache, world, BIAS_UPDATE, *parallel)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("combos")
    return _train(tmp / "one", tmp, 1), tmp


@pytest.mark.parametrize(
    "parallel",
    [("parallel.pp=2", "parallel.cp=2"), ("parallel.cp=2", "parallel.ep=2")],
    ids=["pp2xcp2", "cp2xep2"],
)
def test_four_ranks_match_one_process(reference, parallel: tuple[str, ...]) -> None:
    one, tmp = reference
    name = "_".join(parallel)
    ckpt = tmp / name / "ckpt"
    saving = (f"checkpoint.dir={ckpt}", "checkpoint.interval=2")
    got = _train(tmp / name, tmp, 4, *parallel, *saving)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(one, got, strict=True):
        for key in ("total_tokens", "real_tokens", "supervised_tokens"):
            assert a[key] == b[key], key
        for key in ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr"):
            # float32 model: only summation order (CP/DP sums, all-to-all regrouping) differs.
            assert b[key] == pytest.approx(a[key], rel=1e-5), (b["step"], key)
    # As if the run had died after its step-2 save.
    shutil.rmtree(step_dir(ckpt, 3))
    (ckpt / LATEST).write_text(step_dir(ckpt, 2).name + "\n")
    resumed = _train(tmp / f"{name}_resumed", tmp, 4, *parallel, *saving)
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "mtp_loss", "aux_loss", "grad_norm"):
        assert resumed[0][key] == got[2][key], key  # same layout, restored state: exact
