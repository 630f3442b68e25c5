"""The native quantizer library is code this process runs: it is built into a directory created
0700 and loaded only from a directory and a file that are this user's and that group and others
cannot write. The S3 probe: a library planted under the expected name, whose constructor would
leave a marker, is refused with one warning (the torch path quantizes instead) and never runs."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import captured_logs

from primus_v4.checkpoint_formats import native_quant

COMPILER = os.environ.get("CC", "cc")
PLANTED_C = """
#include <sys/stat.h>
__attribute__((constructor)) static void planted(void) { mkdir("%s", 0700); }
"""


@pytest.fixture
def lib_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if shutil.which(COMPILER) is None:
        pytest.skip("no C compiler here: the native quantizer is never built or loaded")
    monkeypatch.setenv("PRIMUS_V4_CACHE_DIR", str(tmp_path / "lib"))
    monkeypatch.delenv(native_quant.ENV_SWITCH, raising=False)
    native_quant._library.cache_clear()
    yield tmp_path / "lib"
    native_quant._library.cache_clear()  # later tests build from their own cache dir


def _plant(target: Path, marker: Path) -> None:
    source = target.with_name("planted.c")
    source.write_text(PLANTED_C % marker)
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    source.unlink()


def _refused(marker: Path) -> str:
    native_quant._library.cache_clear()
    with captured_logs() as logs:
        assert native_quant._library(COMPILER) is None
    assert not marker.exists(), "the planted library's constructor ran"
    said = [m for m in logs if "native bf16 quantizer refused" in m]
    assert len(said) == 1 and "\n" not in said[0], logs
    return said[0]


def test_the_library_dir_is_created_private(lib_dir: Path) -> None:
    assert native_quant._library(COMPILER) is not None
    assert lib_dir.stat().st_mode & 0o777 == 0o700
    assert len(list(lib_dir.glob("quant_bf16-*.so"))) == 1


def test_a_planted_library_is_refused_and_never_runs(lib_dir: Path, tmp_path: Path) -> None:
    assert native_quant._library(COMPILER) is not None
    (target,) = lib_dir.glob("quant_bf16-*.so")
    marker = tmp_path / "planted-code-ran"
    _plant(target, marker)

    lib_dir.chmod(0o777)  # a directory others may write: whatever is in it may be theirs
    assert "writable by group or others (mode 777)" in _refused(marker)
    lib_dir.chmod(0o700)

    target.chmod(0o666)  # a library file others may rewrite
    assert f"{target} is writable by group or others" in _refused(marker)
    target.chmod(0o755)

    if os.geteuid() == 0:  # only root can hand a file or a directory to another user
        os.chown(target, 65534, 65534)
        assert f"{target} is owned by uid 65534" in _refused(marker)
        os.chown(target, 0, 0)
        os.chown(lib_dir, 65534, 65534)
        assert "is owned by uid 65534" in _refused(marker)
        os.chown(lib_dir, 0, 0)
