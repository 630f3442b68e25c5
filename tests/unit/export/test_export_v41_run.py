"""`primus-v4 export` of a DeepSeek-V4.1 LoRA training run (the golden tiny release as its base,
the base kept as released): the run trains its adapters; `--format peft` writes the adapters on the
release's module names and, read back by `peft.to_ours`, they are the run's; `--format release`
writes the merged V4.1 release, every adapted weight the bf16 rounding of W + (alpha / r) B A, the
frozen Engram tables (placed, so in no checkpoint) the release's bytes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from dsv41_model import CHECKPOINT, stored_bytes
from lora_runs import lora_trainer
from safetensors.torch import load_file

from primus_v4.export.lora import is_adapter
from primus_v4.export.peft import CONFIG_FILE, WEIGHTS_FILE
from primus_v4.export.run import export_adapters, export_checkpoint, find_source
from primus_v4.models.common.lora import LoraSpec, merged_weights
from primus_v4.models.deepseek_v41 import peft
from primus_v4.models.deepseek_v41.lora import apply_lora
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.training.checkpoint.store import step_dir

STEPS = 2


def test_a_v41_lora_run_trains_and_exports(tmp_path: Path) -> None:
    trainer = lora_trainer(tmp_path, "v41", "model.preset=null", f"model.pretrained={CHECKPOINT}",
                           "model.lora.base=release", "model.lora.targets=[wq_a, wo_a, "
                           "shared_experts.w1, experts.w2, engram.wkv]", f"train.steps={STEPS}",
                           f"checkpoint.interval={STEPS}")  # fmt: skip
    losses = [m.loss for m in trainer.train().rows]
    assert len(losses) == STEPS and all(0 < x < 10 for x in losses)
    run = tmp_path / "v41"
    source = find_source(run / "ckpt")
    lora = source.run.model.lora

    model = load_pretrained(CHECKPOINT, progress=False)
    apply_lora(model, LoraSpec.of(lora), seed=source.run.train.seed)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": adapters}, checkpoint_id=step_dir(run / "ckpt", STEPS), no_dist=True)
    model.load_state_dict(adapters, strict=False)
    assert any(float(t.abs().max()) > 0 for n, t in adapters.items() if n.endswith("_B"))

    summary = export_adapters(source, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / CONFIG_FILE).read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert config["target_parameters"] == ["attn.wo_a.weight"]
    experts = [f"ffn.experts.{e}.w2" for e in range(model.cfg.num_moe_experts)]
    assert config["target_modules"] == sorted(["attn.wq_a", "ffn.shared_experts.w1",
                                               "engram.wkv", *experts])  # fmt: skip
    tensors = load_file(tmp_path / "peft" / WEIGHTS_FILE)
    assert summary.tensors == len(tensors)
    back = peft.to_ours(tensors, model)
    assert back.keys() == adapters.keys()
    assert all(torch.equal(back[n], adapters[n]) for n in adapters)

    export_checkpoint(source, tmp_path / "merged")
    merged = load_pretrained(tmp_path / "merged", progress=False).state_dict()
    for name, want in merged_weights(model).items():
        assert torch.equal(merged[name], want.bfloat16().float()), name
    # the Engram tables, frozen and placed (in no checkpoint): the release's bytes, carried
    tables = [f"layers.{n}.engram.embed.{p}" for n in (1, 4) for p in ("weight", "scale")]
    release, out = stored_bytes(CHECKPOINT, tables), stored_bytes(tmp_path / "merged", tables)
    for name in tables:
        assert out[name][0] == release[name][0], name
        assert torch.equal(out[name][1], release[name][1]), name
