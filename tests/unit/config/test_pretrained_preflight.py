"""`train --set model.pretrained=DIR` refuses a release with a missing or truncated shard in
seconds, with one line naming the shard, in --dry-run too, before packing or a model build (it
used to pass --dry-run and end in a traceback after start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from release_checkpoint import random_release_tensors, release_config
from safetensors.torch import save_file

from primus_v4.cli import main
from primus_v4.errors import ExitCode


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-shard release directory (config.json + index + shards) of a tiny geometry."""
    directory = tmp_path_factory.mktemp("release")
    config = {**release_config("a"), "vocab_size": 129280}  # the bundled tokenizer's ids fit
    tensors = random_release_tensors(config, seed=1)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(directory / shard))
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _train(tmp_path: Path, release: Path, *extra: str) -> list[str]:
    items = ["model.preset=null", f"model.pretrained={release}", "data.seq_length=256",
             f"output.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
             f"data.lock_dir={tmp_path / 'locks'}"]  # fmt: skip
    return ["train", *extra, *(a for item in items for a in ("--set", item))]


def _copy(release: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(release, tmp_path / "release"))


def test_an_intact_release_passes(release: Path, tmp_path: Path) -> None:
    assert main(_train(tmp_path, release, "--dry-run")) == 0


@pytest.mark.parametrize("damage", ["missing", "truncated"])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_a_broken_shard_is_one_line_before_any_work(
    release: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, dry_run: bool
) -> None:
    broken = _copy(release, tmp_path)
    shard = broken / "model-00002-of-00002.safetensors"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    argv = _train(tmp_path, broken, *(["--dry-run"] if dry_run else []))
    assert main(argv) == ExitCode.PRETRAINED
    err = capsys.readouterr().err
    assert err.startswith(f"primus-v4 train: error: model.pretrained={broken}: {shard}")
    assert ("shard missing" if damage == "missing" else "it is truncated") in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
