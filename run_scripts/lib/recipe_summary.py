"""Turn the trainer's resolved config (one JSON line on stdin) into the recipe summary line.

The recipes print this for DRY_RUN=1: every value comes from the trainer's validated config, so
what is printed is what would run. Model shape fields come from the trainer's `derived` block
(the model as built), else `model.overrides`, else the preset file
primus_v4/configs/models/<preset>.yaml.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

PRESET_DIR = Path(__file__).resolve().parents[2] / "primus_v4" / "configs" / "models"


def lookup(config: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """`a.b.c` in a nested mapping, or as a flat key."""
    if dotted in config:
        return config[dotted]
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def model_field(config: dict[str, Any], name: str) -> Any:
    """A model field as built: the trainer's derived value, else an override, else the preset."""
    derived = lookup(config, f"derived.{name}")
    if derived is not None:
        return derived
    overrides = lookup(config, "model.overrides", {}) or {}
    if name in overrides:
        return overrides[name]
    if lookup(config, "model.pretrained"):
        return None  # the checkpoint's config.json decides; only derived values are known here
    preset = lookup(config, "model.preset") or "tiny"
    path = PRESET_DIR / f"{preset}.yaml"
    if path.exists():
        return (yaml.safe_load(path.read_text()) or {}).get(name)
    return None


def summarize(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    world = args.nnodes * args.gpus_per_node
    tp, pp, cp = (int(lookup(config, f"parallel.{k}", 1)) for k in ("tp", "pp", "cp"))
    layout = lookup(config, "data.layout")
    fused = bool(lookup(config, "model.fused_linear_ce"))
    return {
        "recipe": args.recipe,
        "seq_length": lookup(config, "data.seq_length"),
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "ep": lookup(config, "parallel.ep"),
        "etp": lookup(config, "parallel.etp"),
        "dp": lookup(config, "derived.dp", world // (tp * pp * cp)),
        "pp_layout": lookup(config, "parallel.pp_layout"),
        "nnodes": args.nnodes,
        "gpus_per_node": args.gpus_per_node,
        "world_size": world,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "global_batch_size": lookup(config, "train.global_batch_size"),
        "micro_batch_size": lookup(config, "train.micro_batch_size"),
        "steps": lookup(config, "train.steps"),
        "lr": lookup(config, "train.lr"),
        "optimizer_offload_fraction": lookup(config, "optim.offload_fraction"),
        "recompute": lookup(config, "model.recompute"),
        "recompute_modules": lookup(config, "model.recompute_modules"),
        "grad_accum_dtype": lookup(config, "optim.grad_accum_dtype"),
        "lora": lookup(config, "model.lora"),
        "fused_linear_ce": fused,
        # Unfused, the trainer uses one chunk spanning the row: the preset's size does not apply.
        "ce_chunk_size": model_field(config, "ce_chunk_size") if fused else None,
        "packed": layout == "thd",
        "layout": layout,
        "pack_algorithm": lookup(config, "data.algorithm"),
        "model_preset": lookup(config, "model.preset"),
        "pretrained": lookup(config, "model.pretrained"),
        "dtype": lookup(config, "model.dtype"),
        "num_layers": model_field(config, "num_layers"),
        "compress_ratios": model_field(config, "compress_ratios"),
        "mtp_num_layers": model_field(config, "mtp_num_layers"),
        "num_moe_experts": model_field(config, "num_moe_experts"),
        "moe_router_topk": model_field(config, "moe_router_topk"),
        "data_path": lookup(config, "data.path"),
        # The probed dir, else the config's data.tokenizer, else the bundled DeepSeek-V4 one.
        "tokenizer": args.tokenizer or lookup(config, "data.tokenizer") or "bundled",
        "pack_cache_dir": lookup(
            config, "derived.pack_cache.dir", lookup(config, "data.cache_dir")
        ),
        # The entry the run reads, and whether it is there already (built ahead by `pack`).
        "pack_cache_key": lookup(config, "derived.pack_cache.key"),
        "pack_cache_hit": lookup(config, "derived.pack_cache.hit"),
        "pack_lock_dir": lookup(config, "data.lock_dir"),
        "output_dir": lookup(config, "output.dir"),
        "checkpoint_dir": lookup(config, "checkpoint.dir"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--tokenizer", required=True)
    args = parser.parse_args()
    config = json.loads(sys.stdin.read())
    print(json.dumps(summarize(config, args), separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
