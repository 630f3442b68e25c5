"""A tiny random release checkpoint with the real 129280-token vocabulary (so the real
tokenizer's ids fit), and `primus-v4 train` / `export` run on it in-process."""

from __future__ import annotations

import argparse
from pathlib import Path

from release_checkpoint import random_release_tensors, release_config, write_checkpoint

from primus_v4.commands import train

VOCAB = 129280


def write_pretrained(directory: Path) -> Path:
    """Geometry "a" of release_checkpoint at the real vocabulary, seed 3."""
    config = {**release_config("a"), "vocab_size": VOCAB}
    return write_checkpoint(directory, config, random_release_tensors(config, seed=3))


def train_items(tmp: Path, pretrained: Path, steps: int) -> list[str]:
    """`--set` items of a run from `pretrained` writing under `tmp` (run/, run/ckpt/)."""
    return [
        "model.preset=null",
        f"model.pretrained={pretrained}",
        "data.path=synthetic:rows=24",
        "data.seq_length=256",
        f"data.cache_dir={tmp / 'cache'}",
        f"data.lock_dir={tmp / 'locks'}",
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.global_batch_size=1",
        f"output.dir={tmp / 'run'}",
        "output.progress_bar=false",
        "output.plot=false",
        f"checkpoint.dir={tmp / 'run' / 'ckpt'}",
    ]


def run_command(module, items: list[str], extra: tuple[str, ...] = ()) -> int:
    """A `primus_v4.commands` module run as its CLI would, with `--set` items."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args([*extra, *(a for i in items for a in ("--set", i))]))


def train_one_step(pretrained: Path, tmp: Path) -> Path:
    """One training step from `pretrained` (metrics, config and step-1 checkpoint under tmp)."""
    assert run_command(train, train_items(tmp, pretrained, steps=1)) == 0
    return tmp
