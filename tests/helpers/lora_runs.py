"""A tiny LoRA run on the fake corpus, as the LoRA training and export tests start it."""

from __future__ import annotations

from pathlib import Path

from train_fakes import RAGGED_PACKS, FakeCorpus, tiny_run

from primus_v4.training.trainer import Trainer

LORA = ("model.lora.rank=8", "model.lora.allow_random_base=true", "model.lora.alpha=16",
        "train.global_batch_size=2", "train.warmup_steps=1", "train.lr=0.01")  # fmt: skip


def lora_trainer(tmp: Path, name: str, *settings: str) -> Trainer:
    run = tiny_run(tmp / name, *LORA, f"checkpoint.dir={tmp / name / 'ckpt'}", *settings)
    return Trainer(run, corpus=FakeCorpus(RAGGED_PACKS))
