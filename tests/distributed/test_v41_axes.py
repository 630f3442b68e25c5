"""DeepSeek-V4.1 on every parallel axis: the tiny V4.1 preset trained 3 steps on gloo logs the
losses, balance losses and grad norms of one process (the axis parity table).

Three launches: one process (the reference), 2 ranks running pp2, cp2, ep2 and dp2 one after
the other, 4 ranks running pp2 x cp2 and cp2 x ep2 (each layout builds its own process groups
inside the launch). The packs put sample edges where the axes cut: the CP edge (row 128) falls
inside a sample, inside a 2:1 compression group (the sample starting at row 33) and inside
Engram's 3-token look-back; pp2 cuts before layer 4, so the second stage receives layer 3's
ratio-1 pool, index keys, selection and candidate blocks and holds an Engram layer (4); pp2 x cp2
cuts before layer 2, so layer 1's ratio-2 pool, gathered over the CP ranks, crosses the stages.
dp2 steps the sharded optimizer (ZeRO-1, each rank holds about half the state: asserted).
The 2-rank launch also compares every parameter gradient of one pack at cp2 with one process,
runs dp2 with the Engram tables sharded over the ranks (frozen, and trainable against a trainable
one-process reference), and resumes the trainable sharded run from its step-2 checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from test_cp_layout import _pack
from train_fakes import FakeCorpus, tiny_run

from primus_v4.models import model_spec
from primus_v4.models.deepseek_v4.infra.cp_batch import shard_batch
from primus_v4.models.deepseek_v4.layout import LocalComm
from primus_v4.models.deepseek_v4.moe import MoE
from primus_v4.models.deepseek_v41.infra.cp_batch import required_local_rows
from primus_v4.parallel.context_parallel import CpComm
from primus_v4.parallel.groups import destroy_parallel
from primus_v4.training.trainer import Trainer

PACKS = [[100, 70, 60], [33, 150, 60], [127, 3, 111], [200, 40], [90, 90, 60], [250]]
# lr 1e-3 (the tiny run's 5e-3 / 5): AdamW divides by sqrt(v) + eps, so where a gradient element
# is near eps it turns float32 summation-order differences into weight differences of ~lr x 1e-3
# (training/optim/zero.py); at 5e-3 cp2's step-3 grad norm drifted by 1e-5 (measured), at 1e-3 by
# 1e-6. float64 replica sums make dp2 step the gradients of one process bit for bit.
SETTINGS = ("model.preset=tiny_v41", "train.steps=3", "train.global_batch_size=2",
            "train.warmup_steps=1", "train.lr=1e-3", "optim.grad_reduce_dtype=float64",
            # Engram rows 32 wide: a frozen table is held in its FP8 encoding (1 x 32 blocks)
            "model.overrides.engram_head_dim=32")  # fmt: skip
KEYS = ("loss", "aux_loss", "grad_norm")
LAYOUTS = {
    2: {
        "pp2": ("parallel.pp=2", "parallel.pp_layout=Et*4|t*2L"),
        "cp2": ("parallel.cp=2",),
        "ep2": ("parallel.ep=2",),
        "dp2": (),
        # Engram tables sharded by rows over DP (each rank holds half), frozen and trainable
        "dp2 engram sharded": ("model.engram.placement=sharded",),
        "dp2 engram sharded trainable": (
            "model.engram.placement=sharded",
            "model.engram.trainable=true",
        ),
        # quantization-aware: each rank rounds its own experts' FP4 rows (one scale per 32
        # inputs of a row, so a shard's rounding is the whole's rows)
        "ep2 quant_aware": ("parallel.ep=2", "train.quant_aware=release"),
    },
    4: {
        "pp2xcp2": ("parallel.pp=2", "parallel.pp_layout=Et*2|t*4L", "parallel.cp=2"),
        "cp2xep2": ("parallel.cp=2", "parallel.ep=2"),
    },
}
# The reference of each layout: one process with the same `model.engram` (frozen replicated by
# default; the trainable layouts against trainable replicated).
REFERENCE = {"dp2 engram sharded trainable": "one trainable", "ep2 quant_aware": "one quant_aware"}
# float32 model: only summation order (CP/DP gradient sums, all-to-all regrouping) differs.
TOLERANCE = 1e-5


def _train(world: int, out: Path, parallel: tuple[str, ...]) -> dict:
    run = tiny_run(out, *SETTINGS, *parallel, world=world)
    trainer = Trainer(run, corpus=FakeCorpus(PACKS))
    try:
        rows = [{k: getattr(r, k) for k in KEYS} for r in trainer.train().rows]
        b = trainer.optimizer.state_bytes()
        moe = next(m for m in trainer.model.modules() if isinstance(m, MoE))
        return {
            "rows": rows,
            "optimizer_bytes": sum(b[k] for k in ("master_device", "master_host",
                                                  "moments_device", "moments_host")),
            "local_experts": moe.w_gate_up.shape[0],
            "engram_rows": sum(p.hi - p.lo for n, p in trainer.model.named_modules()
                               if n.endswith("engram.placed")),
            "layers": sorted(int(n.split(".")[1]) for n, _ in trainer.model.named_parameters()
                             if n.startswith("layers.") and n.endswith("attn_norm.weight")),
        }  # fmt: skip
    finally:
        trainer.runtime.close()
        destroy_parallel()


def _rank(rank: int, world: int, out: str) -> dict[str, dict]:
    if world == 1:
        trainable = ("model.engram.trainable=true",)
        return {"one": _train(1, Path(out) / "one", ()),
                "one trainable": _train(1, Path(out) / "trainable", trainable),
                "one quant_aware": _train(1, Path(out) / "qat",
                                          ("train.quant_aware=release",))}  # fmt: skip
    got = {
        name: _train(world, Path(out) / name / f"rank{rank}", parallel)
        for name, parallel in LAYOUTS[world].items()
    }
    if world == 2:
        got["cp2 gradients"] = _cp_gradients(rank)
        got["engram resume"] = _resume_trainable_engram(rank, Path(out) / "resume")
    return got


def _resume_trainable_engram(rank: int, out: Path) -> dict:
    """dp2 with a trainable sharded Engram table checkpointed at step 2, resumed from a copy of
    that checkpoint: the resumed step 3 against the uninterrupted one."""
    settings = (*LAYOUTS[2]["dp2 engram sharded trainable"], "checkpoint.interval=2")
    whole = _train(2, out / f"whole{rank}", (*settings, f"checkpoint.dir={out / 'ckpt'}"))
    if rank == 0:
        step = "step_00000002"
        shutil.copytree(out / "ckpt" / step, out / "from2" / step)
        (out / "from2" / "latest").write_text(step)
    dist.barrier()
    resumed = _train(2, out / f"resumed{rank}", (*settings, f"checkpoint.dir={out / 'from2'}"))
    return {"whole": whole["rows"][-1], "resumed": resumed["rows"][-1]}


# CP edge at row 128 inside the sample of rows 33-182: its 2:1 group (127, 128) straddles the
# edge, rows 128-129 look back to Engram n-grams of the previous rank, windows reach across, and
# candidate blocks matter (150 ratio-1 positions: 19 blocks of 8, 4 kept); trailing padding.
EDGES = ([33, 150, 44, 20, 1], 8)


def _objective(model, inputs: dict, cp: int) -> dict[str, torch.Tensor]:
    """Loss and aux of one pack over the global supervised count, and every gradient summed
    over the CP ranks (each rank backpropagates its share of the global objective)."""
    out = model(**inputs)
    n = inputs["loss_mask"].sum().to(torch.float64)
    if cp > 1:
        dist.all_reduce(n)
    (out.loss_sum / n + out.aux_loss / cp).backward()
    sums = torch.stack([out.loss_sum.detach().double(), out.aux_loss.detach().double() / cp])
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    if cp > 1:
        dist.all_reduce(sums)
        for g in grads.values():
            dist.all_reduce(g)
    return {"sums": sums, **grads}


def _cp_gradients(rank: int) -> dict[str, float]:
    """cp2 vs one process on one pack: the largest difference of every parameter's gradient,
    relative to that gradient's largest element, and of the loss and balance sums."""
    spec = model_spec("deepseek_v41")
    # init std 0.05: attention far from uniform, so a wrong key or pool position would show.
    cfg = spec.config_class.preset("tiny_v41", vocab_size=1024, init_method_std=0.05)
    batch = _pack(*EDGES, seed=1)
    got = []
    for cp, comm in ((1, LocalComm()), (2, CpComm(dist.group.WORLD))):
        model = spec.build(cfg)
        model.init_weights(3)
        rows = required_local_rows(cfg)
        shard = shard_batch(batch, cp_rank=rank % cp, cp_size=cp, min_local_rows=rows)
        got.append(_objective(model, shard.model_inputs(comm), cp))
    one, two = got
    assert set(one) == set(two)
    return {k: float((one[k] - two[k]).abs().max() / one[k].abs().max().clamp(min=1e-30))
            for k in one}  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # In a worker like the others: one torch thread, so its kernels sum in the workers' order.
    return run_ranks(_rank, 1, str(tmp_path_factory.mktemp("v41one")), timeout_s=300)[0]


