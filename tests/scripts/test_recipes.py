"""The recipes resolve to the documented layouts (DRY_RUN=1 runs the trainer's own validation
with the real world size) and fail early, with a clear message, on a bad rendezvous."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from recipe_runner import ALPACA_DEMO, REPO, run_recipe, sparse_release

MULTINODE = {"MASTER_ADDR": "10.1.2.3", "NODE_RANK": "0"}
MULTINODE_RECIPES = [
    "run_full_4k_multinode.sh",
    "run_full_4k_thd_multinode.sh",
    "run_full_128k_thd_multinode.sh",
]


def _assert_flash_model(r: dict) -> None:
    # Flash: 43 layers (2 dense, then CSA/HCA alternating) + 1 MTP depth.
    assert r["num_layers"] == 43
    assert len(r["compress_ratios"]) == 43 and r["compress_ratios"][:2] == [0, 0]
    assert r["mtp_num_layers"] == 1


def test_full_4k_thd(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    run = run_recipe(
        "run_full_4k_thd_multinode.sh",
        tmp_path,
        **MULTINODE,
        PRIMUS_TOKENIZER_PROBE_DIRS=f"{tmp_path}/missing:{tok}",
    )
    r = run.resolved
    assert (r["seq_length"], r["tp"], r["pp"], r["cp"], r["ep"], r["etp"]) == (4096, 1, 3, 1, 8, 1)
    assert (r["nnodes"], r["gpus_per_node"], r["dp"]) == (3, 8, 8)
    assert r["optimizer_offload_fraction"] == 0.75
    assert r["packed"] is True and r["micro_batch_size"] == 1
    assert r["fused_linear_ce"] is False
    assert r["recompute"] == "selective" and r["grad_accum_dtype"] == "float32"
    assert r["recompute_modules"] == ["layernorm", "mla_up_proj", "core_attn"]
    _assert_flash_model(r)
    # Pack cache and lock dirs are node-local (under PRIMUS_LOCAL_ROOT), not the shared output.
    assert r["pack_cache_dir"].startswith(f"{tmp_path}/local/")
    assert r["pack_lock_dir"].startswith(f"{tmp_path}/local/")
    assert r["tokenizer"] == str(tok)
    launcher = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
    assert run.command.startswith(f"{launcher} --nnodes 3 --node_rank 0 --nproc_per_node 8 ")
    assert " -m primus_v4 train --config " in run.command
    assert f"--set data.tokenizer={tok}" in run.command


def test_packs_built_ahead_are_the_ones_the_recipe_reads(tmp_path):
    # `primus-v4 pack` with its defaults and the recipe with its defaults share one cache dir
    # (PRIMUS_LOCAL_ROOT/packs) and one key: the recipe's dry run reports the entry as a hit.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_PACK_")}
    env["PRIMUS_LOCAL_ROOT"] = str(tmp_path / "local")
    pack = subprocess.run(
        [sys.executable, "-m", "primus_v4", "pack", "--data", str(ALPACA_DEMO),
         "--seq-length", "4096", "--no-progress"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    key = re.search(r"cache +built +key=(\w+)", pack.stdout).group(1)
    run = run_recipe("run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE)
    r = run.resolved
    assert r["pack_cache_dir"] == f"{tmp_path}/local/packs"
    assert (r["pack_cache_key"], r["pack_cache_hit"]) == (key, True)
    # no release: one WARNING line says the model starts from random weights
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "starts from random weights" in warnings[0], run.stderr


def test_full_128k_thd(tmp_path):
    r = run_recipe("run_full_128k_thd_multinode.sh", tmp_path, **MULTINODE).resolved
    assert (r["seq_length"], r["tp"], r["pp"], r["cp"], r["ep"]) == (131072, 1, 3, 8, 8)
    assert (r["global_batch_size"], r["micro_batch_size"], r["dp"]) == (3, 1, 1)
    assert r["optimizer_offload_fraction"] == 0.9
    assert r["fused_linear_ce"] is True
    assert r["packed"] is True
    assert r["recompute"] == "selective" and r["grad_accum_dtype"] == "bfloat16"
    assert r["recompute_modules"] == ["layernorm", "mla_up_proj", "core_attn", "moe"]
    _assert_flash_model(r)


def test_dry_run_prints_the_memory_plan(tmp_path):
    run = run_recipe("run_full_128k_thd_multinode.sh", tmp_path, **MULTINODE,
                     PRIMUS_MEMORY_PLAN="1", PRIMUS_DEVICE_MEMORY="MI355X")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) == 2  # the plan goes to stderr
    assert "memory plan per rank: world 24 = pp 3 x cp 8 x dp 1, ep 8" in run.stderr
    assert "seq 131072, offload 0.9, device MI355X (288 GiB)" in run.stderr
    # The MI355X recipe spends the spare memory on float32 gradient buckets (MI300X: bf16).
    assert ("recompute selective:layernorm,mla_up_proj,core_attn,moe, gradient buffers float32"
            in run.stderr)  # fmt: skip
    assert "sparse attention saved as primus_turbo's" in run.stderr
    assert all(f"pipeline stage {i}:" in run.stderr for i in range(3))


def _stage_peaks(stderr: str) -> list[float]:
    line = next(x for x in stderr.splitlines() if x.startswith("device GiB per stage: "))
    return [float(v) for v in line.split(": ")[1].split(";")[0].split(" / ")]


@pytest.mark.parametrize("device,gib", [("MI300X", 192), ("MI355X", 288)])
@pytest.mark.parametrize("script", [*MULTINODE_RECIPES, "run_128k_thd_packed.sh"])
def test_every_recipe_plans_at_most_90_percent_of_the_device(tmp_path, script, device, gib):
    run = run_recipe(script, tmp_path, **MULTINODE, PRIMUS_MEMORY_PLAN="1",
                     PRIMUS_DEVICE_MEMORY=device)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert max(_stage_peaks(run.stderr)) <= 0.9 * gib, run.stderr


@pytest.mark.parametrize("base", ["release", "bfloat16"])
@pytest.mark.parametrize("seq,cp,gbs", [(4096, 1, 8), (32768, 8, 4)])
def test_one_node_flash_lora_fits_an_mi300x(tmp_path, seq, cp, gbs, base):
    run = run_recipe("run_lora_flash_1node.sh", tmp_path, PRIMUS_MEMORY_PLAN="1",
                     PRIMUS_SEQ_LENGTH=str(seq), PRIMUS_LORA_BASE=base,
                     PRIMUS_LORA_ALLOW_RANDOM_BASE="1")  # fmt: skip
    r = run.resolved
    assert (r["nnodes"], r["pp"], r["cp"], r["ep"], r["global_batch_size"]) == (1, 1, cp, 8, gbs)
    assert r["lora"]["rank"] == 16 and r["lora"]["expert_adapters"] == "per_expert"
    assert r["lora"]["base"] == base
    released = "base weights as released (FP8 / FP4 + ue8m0 scales)" in run.stderr
    assert released == (base == "release") and ("weights (bfloat16)" in run.stderr)
    assert "memory plan per rank: world 8 = pp 1 x cp" in run.stderr
    assert max(_stage_peaks(run.stderr)) <= 0.9 * 192, run.stderr
    _assert_flash_model(r)


def test_a_recipe_over_the_device_stops_with_one_line(tmp_path):
    run = run_recipe("run_full_128k_thd_multinode.sh", tmp_path, **MULTINODE,
                     PRIMUS_MEMORY_PLAN="1", PRIMUS_RECOMPUTE="none")  # fmt: skip
    assert run.returncode == 3 and run.stdout == ""
    errors = [x for x in run.stderr.splitlines() if "error" in x]
    assert errors == [run.stderr.strip().splitlines()[-1]], run.stderr  # one line, the last
    assert "pipeline stage 0 needs" in errors[0] and "192.0 GiB of MI300X" in errors[0]
    assert "PRIMUS_IGNORE_MEMORY_PLAN=1" in errors[0]
    run = run_recipe("run_full_128k_thd_multinode.sh", tmp_path, **MULTINODE,
                     PRIMUS_MEMORY_PLAN="1", PRIMUS_RECOMPUTE="none",
                     PRIMUS_IGNORE_MEMORY_PLAN="1")  # fmt: skip
    assert run.returncode == 0 and "--set train.ignore_memory_plan=true" in run.command


def test_base_4k_is_not_packed(tmp_path):
    r = run_recipe("run_full_4k_multinode.sh", tmp_path, **MULTINODE).resolved
    assert r["packed"] is False and r["layout"] == "bshd"
    assert (r["seq_length"], r["pp"], r["cp"], r["ep"]) == (4096, 3, 1, 8)
    assert r["optimizer_offload_fraction"] == 0.75


def test_callers_environment_wins(tmp_path):
    r = run_recipe("run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE, PRIMUS_CP="4").resolved
    assert (r["cp"], r["dp"]) == (4, 2)  # 24 ranks = PP3 x CP4 x DP2


def test_an_explicit_launcher_wins(tmp_path):
    run = run_recipe(
        "run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE, PRIMUS_TORCHRUN="/opt/bin/torchrun"
    )
    assert run.command.startswith("/opt/bin/torchrun --nnodes 3 --node_rank 0 ")


def test_single_node_3layer_128k(tmp_path):
    r = run_recipe("run_128k_thd_packed.sh", tmp_path).resolved
    assert (r["nnodes"], r["gpus_per_node"]) == (1, 8)
    assert (r["seq_length"], r["tp"], r["pp"], r["cp"], r["ep"]) == (131072, 1, 1, 8, 8)
    assert r["num_layers"] == 3 and sorted(r["compress_ratios"]) == [0, 4, 128]
    assert r["packed"] is True and r["fused_linear_ce"] is True


def test_impossible_layout_fails_in_dry_run(tmp_path):
    # 24 ranks cannot hold PP3 x CP5; the trainer's validation must reject it before launch.
    run = run_recipe("run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE, PRIMUS_CP="5")
    assert run.returncode == 3  # the trainer's status: a config error
    errors = [line for line in run.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith("primus-v4 train: error: "), run.stderr
    assert "parallel.cp=5" in errors[0], run.stderr  # the trainer's own message is the error
    assert run.stdout == ""


@pytest.mark.parametrize("script", MULTINODE_RECIPES)
def test_multinode_without_master_addr_fails_clearly(tmp_path, script):
    run = run_recipe(script, tmp_path, NODE_RANK="0")
    assert run.returncode != 0
    assert "MASTER_ADDR is not set" in run.stderr, run.stderr
    run = run_recipe(script, tmp_path, MASTER_ADDR="10.1.2.3")
    assert run.returncode != 0
    assert "NODE_RANK is not set" in run.stderr, run.stderr


def test_explicit_tokenizer_without_tokenizer_json_fails(tmp_path):
    run = run_recipe("run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE, V4_TOKENIZER="/nope")
    assert run.returncode != 0 and "has no tokenizer.json" in run.stderr


def test_bundled_tokenizer_can_be_refused(tmp_path):
    run = run_recipe(
        "run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE, PRIMUS_ALLOW_BUNDLED_TOKENIZER="0"
    )
    assert run.returncode != 0 and "no tokenizer.json in V4_TOKENIZER" in run.stderr


def test_pretrained_checkpoint_replaces_the_preset(tmp_path):
    from primus_v4.models.deepseek_v4 import DeepseekV4Config

    flash = tmp_path / "DeepSeek-V4-Flash"
    sparse_release(flash, DeepseekV4Config.preset("deepseek_v4_flash"))
    run = run_recipe(
        "run_full_4k_thd_multinode.sh", tmp_path, **MULTINODE, PRIMUS_PRETRAINED=str(flash)
    )
    r = run.resolved
    assert r["pretrained"] == str(flash) and r["model_preset"] is None
    _assert_flash_model(r)
    assert f"--set model.pretrained={flash}" in run.command
    assert "--set model.preset=null" in run.command


@pytest.mark.parametrize(
    ("script", "release"),
    [
        ("run_full_4k_thd_multinode.sh", "/apps/DeepSeek-V4-Flash"),
        ("run_v41_flash_lora_1node.sh", "/apps/DeepSeek-V4.1-Flash"),
    ],
)
def test_pretrained_without_config_json_fails_early(script, release, tmp_path):
    """The error names the directory and an example release of the recipe's own model."""
    run = run_recipe(script, tmp_path, **MULTINODE, PRIMUS_PRETRAINED=str(tmp_path))
    assert run.returncode != 0
    assert f"PRIMUS_PRETRAINED={tmp_path} has no config.json" in run.stderr
    assert f"e.g. PRIMUS_PRETRAINED={release}" in run.stderr
    if "v41" in script:
        assert "DeepSeek-V4-Flash" not in run.stderr


