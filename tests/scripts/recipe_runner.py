"""Run a recipe from run_scripts/ in a clean environment and parse its DRY_RUN output."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "run_scripts"
ALPACA_DEMO = REPO / "examples" / "data" / "alpaca_demo.json"

# Knob names the recipes read; stripped from the inherited environment so a developer's shell
# cannot change what a test sees.
_KNOB = re.compile(
    r"^(PRIMUS_\w+|NNODES|NODE_RANK|MASTER_ADDR|MASTER_PORT|GPUS_PER_NODE|NPROC|MBS|GBS|"
    r"TRAIN_STEPS|FUSED_\w+|V4_TOKENIZER|SOCKET_IFNAME|DRY_RUN|WORLD_SIZE|RANK|LOCAL_RANK|"
    r"SLURM_\w+|TORCHELASTIC_\w+)$"
)


@dataclass
class RecipeRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def resolved(self) -> dict:
        """The single-line JSON object (first stdout line)."""
        assert self.returncode == 0, f"recipe failed:\n{self.stderr}"
        lines = self.stdout.splitlines()
        assert len(lines) == 2, f"expected JSON line + command line, got:\n{self.stdout}"
        return json.loads(lines[0])

    @property
    def command(self) -> str:
        return self.stdout.splitlines()[1]


def run_recipe(
    script: str, tmp_path: Path, timeout: float = 120, args: tuple[str, ...] = (), **env: str
) -> RecipeRun:
    """`bash run_scripts/<script> [args]` with DRY_RUN=1 (unless overridden) and node-local dirs
    in tmp_path; the local corpus keeps the run offline."""
    proc = subprocess.run(
        ["bash", str(SCRIPTS / script), *args],
        cwd=tmp_path,
        env=recipe_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return RecipeRun(proc.returncode, proc.stdout, proc.stderr)


def recipe_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """The environment `run_recipe` gives a recipe: no knob inherited from the caller's shell,
    DRY_RUN=1, node-local and output dirs in tmp_path, the offline demo corpus, a free rendezvous
    port (two pytest workers may launch side by side); then `env`."""
    base = {k: v for k, v in os.environ.items() if not _KNOB.match(k)}
    base.update(
        DRY_RUN="1",
        PRIMUS_PYTHON=os.environ.get("PRIMUS_PYTHON", sys.executable),
        PRIMUS_DATA_PATH=str(ALPACA_DEMO),
        PRIMUS_LOCAL_ROOT=str(tmp_path / "local"),
        PRIMUS_OUTPUT_DIR=str(tmp_path / "out"),
        PRIMUS_TOKENIZER_PROBE_DIRS=str(tmp_path / "no_tokenizer_here"),
        PRIMUS_MEMORY_PLAN="0",  # builds the meta model (~10 s): one test asks for it
        MASTER_PORT=str(free_port()),
    )
    base.update(env)
    return base


def sparse_release(directory, cfg) -> None:
    """A release directory of `cfg` whose one shard holds a real header (every tensor the FP8
    release stores, FP8 / FP4 weights with their ue8m0 scales: name, dtype, shape and byte
    range) over a sparse file: validation reads the header and the size, never the data, so
    Flash's ~160 GB take no disk."""
    import json

    import torch

    from primus_v4.models.deepseek_v4.release.state_dict_adapter import (
        config_to_release,
        stored_tensors,
    )

    codes = {torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8", torch.float8_e8m0fnu: "F8_E8M0",
             torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}  # fmt: skip
    directory.mkdir()
    header, offset = {}, 0
    for name, (shape, dtype) in stored_tensors(cfg).items():
        size = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": codes[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    blob = json.dumps(header).encode()
    shard = directory / "model.safetensors"
    with shard.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
    os.truncate(shard, 8 + len(blob) + offset)
    (directory / "config.json").write_text(json.dumps(config_to_release(cfg)))
