"""Sharded pretrained load: 4 gloo processes at PP=2 x EP=2 build the model on the meta device,
cut their stage and expert shard, and fill it from one FP8/FP4 release checkpoint. Each rank
holds exactly its slice of the one-process model loaded from the same directory (bit-equal) and
reads exactly the stored bytes of the release tensors of its slice (weights + scales), measured
by the reader and printed: its stage's non-expert tensors and half of that stage's experts,
never the other stage's layers or the other half's experts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from release_checkpoint import random_release_tensors, release_config

from primus_v4.checkpoint_formats.sharded import CheckpointReader, write_checkpoint
from primus_v4.models.deepseek_v4.infra.parallelize import parallelize
from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v4.release.load import (
    load_pretrained,
    load_rank_weights,
    read_config,
)
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel
from primus_v4.parallel.pipeline_layout import plan_stages


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Geometry "a" (dense, CSA, HCA layers, a hash layer, MTP) as an FP8 + FP4 release in
    several shards."""
    # more and wider experts than geometry "a" has, so experts dominate the bytes as in the
    # release (Flash: ~95% of the checkpoint) and each rank's share is near a quarter
    config = {**release_config("a"), "n_routed_experts": 32, "moe_intermediate_size": 64}
    tensors = random_release_tensors(config, seed=11)
    cfg = adapter.config_from_release(config)
    kinds = {r.name: r.kind for r in adapter.release_tensors(cfg).values()}
    out = tmp_path_factory.mktemp("release") / "fp8"
    write_checkpoint(out, tensors.items(), kinds, config, dtype="fp8", max_shard_bytes=64 * 1024)
    return out


def _load_rank(rank: int, world: int, directory: str, ckpt_root: str) -> dict:
    from primus_v4.config import dump_yaml, load_config
    from primus_v4.models.deepseek_v4 import DeepseekV4Model
    from primus_v4.training.checkpoint.store import save
    from primus_v4.training.optim.zero import ShardedAdamW

    ctx = init_parallel(ParallelDims(world=world, pp=2, ep=2), backend="gloo")
    try:
        with torch.device("meta"):
            full = DeepseekV4Model(read_config(directory))
        loads = []
        done = parallelize(
            full, ctx, pp_layout=None, packed=True, device=torch.device("cpu"), seed=0,
            weights=lambda m: loads.append(load_rank_weights(m, directory)),
        )  # fmt: skip
        model = done.model
        # the layout's DCP checkpoint, exported below (with an optimizer and the run's config
        # stored in the step, as the trainer saves)
        run = load_config(overrides=["model.preset=null", f"model.pretrained={directory}"])
        opt = ShardedAdamW(list(model.named_parameters()), ctx, lr=1e-3, betas=(0.9, 0.95),
                           eps=1e-8, weight_decay=0.0, offload_fraction=0.0)  # fmt: skip
        save(ckpt_root, step=1, model=model, optimizer=opt,
             extra_files={"config.yaml": dump_yaml(run)})  # fmt: skip
        return {
            "pp": ctx.pp.rank,
            "ep": ctx.ep.rank,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "sharded": {n for n, p in model.named_parameters() if getattr(p, "expert_parallel", 0)},
            "bytes_read": loads[0].bytes_read,
            "total": loads[0].checkpoint_bytes,
        }
    finally:
        destroy_parallel()


def _release_names_of_rank(names: list[str], layers: set[int], first: bool, last: bool,
                           experts: range) -> set[str]:  # fmt: skip
    """Which release tensors a rank keeps, from the names alone (independent of the table)."""
    keep = set()
    for name in names:
        m = re.match(r"layers\.(\d+)\.", name)
        if m:
            if int(m.group(1)) not in layers:
                continue
        elif name.startswith(("mtp.", "head.", "norm.", "hc_head_")):
            if not last:
                continue
        elif name.startswith("embed.") and not (first or last):
            continue  # (the last stage keeps an embedding copy for MTP)
        e = re.search(r"\.experts\.(\d+)\.", name)
        if e and int(e.group(1)) not in experts:
            continue
        keep.add(name)
    return keep


