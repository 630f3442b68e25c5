"""How `primus-v4` fails: one line on stderr per error, never a traceback, and an exit status per
kind of failure (`ExitCode`, listed in `primus-v4 --help`); a closed stdout ends quietly."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from primus_v4 import cli
from primus_v4.errors import ExitCode

REPO = Path(__file__).resolve().parents[2]


def test_a_closed_stdout_is_no_traceback() -> None:
    """`primus-v4 inspect config | head`: the reader goes away before the output is written."""
    code = (
        "import os, sys\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "from primus_v4.cli import main\n"
        "sys.exit(main(['inspect', 'config']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)  # fmt: skip
    assert proc.stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE


def test_every_exit_code_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for code in ExitCode:
        if code not in (ExitCode.OK, ExitCode.SIGNAL_BASE):
            assert f" {int(code)} " in text, code.name
    assert "128+N" in text


@pytest.mark.parametrize(
    ("raised", "code", "words"),
    [
        (RuntimeError("boom"), ExitCode.INTERNAL, "internal error (a bug): RuntimeError: boom"),
        (OSError(errno.ENOSPC, "No space left on device", "/x/y"), ExitCode.DISK_FULL,
         "/x/y: No space left on device (ENOSPC)"),
        (PermissionError(errno.EACCES, "Permission denied", "/x/z"), ExitCode.PATH,
         "/x/z: Permission denied (EACCES)"),
    ],
)  # fmt: skip
def test_an_unexpected_failure_is_still_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raised, code, words
) -> None:
    from primus_v4.commands import inspect

    def fail(_args):
        raise raised

    monkeypatch.setitem(inspect.VIEWS, "presets", (*inspect.VIEWS["presets"][:2], fail))
    assert cli.main(["inspect", "presets"]) == code
    err = capsys.readouterr().err
    assert err.startswith("primus-v4 inspect: error: ") and words in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