V41_LAYOUTS = {  # (script, device): nnodes, pp, cp, ep, seq
    ("run_v41_flash_full_thd_multinode.sh", "MI300X"): (8, 4, 1, 16, 4096),
    ("run_v41_flash_full_thd_multinode.sh", "MI355X"): (4, 4, 1, 8, 4096),
    ("run_v41_flash_full_128k_thd_multinode.sh", "MI300X"): (8, 4, 8, 16, 131072),
    ("run_v41_flash_full_128k_thd_multinode.sh", "MI355X"): (4, 4, 8, 8, 131072),
}


@pytest.mark.parametrize("script,device", list(V41_LAYOUTS))
def test_v41_flash_full_recipes_fit_their_device(tmp_path, script, device):
    """DeepSeek-V4.1-Flash full fine-tunes: the layout each device needs, Engram frozen and
    sharded, every stage's plan at most 90% of the device."""
    run = run_recipe(script, tmp_path, timeout=300, **MULTINODE, PRIMUS_MEMORY_PLAN="1",
                     PRIMUS_DEVICE_MEMORY=device)  # fmt: skip
    assert run.returncode == 0, run.stderr
    r = run.resolved
    assert (r["nnodes"], r["pp"], r["cp"], r["ep"], r["seq_length"]) == V41_LAYOUTS[script, device]
    assert r["model_preset"] == "deepseek_v41_flash" and r["num_layers"] == 40
    assert "--set model.engram.placement=sharded --set model.engram.trainable=false" in run.command
    assert "Engram tables, FP8 + e8m0 (sharded over" in run.stderr
    gib = {"MI300X": 192, "MI355X": 288}[device]
    assert max(_stage_peaks(run.stderr)) <= 0.9 * gib, run.stderr


