"""The dry run checks what the run checks, before any packing: a release whose vocabulary is
smaller than the tokenizer's ids, a V4.1 release whose tokenizer's Engram map differs from its
config, and a tracker package that is installed but fails to import, are each one line from
`train --dry-run`; and for each probed fault the run and its dry run (both through
`commands/train.preflight`) stop with the same exit code and line, the run packing nothing."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

from primus_v4.cli import main
from primus_v4.config import load_config
from primus_v4.config.preflight import path_problems

GOLDEN = Path(__file__).resolve().parents[3] / "tests/fixtures/dsv41_dspark_golden/checkpoint"


def _dry_run(tmp_path: Path, release: Path) -> int:
    return main(["train", "--dry-run", "--set", f"model.pretrained={release}", "--set",
                 "model.preset=null", "--set", f"output.dir={tmp_path / 'out'}",
                 "--set", f"data.cache_dir={tmp_path / 'packs'}"])  # fmt: skip


def test_a_release_smaller_than_its_tokenizer_is_refused_by_the_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    release = tmp_path / "release"
    shutil.copytree(GOLDEN, release, ignore=shutil.ignore_patterns("tokenizer*"))
    start = time.perf_counter()
    code = _dry_run(tmp_path, release)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 3, err
    assert err.startswith(f"primus-v4 train: error: model.pretrained={release}: its vocabulary "
                          "has 512 ids but the tokenizer "), err  # fmt: skip
    assert err.endswith(" makes 129280: ids >= 512 would index past the embedding; set "
                        "data.tokenizer to the release's own tokenizer"), err  # fmt: skip
    assert not (tmp_path / "packs").exists(), "packed before refusing"
    print(f"refused in {seconds:.2f} s: {err}")
    assert _dry_run(tmp_path, GOLDEN) == 0


def test_a_tracker_that_fails_to_import_is_one_line_before_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libprotobuf is too old')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    cfg = load_config(overrides=["output.tracker=wandb", f"output.dir={tmp_path / 'out'}"])
    assert path_problems(cfg) == [
        "output.tracker: wandb: the wandb package is installed but fails to import "
        "(ImportError: libprotobuf is too old); reinstall it (pip install 'primus_v4[wandb]') "
        "or set output.tracker=none"
    ]


def test_a_tokenizer_whose_engram_map_differs_from_the_config_is_refused_by_the_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A V4.1 release whose tokenizer makes another number of compressed ids than its config's
    engram_compressed_vocab_size (every Engram table would be hashed with another map): the
    release check, which the dry run and the run both make, refuses it in one line."""
    import json

    release = tmp_path / "release"
    shutil.copytree(GOLDEN, release)
    config = json.loads((release / "config.json").read_text())
    text = config.get("text_config", config)
    size = text["engram_compressed_vocab_size"]
    text["engram_compressed_vocab_size"] = size - 1
    (release / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    code = _dry_run(tmp_path, release)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert err[0].endswith(
        f"{release / 'tokenizer.json'}: its Engram token map has {size} "
        f"compressed ids but the model config's engram_compressed_vocab_size "
        f"is {size - 1}; use the tokenizer the model was released with"
    ), err
    assert not (tmp_path / "packs").exists(), "packed before refusing"
    print(f"refused in {seconds:.2f} s, exit {code}: {err[0]}")


def _release_with(tmp: Path, **text: object) -> Path:
    """A copy of the golden V4.1 release with `text` set in its config's text_config."""
    import json

    release = tmp / "release"
    shutil.copytree(GOLDEN, release)
    config = json.loads((release / "config.json").read_text())
    config.get("text_config", config).update(text)
    (release / "config.json").write_text(json.dumps(config))
    return release


FAULTS = {
    "vocabulary below the tokenizer's ids": lambda tmp: (
        [f"model.pretrained={_stripped(tmp)}"], "would index past the embedding"),
    "Engram map size": lambda tmp: (
        [f"model.pretrained={_release_with(tmp, engram_compressed_vocab_size=255)}"],
        "its Engram token map has 256 compressed ids"),
    "Engram size unbounded": lambda tmp: (
        [f"model.pretrained={_release_with(tmp, engram_num_embeddings=[10**11, 10**11])}"],
        "is above its bound"),
    "tracker path is a file": lambda tmp: (
        [f"model.pretrained={GOLDEN}", "output.tracker=tensorboard", *_file_at(tmp)],
        "which is not a directory"),
    "quant-aware LoRA on a decoded base": lambda tmp: (
        [f"model.pretrained={GOLDEN}", "train.quant_aware=release", "model.lora.rank=4"],
        "needs model.lora.base=release"),
    "kernel backend that cannot run here": lambda tmp: (
        [f"model.pretrained={GOLDEN}"], "was requested for op 'compressor_pool'"),
    "kernel op that does not exist": lambda tmp: (
        [f"model.pretrained={GOLDEN}"], "names unknown kernel op 'nope'"),
}  # fmt: skip
ENVIRONMENT = {
    "kernel backend that cannot run here": {"PRIMUS_V4_KERNEL_BACKEND": "triton"},
    "kernel op that does not exist": {"PRIMUS_V4_KERNEL_BACKEND": "auto,nope=torch"},
}


def _stripped(tmp: Path) -> Path:
    release = tmp / "release"
    shutil.copytree(GOLDEN, release, ignore=shutil.ignore_patterns("tokenizer*"))
    return release


def _file_at(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out" / "tensorboard").write_text("a file\n")
    return []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_run_and_its_dry_run_refuse_each_fault_alike_before_packing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Both go through `commands/train.preflight`: the same exit code and the same one line,
    and the run packs nothing."""
    for name, value in ENVIRONMENT.get(fault, {}).items():
        monkeypatch.setenv(name, value)
    sets, words = FAULTS[fault](tmp_path)
    base = [
        "model.preset=null", f"output.dir={tmp_path / 'out'}",
        f"data.cache_dir={tmp_path / 'packs'}", "data.path=synthetic:rows=8", *sets,
    ]  # fmt: skip
    argv = ["train", *[a for item in base for a in ("--set", item)]]
    results = []
    for dry in (["--dry-run"], []):
        code = main([*argv, *dry])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        results.append((code, line))
        assert code != 0 and words in line, (dry, code, line)
        assert not (tmp_path / "packs").exists(), f"{dry or 'the run'} packed before refusing"
    assert results[0] == results[1], results
