"""The record of the release a run started from (training/checkpoint/release_reads.py) covers
every tensor of it: for the tiny image release with its drafter, every tensor the run reads
(text model, image encoder and aligner) is recorded as read and every other one (the drafter,
carried by an export) digested whole, part by part; a resume against a release changed in any
of them stops before any step naming the tensor. The record is the run's own: a link planted at
its directory is refused and its target left as it was, and a record that is not one (malformed,
not a regular file) is refused in one line naming it, a FIFO without blocking."""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from image_corpus import GoldenImageCorpus, image_run, tiny_image_script
from safetensors.torch import save_file
from shared_once import _shared
from threads import one_thread  # noqa: F401 (the fixture)

from primus_v4.checkpoint_formats.read_record import ReadRecord, recording_reads
from primus_v4.checkpoint_formats.sharded import CheckpointReader
from primus_v4.errors import PathError, ResumeError
from primus_v4.models.deepseek_v41 import model as v41_model
from primus_v4.models.deepseek_v41 import spec as v41_spec
from primus_v4.training.checkpoint import release_reads
from primus_v4.training.checkpoint.store import LATEST, step_dir
from primus_v4.training.trainer import Trainer

PARTS = ("text", "drafter", "encoder", "aligner")


def _part(name: str) -> str:
    head = name.partition(".")[0]
    if head.startswith("image_"):  # the span vectors, beside the aligner
        return "aligner"
    return {"mtp": "drafter", "vision": "encoder", "aligner": "aligner"}.get(head, "text")


def _by_part(names: set[str]) -> dict[str, set[str]]:
    return {part: {n for n in names if _part(n) == part} for part in PARTS}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/images' tiny release (text model, vision tower, aligner, span vectors), its
    model drawn with the DSpark drafter, so the release holds its three stages (`mtp.*`) too."""
    assert v41_spec.SPEC.build is v41_model.DeepseekV41Model  # its modules bound it already

    def make() -> str:
        script = tiny_image_script()
        out = tmp_path_factory.mktemp("tiny") / "release"
        with pytest.MonkeyPatch.context() as patch:
            drafter = functools.partial(v41_model.DeepseekV41Model, drafter=True)
            patch.setattr(v41_model, "DeepseekV41Model", drafter)
            script.write_release(out)
        return str(out)

    return Path(_shared(tmp_path_factory, "release_record_release", make))


def _stored(release: Path) -> set[str]:
    return set(json.loads((release / "model.safetensors.index.json").read_text())["weight_map"])


def _run(tmp: Path, release: Path, steps: int = 1):
    # fused_linear_ce=false: the CPU step takes ~1 s instead of ~10 s (no test here reads a loss)
    return image_run(tmp, f"model.pretrained={release}", f"train.steps={steps}",
                     f"checkpoint.dir={tmp / 'run' / 'ckpt'}", "checkpoint.interval=1",
                     "model.fused_linear_ce=false")  # fmt: skip


@pytest.fixture(scope="module")
def first(release: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """A one-step run with pictures from `release` (its checkpoint dir under run/ckpt) and the
    stored tensors it read (every CheckpointReader read of the release, seen below the record)."""

    def make() -> str:
        tmp, read = tmp_path_factory.mktemp("first"), set()
        pread = CheckpointReader._pread

        def seen(reader: CheckpointReader, stored, into, start: int = 0) -> None:
            if reader.directory == release:
                read.add(reader._name_at[stored.shard, stored.offset])
            pread(reader, stored, into, start)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(CheckpointReader, "_pread", seen)
            Trainer(_run(tmp, release), corpus=GoldenImageCorpus()).train()
        return json.dumps({"ckpt": str(tmp / "run" / "ckpt"), "read": sorted(read)})

    made = json.loads(_shared(tmp_path_factory, "release_record_first", make))
    return Path(made["ckpt"]), set(made["read"])


@pytest.mark.usefixtures("one_thread")
def test_every_tensor_of_the_release_is_recorded_part_by_part(release: Path, first) -> None:
    ckpt, read = first
    records = [json.loads(p.read_text()) for p in (ckpt / "release_reads").glob("rank*.json")]
    reads = {n for r in records for n in r["tensors"]}
    whole = {n for r in records for n in r["carried"]}
    stored, recorded = _by_part(_stored(release)), _by_part(reads | whole)
    for part, names in _by_part(read).items():
        print(f"{part}: {len(stored[part])} in the release, {len(names)} read by the run, "
              f"{len(_by_part(reads)[part])} recorded as read, {len(_by_part(whole)[part])} "
              f"digested whole, {len(recorded[part])} recorded")  # fmt: skip
        assert stored[part], part
    assert reads == read, "every read of the release is recorded, and only those as reads"
    assert whole == _stored(release) - read, "every other tensor is digested whole"
    assert recorded == stored
    assert _by_part(whole)["drafter"] == stored["drafter"]  # draft.train=off: carried
    assert all(stored[p] <= read for p in ("text", "encoder", "aligner"))


def _flip_one_byte(src: Path, dst: Path, name: str) -> None:
    """A copy of release `src` whose stored tensor `name` differs in its first byte."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    with CheckpointReader(dst) as reader:
        at = reader._stored(name).offset
    with open(dst / index[name], "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "tensor", ["vision.blocks.1.mlp.w2.weight", "aligner.w1.weight", "mtp.0.attn.wq_a.weight"]
)  # the frozen encoder and aligner (read when attached) and the drafter (carried, digested whole)
def test_a_resume_against_a_changed_encoder_or_drafter_is_refused(
    tensor: str, release: Path, first, tmp_path: Path
) -> None:
    assert tensor in _stored(release)
    ckpt = tmp_path / "run" / "ckpt"
    shutil.copytree(first[0], ckpt)
    shutil.rmtree(step_dir(ckpt, 2), ignore_errors=True)
    (ckpt / LATEST).write_text(step_dir(ckpt, 1).name + "\n")
    other = tmp_path / "other"
    _flip_one_byte(release, other, tensor)
    with pytest.raises(ResumeError) as err:
        Trainer(_run(tmp_path, other, steps=2), corpus=GoldenImageCorpus())
    text = str(err.value)
    print(text)
    assert "\n" not in text and f"tensor '{tensor}'" in text
    assert f"differs from the release this run started from ({release}" in text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tensor_digested_whole_is_one_read_of_all_its_bytes(tmp_path: Path) -> None:
    release = _release_dir(tmp_path)
    save_file({"a": torch.arange(12.0), "b": torch.ones(3)}, release / "model.safetensors")
    with recording_reads() as read, CheckpointReader(release) as reader:
        reader.read("a")  # stored as is: one read of the whole tensor
    whole = ReadRecord()
    with CheckpointReader(release) as reader:
        reader.carry_into(whole, "a")
        assert reader.bytes_read == 0  # nothing loaded
    assert whole.carried_json() == read.as_json() and not whole.reads


