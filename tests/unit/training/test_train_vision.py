"""`model.vision.train`: which parts of DeepSeek-V4.1's image encoder a run with images trains.

`frozen` (default) attaches the whole encoder outside the model; `aligner` makes the aligner and
the span vectors parameters of the model (the tower attached, frozen); `all` the tower too. The
trained parts load from the release, train, are checkpointed (a resumed run is the
uninterrupted one, bit for bit) and are exported in BF16 under the release's names; the frozen
ones are carried byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from image_corpus import RELEASE, GoldenImageCorpus, image_run
from safetensors import safe_open
from safetensors.torch import load_file
from threads import one_thread  # noqa: F401 (the fixture)
from train_fakes import FakeCorpus

from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ConfigError, DataError
from primus_v4.export.run import export_checkpoint, find_source
from primus_v4.models.deepseek_v41.vision import VisionTower, load_image_encoder
from primus_v4.training.checkpoint.store import LATEST, step_dir
from primus_v4.training.trainer import Trainer, check_images

pytestmark = pytest.mark.usefixtures("one_thread")
IMAGE_PARTS = ("vision.", "aligner.", "image_")


def _run(tmp: Path, train: str, *extra: str):
    return image_run(tmp, f"model.vision.train={train}", "train.lr=1e-3", *extra)


def _trained(trainer: Trainer) -> list[str]:
    return sorted(n for n, p in trainer.model.named_parameters()
                  if p.requires_grad and n.startswith(IMAGE_PARTS))  # fmt: skip


def test_each_choice_trains_its_parts_from_the_release(tmp_path: Path) -> None:
    released = load_image_encoder(RELEASE).state_dict()
    aligner_parts = sorted(n for n in released if not n.startswith("vision."))
    first = {}
    for train, parts in {"frozen": [], "aligner": aligner_parts, "all": sorted(released)}.items():
        trainer = Trainer(_run(tmp_path / train, train, "train.steps=2"),
                          corpus=GoldenImageCorpus())  # fmt: skip
        assert _trained(trainer) == parts
        own = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
               if n.startswith(IMAGE_PARTS)}  # fmt: skip
        for name, value in own.items():  # loaded from the release, not drawn
            assert torch.equal(value, released[name]), name
        attached = trainer.model.__dict__["image_encoder"]
        if train == "aligner":  # the frozen tower alone is attached
            assert isinstance(attached, VisionTower)
        assert (attached is None) == (train == "all")
        if attached is not None:
            assert not any(p.requires_grad for p in attached.parameters())
        rows = trainer.train().rows
        first[train] = rows[0].loss
        for name, p in trainer.model.named_parameters():
            if name in own:
                assert not torch.equal(p, own[name]), f"{name} did not train"
        if train == "aligner":
            tower = trainer.model._image_part("vision")
            for name, t in tower.state_dict().items():
                assert torch.equal(t, released["vision." + name]), "the frozen tower moved"
    print(f"step-1 losses {first}")
    # the same forward whatever trains: the parts start as released
    assert first["frozen"] == first["aligner"] == first["all"]


def _tensors(release: Path, prefix: tuple[str, ...]) -> dict[str, torch.Tensor]:
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in index.items():
        if name.startswith(prefix):
            with safe_open(str(release / file), "pt") as f:
                out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("train", ["aligner", "all"])
def test_trained_parts_resume_bit_for_bit_and_export_in_bf16(tmp_path: Path, train: str) -> None:
    def run(into: Path) -> tuple[dict, Trainer]:
        trainer = Trainer(_run(into, train, "train.steps=2", "train.global_batch_size=1",
                               f"checkpoint.dir={into / 'ckpt'}", "checkpoint.interval=1"),
                          corpus=GoldenImageCorpus())  # fmt: skip
        return {r.step: r for r in trainer.train().rows}, trainer

    want, trainer = run(tmp_path / "full")
    ckpt = tmp_path / "resumed" / "ckpt"
    shutil.copytree(tmp_path / "full" / "ckpt", ckpt)
    shutil.rmtree(step_dir(ckpt, 2))
    (ckpt / LATEST).write_text(step_dir(ckpt, 1).name + "\n")
    got, resumed = run(tmp_path / "resumed")
    assert list(got) == [2]
    assert (got[2].loss, got[2].grad_norm) == (want[2].loss, want[2].grad_norm)
    trained = {n: p.detach() for n, p in trainer.model.named_parameters()
               if n.startswith(IMAGE_PARTS)}  # fmt: skip
    for name, p in resumed.model.named_parameters():
        if name in trained:
            assert torch.equal(p, trained[name]), f"{name}: the checkpoint did not restore it"

    out = tmp_path / "export"
    export_checkpoint(find_source(tmp_path / "full" / "ckpt"), out)
    released, exported = _tensors(RELEASE, IMAGE_PARTS), _tensors(out, IMAGE_PARTS)
    assert sorted(exported) == sorted(released)
    for name, t in exported.items():
        assert t.dtype == torch.bfloat16 == released[name].dtype, name
        if name in trained:  # the trained value, in BF16 as released
            assert torch.equal(t, trained[name].to(torch.bfloat16)), name
            if t.dim() == 2:  # small moves of a norm's ~1 may round back to its BF16
                assert not torch.equal(t, released[name]), name
        else:  # frozen: the release's bytes
            assert torch.equal(t.view(torch.int16), released[name].view(torch.int16)), name
    config = json.loads((out / "config.json").read_text())
    source = json.loads((RELEASE / "config.json").read_text())
    assert config["vision_config"] == source["vision_config"]
    assert config["image_token_id"] == source["image_token_id"]


def test_choices_that_cannot_train_stop_in_one_line(tmp_path: Path) -> None:
    cases = {
        ("model.vision.train=aligner", "model.preset=tiny"):
            "the deepseek_v4 family has no image encoder",
        ("model.vision.train=all", "model.preset=tiny_v41"):
            "trains the release's image encoder: set model.pretrained",
        ("model.vision.train=aligner", "model.preset=null", f"model.pretrained={RELEASE}",
         "parallel.pp=2"):
            r"one process or data parallel for now \(parallel\.pp=2\)",
    }  # fmt: skip
    text_release = RELEASE.parents[1] / "dsv41_golden" / "checkpoint"  # no vision tower
    for lora in ((), ("model.lora.rank=4", "model.lora.targets=[vision.wqkv]")):
        items = ("model.preset=null", f"model.pretrained={text_release}", *lora)
        cases[(*items, "model.vision.train=frozen" if lora else "model.vision.train=aligner")] = (
            r"vision_train '(aligner|all)' \(model\.vision\.train, or LoRA targets on the image "
            r"encoder\): the model has no image encoder"
        )
    for items, words in cases.items():
        with pytest.raises(ConfigError, match=words):
            resolve_run(load_config(overrides=[*items, "train.global_batch_size=2"]), world=2)
    with pytest.raises(ConfigError, match=r"model\.vision\.train.*LoRA freezes the base"):
        load_config(overrides=["model.vision.train=aligner", "model.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"model\.vision\.train"):
        load_config(overrides=["model.vision.train=tower"])
    run = _run(tmp_path, "aligner")
    with pytest.raises(
        DataError, match=r"hold no images, so model\.vision\.train=aligner has nothing"
    ):
        check_images(FakeCorpus([[100]]), run, "text.jsonl")
    check_images(FakeCorpus([[100]]), run, "eval.jsonl", training=False)  # held-out text: fine


def test_lora_adapters_on_the_image_encoder_train_and_export_merged(tmp_path: Path) -> None:
    """LoRA targets on the tower and the aligner: the model holds them as its (frozen) base with
    adapters (bias kept); step 1 is a text-only LoRA run's step 1 (B starts at zero), step 2 not;
    only adapters
    train; the merged export writes W + (alpha / r) B A in BF16 under the release's names and
    the rest of the encoder as released; the PEFT export names them as the release does and reads
    back as the run's adapters."""
    from primus_v4.export.run import export_adapters
    from primus_v4.models.deepseek_v41 import peft

    lora = ("model.lora.rank=4", "model.lora.alpha=8", "train.lr=1e-2", "train.steps=2")
    targets = "model.lora.targets=[wq_a,vision.wqkv,vision.w2,aligner.w1]"
    run = image_run(tmp_path, *lora, targets, f"checkpoint.dir={tmp_path / 'ckpt'}",
                    "checkpoint.interval=2")  # fmt: skip
    trainer = Trainer(run, corpus=GoldenImageCorpus())
    trained = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(".lora_" in n for n in trained)
    assert {n.rsplit(".", 1)[0] for n in trained if not n.startswith("layers.")} == {
        *(f"vision.blocks.{i}.{m}" for i in range(2) for m in ("attn.wqkv", "mlp.w2")),
        "aligner.w1",
    }
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
            if not p.requires_grad and n.startswith(IMAGE_PARTS)}  # fmt: skip
    assert trainer.model.aligner.w1.bias is not None  # the frozen bias stays
    rows = trainer.train().rows
    text_only = image_run(tmp_path / "text", *lora, "model.lora.targets=[wq_a]")
    text = Trainer(text_only, corpus=GoldenImageCorpus()).train().rows
    assert rows[0].loss == pytest.approx(text[0].loss, rel=1e-12)  # B = 0: the same forward
    assert abs(rows[1].loss - text[1].loss) > 1e-6, "the encoder's adapters changed nothing"
    for name, p in trainer.model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), f"{name}: the frozen base moved"

    out = tmp_path / "merged"
    export_checkpoint(find_source(tmp_path / "ckpt"), out)
    released, exported = _tensors(RELEASE, IMAGE_PARTS), _tensors(out, IMAGE_PARTS)
    assert sorted(exported) == sorted(released)
    adapted = {n.rsplit(".", 1)[0] for n in trained if not n.startswith("layers.")}
    for name, t in exported.items():
        module = name.rsplit(".", 1)[0]
        if module in adapted and name.endswith(".weight"):
            lin = trainer.model.get_submodule(module)
            assert torch.equal(t, lin.merged_weight().to(torch.bfloat16)), name
            assert not torch.equal(t, released[name]), name
        else:
            assert torch.equal(t.view(torch.int16), released[name].view(torch.int16)), name
    # PEFT's format, on the release's module names; read back, the run's adapters
    export_adapters(find_source(tmp_path / "ckpt"), tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["aligner.w1", "attn.wq_a", "attn.wqkv", "mlp.w2"]
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    lin = trainer.model.aligner.w1
    assert torch.equal(tensors["base_model.model.aligner.w1.lora_B.weight"], lin.lora_B[0])
    back = peft.to_ours(tensors, trainer.model)
    assert sorted(back) == trained
    for name, p in trainer.model.named_parameters():
        if name in back:
            assert torch.equal(back[name], p), name
