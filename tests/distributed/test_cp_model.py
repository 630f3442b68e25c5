"""CP1 == CP2 == CP4 for the whole tiny model (dense, CSA, HCA, MoE, mHC, MTP) on real gloo
process groups: loss, MTP loss, MoE balance loss and every parameter gradient after the sum over
CP ranks match one process holding the whole pack.

Legend: S = pack rows, T = rows per rank (S / cp).
Each rank backpropagates its share of the global objective, as the trainer does: its own rows'
CE sums over the GLOBAL token counts, plus the replicated balance loss over cp (the all-reduce of
its per-sample statistics sums the cp copies of its gradient back). Summed over ranks this is
exactly the CP = 1 objective, so gradients must agree up to float32 summation order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cp_layout import _pack

from primus_v4.models.deepseek_v4 import DeepseekV4Model
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.infra.cp_batch import (
    required_local_rows,
    shard_batch,
    shard_token_counts,
)
from primus_v4.models.deepseek_v4.layout import LocalComm
from primus_v4.parallel.context_parallel import CpComm

# A small vocabulary keeps the LM head (3 heads x S x V) from dominating the test time; every
# layer kind of the tiny preset stays. A larger init std makes attention far from uniform so a
# wrong key would show in the gradients.
BASE = {"vocab_size": 1024, "init_method_std": 0.05}
# Ranks own different window counts; S = 1024 so CP 4 still holds 256 >= 128 boundary rows.
RAGGED = ([333, 191, 277, 223], 0)
# Rank edges at 256 / 512 / 768: a 3-row segment across 256, a 100-row one across 512, a 2-row
# one across 768, a 1-row segment and trailing padding.
STRADDLE = ([255, 3, 202, 100, 207, 2, 200, 1, 14], 40)
# Only segments shorter than 128 (routine for Alpaca): no HCA window anywhere, so every rank's HCA
# pool is the dummy slot times 0, which must still give the same (zero) gradients on all ranks.
SHORT = ([100, 3, 127, 60, 1, 90, 111, 2], 18)


def _cfg(mtp: int, mtp_ratio: int) -> DeepseekV4Config:
    return DeepseekV4Config.preset("tiny", mtp_num_layers=mtp, mtp_compress_ratio=mtp_ratio, **BASE)


def _step(rank: int, cp: int, case: tuple, mtp: int, mtp_ratio: int, recompute: bool) -> dict:
    """One forward/backward of this rank's shard; losses and CP-summed gradients."""
    cfg = _cfg(mtp, mtp_ratio)
    torch.manual_seed(0)
    model = DeepseekV4Model(cfg, activation_checkpointing=recompute)
    batch = _pack(*case, seed=1)
    comm = CpComm(dist.group.WORLD) if cp > 1 else LocalComm()
    shard = shard_batch(
        batch, cp_rank=rank, cp_size=cp, mtp_depths=mtp, min_local_rows=required_local_rows(cfg)
    )
    local = shard_token_counts([shard], samples=batch.num_samples)
    counts = torch.tensor([local.supervised, *local.mtp], dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(counts)
    out = model(**shard.model_inputs(comm))
    n, n_mtp = counts[0].clamp(min=1), counts[1:].clamp(min=1)
    objective = out.loss_sum / n + out.aux_loss / cp
    if mtp:
        terms = torch.stack([s / c for s, c in zip(out.mtp_loss_sums, n_mtp, strict=True)])
        objective = objective + cfg.mtp_loss_scaling_factor * terms.mean()
    objective.backward()
    sums = torch.tensor(
        [
            float(out.loss_sum.detach()),
            *[float(s.detach()) for s in out.mtp_loss_sums],
            float(out.aux_loss.detach()) / cp,
        ],
        dtype=torch.float64,
    )
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    if cp > 1:
        dist.all_reduce(sums)
        for g in grads.values():
            dist.all_reduce(g)
    loss = float(sums[0] / n)
    mtp_loss = float((sums[1 : 1 + mtp] / n_mtp).mean()) if mtp else 0.0
    # Same parameters with gradients on every rank, or a bucketed gradient sum would misalign.
    names = sorted(grads)
    result = {"loss": loss, "mtp": mtp_loss, "aux": float(sums[-1]), "names": names}
    if rank == 0:
        result["grads"] = grads
    return result


def _compare(ref: dict, got: dict) -> None:
    # float32 forward; the CP run differs only in summation order (chunk edges, all-reduce).
    for key in ("loss", "mtp", "aux"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert ref["grads"].keys() == got["grads"].keys()
    for name, g_ref in ref["grads"].items():
        # Sums over up to 1024 rows: relative to the gradient's largest entry, with an absolute
        # floor for gradients that cancel to ~1e-7 (float32 eps x per-row terms ~1e-3 x rows).
        err = float((got["grads"][name] - g_ref).abs().max())
        assert err <= 1e-5 * float(g_ref.abs().max()) + 1e-9, (name, err)


CASES = [
    pytest.param(RAGGED, 1, 0, 2, False, id="ragged-cp2"),
    pytest.param(RAGGED, 1, 0, 4, False, id="ragged-cp4"),
    pytest.param(STRADDLE, 1, 0, 2, False, id="straddle-cp2"),
    pytest.param(STRADDLE, 1, 0, 4, False, id="straddle-cp4"),
    pytest.param(SHORT, 1, 0, 2, False, id="short-cp2"),
    # MTP depth 2 with packing; the MTP layer is CSA here so its compressor and indexer run
    # under CP too.
    pytest.param(STRADDLE, 2, 4, 2, False, id="mtp2-csa-cp2"),
    # Activation recompute replays the boundary exchanges and gathers inside backward.
    pytest.param(RAGGED, 2, 0, 2, True, id="mtp2-recompute-cp2"),
]


@pytest.mark.parametrize(("case", "mtp", "mtp_ratio", "cp", "recompute"), CASES)
def test_cp_matches_one_process(
    case: tuple, mtp: int, mtp_ratio: int, cp: int, recompute: bool
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _step(0, 1, case, mtp, mtp_ratio, recompute)
    finally:
        # Restored: later tests compare this process against subprocesses at the default count.
        torch.set_num_threads(threads)
    assert ref["grads"], "no gradients at CP = 1"
    got = run_ranks(_step, cp, case, mtp, mtp_ratio, recompute, timeout_s=120)
    for r in got[1:]:  # every rank reports the same reduced losses
        assert r["loss"] == got[0]["loss"] and r["aux"] == got[0]["aux"]
        assert r["names"] == got[0]["names"] == ref["names"]
    _compare(ref, got[0])
