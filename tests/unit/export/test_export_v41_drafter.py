"""`primus-v4 export` of runs that train DeepSeek-V4.1's DSpark drafter (the golden tiny release
with three stages): a `joint` run's export holds the trained drafter as `mtp.*` in the release
layout (FP8 32 x 32, FP4 experts, bf16 / fp32 as released, or bf16), decoding to the trained
weights within the format's rounding, and the trained backbone as a plain run's export does; an
`only` run's export differs from its release in `mtp.*` alone, byte for byte elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dsv41_model import stored_bytes
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.export.run import export_checkpoint, find_source
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.release.state_dict_adapter import name_table
from primus_v4.models.deepseek_v41.release.tensors import kind_of
from primus_v4.training.trainer import Trainer

CHECKPOINT = Path(__file__).resolve().parents[3] / "tests/fixtures/dsv41_dspark_golden/checkpoint"
STEPS = 2
# |decoded - trained| <= bound x the tensor's largest |value|: e4m3 rounds to 3 mantissa bits
# (half a step: 1/16 of the value); e2m1 under a power-of-two scale s with the block's largest
# value in (3 s, 6 s]: at most s, a third of it
BOUND = {"fp8": 1 / 16, "fp4": 1 / 3}


def _run(tmp: Path, mode: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run of `mode` checkpointed at its last step: (checkpoint dir, its trained state)."""
    items = [
        "model.preset=null", f"model.pretrained={CHECKPOINT}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        f"train.steps={STEPS}", "train.warmup_steps=1", "train.global_batch_size=1",
        "train.lr=0.01", f"model.draft.train={mode}", "model.draft.anchor_rate=0.5",
        f"checkpoint.dir={tmp / 'ckpt'}", f"checkpoint.interval={STEPS}",
    ]  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=items), world=1),
                      corpus=FakeCorpus(RAGGED_PACKS))  # fmt: skip
    trainer.train()
    state = {n: t.detach().float().clone() for n, t in trainer.model.state_dict().items()}
    return tmp / "ckpt", state


def _stored(directory: Path) -> list[str]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return sorted(index["weight_map"])


@pytest.fixture(scope="module")
def joint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    return _run(tmp_path_factory.mktemp("joint"), "joint")


def test_the_release_kinds_of_the_drafter_are_its_name_tables() -> None:
    """The writer encodes `mtp.*` by name as the loader decodes them."""
    cfg = load_pretrained(CHECKPOINT, drafter=True, progress=False).cfg
    for entry in name_table(cfg, drafter=True).values():
        for rel in entry.release:
            assert kind_of(rel) == entry.kind, rel


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_joint_run_exports_its_trained_drafter(joint, dtype: str, tmp_path: Path) -> None:
    ckpt, trained = joint
    out = tmp_path / dtype
    export_checkpoint(find_source(ckpt), out, dtype=dtype)
    back = load_pretrained(out, drafter=True, progress=False)
    table = name_table(back.cfg, drafter=True)
    got = {n: t.float() for n, t in back.state_dict().items() if n in table}
    release = load_pretrained(CHECKPOINT, drafter=True, progress=False).state_dict()
    drafter = [n for n in table if n.startswith("dspark.")]
    assert drafter and any(not torch.equal(got[n], release[n].float()) for n in drafter)
    compared = [n for n in table if n in trained]  # the frozen Engram tables: placed, carried
    assert len(compared) == len(table) - len(back.cfg.engram_layer_ids)
    for name in compared:
        entry, want, have = table[name], trained[name], got[name]
        if entry.kind in BOUND and dtype == "fp8":
            err = float((have - want).abs().max())
            assert err <= BOUND[entry.kind] * float(want.abs().max()) + 1e-12, (name, err)
        elif entry.kind == "fp32":
            assert torch.equal(have, want), name
        else:  # bf16 kinds, and every quantized kind in a bf16 export: the bf16 rounding
            assert torch.equal(have, want.bfloat16().float()), name


def test_an_only_run_export_differs_from_its_release_in_the_drafter_alone(tmp_path: Path) -> None:
    ckpt, trained = _run(tmp_path, "only")
    out = tmp_path / "export"
    export_checkpoint(find_source(ckpt), out, dtype="fp8")
    names = _stored(CHECKPOINT)
    assert _stored(out) == names
    release, written = stored_bytes(CHECKPOINT, names), stored_bytes(out, names)
    differ = [n for n in names if not torch.equal(release[n][1], written[n][1])]
    assert differ and all(n.startswith("mtp.") for n in differ), differ[:5]
    back = load_pretrained(out, drafter=True, progress=False).state_dict()
    main_proj = "dspark.stages.0.main_proj.weight"
    err = float((back[main_proj].float() - trained[main_proj]).abs().max())
    assert err <= BOUND["fp8"] * float(trained[main_proj].abs().max())
