"""LoRA through the trainer (the real tiny model), the base decoded (bfloat16) or kept as
released (release: the drawn base quantized to FP8 / FP4 bytes): the base is frozen (its bytes
hash the same after training), only adapters have optimizer state and checkpoint bytes, the loss
falls, and a run resumed from its step-2 checkpoint ends exactly where the uninterrupted run
ends."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lora_runs import lora_trainer as _trainer

from primus_v4.training.checkpoint.store import LATEST, step_dir

ADAPTER_SUFFIXES = ("lora_A", "lora_B", "gate_A", "gate_B", "up_A", "up_B", "down_A", "down_B")
BASES = pytest.mark.parametrize("base", ["bfloat16", "release"])


def _digest(model: torch.nn.Module, names: set[str]) -> str:
    h = hashlib.sha256()
    for name, p in sorted([*model.named_parameters(), *model.named_buffers()]):
        if name in names:
            h.update(name.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _kept(model: torch.nn.Module) -> set[str]:
    """Names of the byte buffers of the weights kept as released."""
    return {n for n, _ in model.named_buffers() if n.endswith((".q", ".scale"))}


def _checkpoint_keys(path: Path) -> dict[str, torch.Size]:
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: getattr(m, "size", None) for k, m in meta.items()}


@BASES
def test_lora_trains_adapters_only_and_keeps_the_base(tmp_path: Path, base: str) -> None:
    trainer = _trainer(tmp_path, "run", "train.steps=4", "checkpoint.interval=4",
                       f"model.lora.base={base}")  # fmt: skip
    params = dict(trainer.model.named_parameters())
    kept = _kept(trainer.model)
    assert bool(kept) == (base == "release")
    base = {n for n, p in params.items() if not p.requires_grad} | kept
    adapters = {n for n, p in params.items() if p.requires_grad}
    assert adapters and all(n.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES for n in adapters)
    before = _digest(trainer.model, base)
    optimizer_names = {s.name for s in trainer.optimizer.slots}
    assert optimizer_names == adapters  # masters, moments and buckets: adapters only
    rows = trainer.train().rows
    assert _digest(trainer.model, base) == before  # the base's bytes, unchanged
    assert rows[-1].loss < rows[0].loss
    keys = _checkpoint_keys(step_dir(tmp_path / "run" / "ckpt", 4))
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    buffers = {n for n, _ in trainer.model.named_buffers()}
    assert adapters <= model_keys and model_keys <= adapters | buffers  # no base weight
    assert not model_keys & kept
    assert not any(k.startswith(f"optim.state.{n}.") for k in keys for n in base)


def _params(root: Path, step: int) -> dict[str, torch.Tensor]:
    path = step_dir(root, step)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model = {k[len("model.") :]: torch.empty(m.size) for k, m in meta.items()
             if k.startswith("model.") and hasattr(m, "size") and m.size}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming ... a single process", as intended
        dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
    return model


@BASES
def test_lora_resume_is_exact(tmp_path: Path, base: str) -> None:
    steps = ("train.steps=4", "checkpoint.interval=2", f"model.lora.base={base}")
    full = _trainer(tmp_path, "full", *steps).train().rows
    stopped = tmp_path / "resumed" / "ckpt"
    stopped.mkdir(parents=True)
    shutil.copytree(step_dir(tmp_path / "full" / "ckpt", 2), step_dir(stopped, 2))
    (stopped / LATEST).write_text(step_dir(stopped, 2).name + "\n")
    resumed = _trainer(tmp_path, "resumed", *steps).train().rows
    assert [r.step for r in resumed] == [3, 4]
    for key in ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr"):
        assert [getattr(r, key) for r in resumed] == [getattr(r, key) for r in full[2:]], key
    want, got = _params(tmp_path / "full" / "ckpt", 4), _params(stopped, 4)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
