"""A resumed run is the run it resumes: for every family and mode that starts from a release,
a run resumed from its step-1 checkpoint logs the uninterrupted run's step-2 loss and grad norm
bit for bit (the release gives what the checkpoint does not hold: frozen Engram tables, the token
map, a kept or frozen base); a resume against another release is refused naming what differs.

One row per mode in MODES: a mode added later is one row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pretrained_runs import write_pretrained
from release_0731 import write_release_0731
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ResumeError
from primus_v4.training.checkpoint.store import LATEST, step_dir
from primus_v4.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
V41 = REPO / "tests" / "fixtures" / "dsv41_dspark_golden" / "checkpoint"
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "train.lr=0.02")
ENGRAM = "model.engram"

# mode: (release, extra --set items)
MODES: dict[str, tuple[str, tuple[str, ...]]] = {
    "v4 full": ("v4", ()),
    "v4 lora": ("v4", LORA),
    "v4 lora, base kept as released": ("v4_fp8", (*LORA, "model.lora.base=release")),
    "0731 full (drafter carried)": ("0731", ()),
    "v41 full, tables frozen replicated": ("v41", ()),
    "v41 full, tables frozen sharded": ("v41", (f"{ENGRAM}.placement=sharded",)),
    "v41 full, tables frozen in host memory": ("v41", (f"{ENGRAM}.placement=host",)),
    "v41 full, tables trainable replicated": ("v41", (f"{ENGRAM}.trainable=true",)),
    "v41 full, tables trainable sharded": (
        "v41", (f"{ENGRAM}.trainable=true", f"{ENGRAM}.placement=sharded")),
    "v41 lora": ("v41", LORA),
    "v41 drafter joint": ("v41", ("model.draft.train=joint", "model.draft.anchor_rate=0.5")),
    "v41 drafter only": ("v41", ("model.draft.train=only", "model.draft.anchor_rate=0.5")),
}  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the suite runs (tests/run.sh): a trainable Engram table's
    gradient sums rows in thread order on CPU, so two threads differ run to run in the last
    bits (~1e-6 of the step-2 grad norm), resumed or not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("releases")
    v4 = write_pretrained(tmp / "v4")
    save_pretrained(load_pretrained(v4, dtype=torch.float32, progress=False), tmp / "v4_fp8",
                    dtype="fp8", progress=False)  # fmt: skip
    return {"v4": v4, "v4_fp8": tmp / "v4_fp8", "0731": write_release_0731(tmp / "0731")[0],
            "v41": V41}  # fmt: skip


def _train(tmp: Path, release: Path, extra: tuple[str, ...] = (), steps: int = 2) -> dict:
    """A run from `release` on the fake corpus (tokens < 512: every release's vocabulary),
    checkpointing every step under tmp/run/ckpt; {step: metrics row} of what it trained."""
    items = [
        "model.preset=null", f"model.pretrained={release}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        f"train.steps={steps}", "train.warmup_steps=1", "train.global_batch_size=1",
        f"checkpoint.dir={tmp / 'run' / 'ckpt'}", "checkpoint.interval=1", *extra,
    ]  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=items), world=1),
                      corpus=FakeCorpus(RAGGED_PACKS))  # fmt: skip
    return {r.step: r for r in trainer.train().rows}


def _stopped_at_step_1(full: Path, into: Path) -> None:
    """`into`/run/ckpt: the uninterrupted run's checkpoint dir as it was after step 1."""
    ckpt = into / "run" / "ckpt"
    shutil.copytree(full / "run" / "ckpt", ckpt)
    shutil.rmtree(step_dir(ckpt, 2))
    (ckpt / LATEST).write_text(step_dir(ckpt, 1).name + "\n")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_resumed_run_is_the_uninterrupted_run(mode: str, releases, tmp_path: Path) -> None:
    release, extra = releases[MODES[mode][0]], MODES[mode][1]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    want = _train(full, release, extra)[2]
    _stopped_at_step_1(full, resumed)
    got = _train(resumed, release, extra)
    assert list(got) == [2], got
    print(f"{mode}: step-2 loss uninterrupted {want.loss!r} resumed {got[2].loss!r}")
    for key in ("loss", "grad_norm", "draft_loss", "draft_tau"):
        assert getattr(got[2], key) == getattr(want, key), key


def _flip_one_byte(src: Path, dst: Path, name: str) -> None:
    """A copy of release `src` whose tensor `name` differs in one byte."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / index[name]
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    start = json.loads(shard.read_bytes()[8 : 8 + header_len])[name]["data_offsets"][0]
    with open(shard, "r+b") as fh:
        fh.seek(8 + header_len + start)
        byte = fh.read(1)
        fh.seek(8 + header_len + start)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize(
    "tensor", ["layers.1.engram.embed.weight", "layers.3.attn.wo_b.weight"]
)  # a frozen table (the checkpoint lacks it) and a trained weight (the checkpoint replaces it)
def test_a_resume_against_another_release_is_refused_naming_the_tensor(
    tensor: str, tmp_path: Path
) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _train(full, V41, steps=1)
    other = tmp_path / "other"
    _flip_one_byte(V41, other, tensor)
    shutil.copytree(full / "run" / "ckpt", resumed / "run" / "ckpt")
    with pytest.raises(ResumeError) as err:
        _train(resumed, other)
    text = str(err.value)
    print(text)
    assert "\n" not in text and f"tensor '{tensor}'" in text
    assert f"differs from the release this run started from ({V41}" in text
    assert not (resumed / "run" / "metrics.jsonl").exists()