def _max_diff(one: dict, ranks: list[dict], name: str) -> dict[str, tuple[float, float]]:
    """Largest (absolute, relative) |layout - one process| per metric over the 3 steps and
    every rank."""
    worst = dict.fromkeys(KEYS, (0.0, 0.0))
    for got in ranks:
        rows = got[name]["rows"]
        assert len(rows) == len(one["rows"]) == 3
        for a, b in zip(one["rows"], rows, strict=True):
            for k in KEYS:
                d = abs(b[k] - a[k])
                rel = d / max(abs(a[k]), 1e-30)
                worst[k] = (max(worst[k][0], d), max(worst[k][1], rel))
    return worst


def _check(single: dict, ranks: list[dict]) -> None:
    for name in LAYOUTS[len(ranks)]:
        worst = _max_diff(single[REFERENCE.get(name, "one")], ranks, name)
        print(f"\n{name}: max |difference| vs one process (absolute / relative) "
              + ", ".join(f"{k} {a:.2e} / {r:.2e}" for k, (a, r) in worst.items()))  # fmt: skip
        for k, (a, r) in worst.items():
            assert max(a, r) <= TOLERANCE, (name, k, a, r)


@pytest.mark.parametrize("world", [2, 4])
def test_every_axis_matches_one_process(single, world: int, tmp_path: Path) -> None:
    ranks = run_ranks(_rank, world, str(tmp_path), timeout_s=600)
    for name in ("one", "one trainable", "one quant_aware"):
        print(f"\n{name} process:", [[round(r[k], 6) for k in KEYS] for r in single[name]["rows"]])
    _check(single, ranks)
    single = single["one"]
    experts = single["local_experts"]
    for name, parallel in LAYOUTS[world].items():
        ep = 2 if "parallel.ep=2" in parallel else 1
        assert all(r[name]["local_experts"] == experts // ep for r in ranks), name
    if world == 2:
        grads = ranks[0]["cp2 gradients"]
        worst = max(grads, key=grads.get)
        print(
            f"cp2 one pack: loss/aux sums {grads['sums']:.2e}, worst gradient {worst} "
            f"{grads[worst]:.2e} (of {len(grads) - 1} parameters)"
        )
        # float32 summation order only (CP sums of partial gradients); measured 2.0e-6.
        assert grads[worst] <= TOLERANCE, worst
        # pp2 split at the layout's cut; dp2 (ZeRO-1): each replica holds half of the state,
        # plus at most one element per parameter (chunks are ceil(N / 2)).
        assert [r["pp2"]["layers"] for r in ranks] == [[0, 1, 2, 3], [4, 5]]
        share = [r["dp2"]["optimizer_bytes"] / single["optimizer_bytes"] for r in ranks]
        print(f"dp2 optimizer bytes per rank / one process: {share}")
        assert all(abs(s - 0.5) < 0.01 for s in share)
        # the tiny preset's Engram tables (4062 + 4152 rows): half on each rank, all on one
        assert single["engram_rows"] == 4062 + 4152
        for name in ("dp2 engram sharded", "dp2 engram sharded trainable"):
            assert [r[name]["engram_rows"] for r in ranks] == [4107, 4107], name
        # the table's rows and their optimizer state saved as rows of the whole table: exact
        for r in ranks:
            print("trainable sharded Engram, step 3 uninterrupted / resumed from step 2:",
                  r["engram resume"])  # fmt: skip
            assert r["engram resume"]["resumed"] == r["engram resume"]["whole"]