def _release_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "release"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


def _record() -> ReadRecord:
    record = ReadRecord()
    record.add("t", "model.safetensors", 0, memoryview(b"abcd"))
    return record


def test_a_link_planted_at_the_record_dir_is_refused_its_target_untouched(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank00005.json").write_text("theirs\n")
    root.mkdir()
    (root / "release_reads").symlink_to(elsewhere)
    release = _release_dir(tmp_path)
    with pytest.raises(PathError) as err:
        release_reads.save(root, rank=0, world=1, release=release, record=_record())
    text = str(err.value)
    print(text)
    assert "\n" not in text
    assert f"{root / 'release_reads'} is a symbolic link (to {elsewhere}); refused" in text
    assert sorted(p.name for p in elsewhere.iterdir()) == ["rank00005.json"]
    assert (elsewhere / "rank00005.json").read_text() == "theirs\n"
    with pytest.raises(ResumeError, match="is a symbolic link"):
        release_reads.verify(root, release=release, record=_record())
    (root / "release_reads").unlink()
    (root / "release_reads").write_text("a file\n")  # not a directory either
    with pytest.raises(PathError, match="release_reads is not a directory; refused"):
        release_reads.save(root, rank=0, world=1, release=release, record=_record())


BROKEN = {
    "a list": ([], "a JSON list, not an object"),
    "no tensors": ({"files": {}}, "no 'tensors'"),
    "no files": ({"tensors": {}}, "no 'files'"),
    "files not digests": ({"files": [], "tensors": {}}, "'files' is not an object of digests"),
    "a tensor without its shard": (
        {"files": {}, "tensors": {"t": {"lo": 0, "hi": 4, "digest": "00"}}},
        "'tensors' entry 't' has no str 'shard'",
    ),
    "a tensor without its digest": (
        {"files": {}, "tensors": {"t": {"shard": "s", "lo": 0, "hi": 4}}},
        "'tensors' entry 't' has no str 'digest'",
    ),
    "a carried tensor without its span": (
        {"files": {}, "tensors": {}, "carried": {"t": {"shard": "s", "digest": "00"}}},
        "'carried' entry 't' has no int 'lo'",
    ),
    "not JSON": ("{", "not JSON"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_malformed_record_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    body, words = BROKEN[case]
    path = tmp_path / "ckpt" / "release_reads" / "rank00000.json"
    path.parent.mkdir(parents=True)
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(ResumeError) as err:
        release_reads.verify(tmp_path / "ckpt", release=_release_dir(tmp_path), record=_record())
    text = str(err.value)
    print(text)
    assert "\n" not in text and words in text
    assert text.startswith(f"{path}: not a record of the release this run started from (")


def test_a_record_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    root, release = tmp_path / "ckpt", _release_dir(tmp_path)
    path = root / "release_reads" / "rank00000.json"
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    raised: list[BaseException] = []

    def resume() -> None:
        try:
            release_reads.verify(root, release=release, record=_record())
        except BaseException as err:  # handed to the test's thread
            raised.append(err)

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # unblock the open so the thread can end, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"verify blocked on the FIFO {path}")
    [err] = raised
    print(err)
    assert isinstance(err, ResumeError) and str(err) == (
        f"{path}: not a record of the release this run started from (it is a FIFO); resume "
        "with the record the run's first start wrote, or start a new run in another "
        "checkpoint.dir"
    )
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ResumeError, match=r"it is a symbolic link \(to "):
        release_reads.verify(root, release=release, record=_record())


def _copied_step(first_ckpt: Path, ckpt: Path) -> Path:
    """Step 1 of the first run alone, copied into a new checkpoint.dir (as a user moves a
    checkpoint to another file system): no release_reads/ beside it."""
    ckpt.mkdir(parents=True)
    shutil.copytree(step_dir(first_ckpt, 1), step_dir(ckpt, 1))
    (ckpt / LATEST).write_text(step_dir(ckpt, 1).name + "\n")
    return step_dir(ckpt, 1)


@pytest.mark.usefixtures("one_thread")
def test_a_step_carries_its_record_so_a_copied_step_is_checked_alike(
    release: Path, first, tmp_path: Path, caplog
) -> None:
    """Every saved step holds the records (in its manifest); a step copied to a new
    checkpoint.dir and resumed against a changed release is refused naming the tensor, as a
    resume in place is. A step saved without records (an older version) resumes with the
    warning."""
    import logging

    from primus_v4.training.checkpoint import integrity

    step = step_dir(first[0], 1)
    carried = sorted(p.name for p in step.glob("release_reads.rank*.json"))
    assert carried == ["release_reads.rank00000.json"]
    assert carried[0] in integrity.read_manifest(step)
    assert (step / carried[0]).read_bytes() == (first[0] / "release_reads" / "rank00000.json"
                                                ).read_bytes()  # fmt: skip
    other = tmp_path / "other"
    _flip_one_byte(release, other, "layers.0.attn.wq_a.weight")
    copied = _copied_step(first[0], tmp_path / "run" / "ckpt")
    with pytest.raises(ResumeError, match=r"tensor 'layers.0.attn.wq_a.weight' .* differs from "
                       rf"the release this run started from \({release}, recorded in {copied}/"
                       r"release_reads.rank00000.json\)"):  # fmt: skip
        Trainer(_run(tmp_path, other, steps=2), corpus=GoldenImageCorpus())
    # the same release resumes, and the steps it saves carry the record on
    trainer = Trainer(_run(tmp_path, release, steps=2), corpus=GoldenImageCorpus())
    trainer.train()
    assert (step_dir(copied.parent, 2) / carried[0]).read_bytes() == (copied / carried[0]
                                                                      ).read_bytes()  # fmt: skip
    # a step of an older version: no record in it, none beside it
    old = tmp_path / "old"
    step = _copied_step(first[0], old / "run" / "ckpt")
    (step / carried[0]).unlink()
    files = integrity.read_manifest(step)
    del files[carried[0]]
    integrity.write_manifest(step, files)
    with caplog.at_level(logging.WARNING, logger="primus_v4"):
        Trainer(_run(old, other, steps=2), corpus=GoldenImageCorpus())
    assert any("no record of the release this run started from" in r.message
               for r in caplog.records)  # fmt: skip