@pytest.fixture(scope="module")
def loaded(fp8_release: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    root = tmp_path_factory.mktemp("dcp") / "ckpt"
    return run_ranks(_load_rank, 4, str(fp8_release), str(root), timeout_s=180), root


def test_pp2_ep2_ranks_load_exactly_their_slice(fp8_release: Path, loaded) -> None:
    ranks = loaded[0]
    ref = load_pretrained(fp8_release, dtype=torch.float32, progress=False).state_dict()
    cfg = read_config(fp8_release)
    specs = plan_stages(pp=2, num_layers=cfg.num_layers, mtp_num_layers=cfg.mtp_num_layers or 0,
                        layout=None)  # fmt: skip
    local = cfg.num_moe_experts // 2
    with CheckpointReader(fp8_release) as reader:
        names = reader.names()
        nbytes = {n: reader.nbytes(n) for n in names}
    seen: set[str] = set()
    report = []
    for r in ranks:
        for name, value in r["state"].items():
            want = ref[name]
            if name in r["sharded"]:
                want = want[r["ep"] * local : (r["ep"] + 1) * local]
            assert torch.equal(value, want), (r["pp"], r["ep"], name)
            seen.add(name)
        spec = specs[r["pp"]]
        experts = range(r["ep"] * local, (r["ep"] + 1) * local)
        mine = _release_names_of_rank(names, set(spec.decoder_layers), spec.has_embedding,
                                      spec.has_loss, experts)  # fmt: skip
        assert r["bytes_read"] == sum(nbytes[n] for n in mine), (r["pp"], r["ep"])
        whole_stage = _release_names_of_rank(names, set(spec.decoder_layers), spec.has_embedding,
                                             spec.has_loss, range(cfg.num_moe_experts))  # fmt: skip
        stage_experts = sum(nbytes[n] for n in whole_stage if ".experts." in n)
        # its stage only, and of that stage's experts exactly its half
        assert sum(nbytes[n] for n in mine if ".experts." in n) * 2 == stage_experts
        report.append({"pp": r["pp"], "ep": r["ep"], "bytes_read": r["bytes_read"],
                       "stage_bytes": sum(nbytes[n] for n in whole_stage),
                       "checkpoint_bytes": r["total"],
                       "fraction": round(r["bytes_read"] / r["total"], 3)})  # fmt: skip
        assert r["bytes_read"] < r["total"], report
    assert seen == set(ref), set(ref) ^ seen
    print("sharded load, bytes per rank:", json.dumps(report))


def test_export_of_the_pp2_ep2_checkpoint_is_the_release_again(
    fp8_release: Path, loaded, tmp_path: Path
) -> None:
    """The DCP checkpoint the 4 ranks wrote (stages + expert shards) exports in one process to
    the release tensors the model was loaded from: bf16 values of the dequantized weights for
    the fp8 / fp4 / bf16 kinds, exact for fp32 and int64."""
    from primus_v4.export.run import export_checkpoint, find_source

    root = loaded[1]
    summary = export_checkpoint(find_source(root), tmp_path / "out", max_shard_bytes=256 * 1024)
    assert summary.shards > 1
    with CheckpointReader(tmp_path / "out") as got, CheckpointReader(fp8_release) as src:
        assert got.names() == src.names()
        for name in src.names():
            want = src.read(name, torch.float32 if src.storage(name) != "int64" else None)
            if src.storage(name) in ("fp8", "fp4", "bf16"):
                want = want.to(torch.bfloat16)
            assert torch.equal(got.read(name), want), name


def _load_rank_kept(rank: int, world: int, directory: str) -> dict:
    """As `_load_rank`, with the base kept as released (model.lora.base: release): the stage's
    FP8 / FP4 weights are read undecoded into their byte buffers."""
    from primus_v4.models.common.kept_base import release_weights
    from primus_v4.models.deepseek_v4 import DeepseekV4Model
    from primus_v4.models.deepseek_v4.release.kept_base import keep_release_base

    ctx = init_parallel(ParallelDims(world=world, pp=2, ep=2), backend="gloo")
    try:
        cfg = read_config(directory)
        with torch.device("meta"):
            full = DeepseekV4Model(cfg)
        loads = []
        done = parallelize(
            full, ctx, pp_layout=None, packed=True, device=torch.device("cpu"), seed=0,
            weights=lambda m: loads.append(load_rank_weights(m, directory)),
            prepare=lambda m: keep_release_base(m, cfg, dtype=torch.float32),
        )  # fmt: skip
        kept = {w.ours: w() for w in release_weights(done.model)}
        return {"ep": ctx.ep.rank, "kept": kept, "state": done.model.state_dict(),
                "bytes_read": loads[0].bytes_read}  # fmt: skip
    finally:
        destroy_parallel()


def test_pp2_ep2_ranks_keep_their_slice_as_released(fp8_release: Path, loaded) -> None:
    """Each rank's kept weights decode to its slice of the one-process decoded model (experts:
    its half), the rest of its state is as loaded decoded, and it reads the same stored bytes."""
    ranks = run_ranks(_load_rank_kept, 4, str(fp8_release), timeout_s=180)
    ref = load_pretrained(fp8_release, dtype=torch.float32, progress=False).state_dict()
    local = read_config(fp8_release).num_moe_experts // 2
    covered: set[str] = set()
    for r, d in zip(ranks, loaded[0], strict=True):
        assert r["ep"] == d["ep"] and r["bytes_read"] == d["bytes_read"]
        assert r["kept"] and r["state"].keys() == d["state"].keys() - r["kept"].keys()
        for name, value in r["kept"].items():
            want = ref[name]
            if name.endswith(("w_gate_up", "w_down")):
                want = want[r["ep"] * local : (r["ep"] + 1) * local]
            assert torch.equal(value, want), (r["ep"], name)
            covered.add(name)
        assert all(torch.equal(v, d["state"][k]) for k, v in r["state"].items())
    assert any(n.endswith("w_gate_up") for n in covered) and any(".wq_a." in n for n in covered)