def test_one_node_v41_flash_lora_fits_an_mi300x(tmp_path):
    run = run_recipe("run_v41_flash_lora_1node.sh", tmp_path, timeout=300,
                     PRIMUS_MEMORY_PLAN="1", PRIMUS_LORA_ALLOW_RANDOM_BASE="1")  # fmt: skip
    assert run.returncode == 0, run.stderr.strip().splitlines()[-1]
    r = run.resolved
    assert (r["nnodes"], r["pp"], r["cp"], r["ep"]) == (1, 1, 1, 8)
    assert r["lora"]["rank"] == 16 and r["lora"]["base"] == "release"
    assert "base weights as released (FP8 / FP4 + ue8m0 scales)" in run.stderr
    assert "Engram tables, FP8 + e8m0 (sharded over 8 ranks)" in run.stderr
    assert max(_stage_peaks(run.stderr)) <= 0.9 * 192, run.stderr


FLASH_RELEASE = REPO / "primus_v4" / "configs" / "models" / "releases" / "deepseek_v41_flash"
TINY_PUBLISHED = REPO / "tests" / "fixtures" / "dsv41_dspark_golden" / "checkpoint"


def test_v41_recipe_dry_runs_accept_the_published_config(tmp_path):
    """The published DeepSeek-V4.1-Flash config.json (43 compress ratios, attention_bias,
    vision_config): a copy of it alone plans the Flash recipe (the download still to come), and
    the tiny release of that shape dry-runs the one-node LoRA recipe."""
    flash = tmp_path / "flash"
    flash.mkdir()
    (flash / "config.json").write_text((FLASH_RELEASE / "config.json").read_text())
    script = "run_v41_flash_full_thd_multinode.sh"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = run_recipe(script, tmp_path / "a", **MULTINODE, PRIMUS_PRETRAINED=str(flash))
    assert run.returncode == 0, run.stderr
    assert run.resolved["num_layers"] == 40
    assert "holds a config.json and no weights" in run.stderr
    # the one-node LoRA recipe's EP 8 divides the tiny release's 8 experts (the full one's 16 not)
    run = run_recipe(
        "run_v41_flash_lora_1node.sh", tmp_path / "b", PRIMUS_PRETRAINED=str(TINY_PUBLISHED)
    )
    assert run.returncode == 0, run.stderr
    assert run.resolved["num_layers"] == 8 and run.resolved["ep"] == 8
    assert "compress_ratios" not in run.stderr
