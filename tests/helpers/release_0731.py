"""A tiny release in DeepSeek-V4-Flash-0731's layout: the V4 backbone (release_checkpoint.py's
geometry "a" at the real vocabulary) plus a DSpark drafter in place of the classic MTP block.

What 0731 changes (DESIGN.md section 14): three draft stages under `mtp.0.*`, `mtp.1.*`,
`mtp.2.*` (their own MoE, a Markov head, a confidence head), the `dspark_*` config.json keys, and
`compress_ratios` with three zero slots past the backbone's layers while
`num_nextn_predict_layers` stays 1. The drafter's tensors here keep the release's storage kinds
(FP8 e4m3 + e8m0 block scales, FP4 packed in int8 + e8m0 scales, bf16, fp32) and hold random
bytes, so a byte-for-byte carry is checked on every kind. Two shards and an index, the drafter in
the second, as a downloaded release holds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from release_checkpoint import random_release_tensors, release_config
from safetensors.torch import save_file

VOCAB = 129280
STAGES = 3
DSPARK_KEYS = {
    "dspark_block_size": 4,
    "dspark_noise_token_id": 128800,
    "dspark_target_layer_ids": [1, 2, 3],
    "dspark_markov_rank": 8,
}


def release_0731_config() -> dict:
    config = {**release_config("a"), "vocab_size": VOCAB, **DSPARK_KEYS}
    layers = config["num_hidden_layers"]
    config["compress_ratios"] = config["compress_ratios"][:layers] + [0] * STAGES
    config["num_nextn_predict_layers"] = 1
    return config


def _bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def drafter_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random DSpark stages (their own MoE of 4 experts, Markov and confidence heads)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, rank = config["hidden_size"], DSPARK_KEYS["dspark_markov_rank"]
    e8m0, fp8 = torch.float8_e8m0fnu, torch.float8_e4m3fn
    out: dict[str, torch.Tensor] = {}
    for k in range(STAGES):
        p = f"mtp.{k}."
        out[p + "e_proj.weight"] = _bytes((hidden, hidden), fp8, gen)
        out[p + "e_proj.scale"] = _bytes((1, 1), e8m0, gen)
        out[p + "norm.weight"] = _bytes((hidden,), torch.bfloat16, gen)
        out[p + "ffn.gate.weight"] = _bytes((4, hidden), torch.bfloat16, gen)
        out[p + "ffn.gate.bias"] = _bytes((4,), torch.float32, gen)
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                out[f"{p}ffn.experts.{e}.{w}.weight"] = _bytes((32, hidden // 2), torch.int8, gen)
                out[f"{p}ffn.experts.{e}.{w}.scale"] = _bytes((32, hidden // 32), e8m0, gen)
        out[p + "markov_head.u.weight"] = _bytes((rank, hidden), torch.bfloat16, gen)
        out[p + "markov_head.v.weight"] = _bytes((VOCAB, rank), torch.bfloat16, gen)
        out[p + "confidence_head.weight"] = _bytes((1, hidden), torch.float32, gen)
    return out


def write_release_0731(directory: Path, seed: int = 3) -> tuple[Path, dict[str, torch.Tensor]]:
    """The release directory and its drafter tensors (as written)."""
    config = release_0731_config()
    directory.mkdir(parents=True, exist_ok=True)
    backbone = random_release_tensors(config, seed=seed)
    drafter = drafter_tensors(config, seed=seed + 1)
    shards = {"model-00001-of-00002.safetensors": backbone,
              "model-00002-of-00002.safetensors": drafter}  # fmt: skip
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory, drafter
