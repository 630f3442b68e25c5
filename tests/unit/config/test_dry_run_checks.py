"""The dry run checks what the run checks, before any packing: a release whose vocabulary is
smaller than the tokenizer's ids, a V4.1 release whose tokenizer's Engram map differs from its
config, and a tracker package that is installed but fails to import, are each one line from
`train --dry-run` (and from the run, through the same checks)."""

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
