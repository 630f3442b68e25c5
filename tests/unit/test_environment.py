"""Every environment variable the package reads is checked before any command works: a value of
the wrong kind (what a broken launcher or a hostile job environment gives) is one line, exit 3,
naming the variable, from every command; before the check, `RANK=x` failed a run after packing
with a traceback, and `PRIMUS_LOG_LEVEL=bogus` failed every command the same way."""

from __future__ import annotations

import logging

import pytest

from primus_v4 import log
from primus_v4.cli import main
from primus_v4.environment import check_environment
from primus_v4.errors import ConfigError

BAD = {
    "RANK": ("x", "RANK='x' is not an integer"),
    "LOCAL_RANK": ("HOME[$(touch pwned)]", "LOCAL_RANK='HOME[$(touch pwned)]' is not an integer"),
    "WORLD_SIZE": ("0", "WORLD_SIZE=0 must be >= 1"),
    "LOCAL_WORLD_SIZE": ("1e3", "LOCAL_WORLD_SIZE='1e3' is not an integer"),
    "MASTER_PORT": ("70000", "MASTER_PORT=70000 must be in 1..65535"),
    "TORCHELASTIC_RESTART_COUNT": ("-1", "TORCHELASTIC_RESTART_COUNT=-1 must be >= 0"),
    "SLURM_RESTART_COUNT": ("٣", "SLURM_RESTART_COUNT='٣' is not an integer"),
    "PRIMUS_LOG_LEVEL": ("bogus", "PRIMUS_LOG_LEVEL='bogus' is not a log level"),
    "PRIMUS_V4_TURBO_FP8": ("fp4", "PRIMUS_V4_TURBO_FP8='fp4' is not an FP8 mode"),
    "PRIMUS_V4_KERNEL_BACKEND": ("auto,sparse_attention=cuda", "unknown kernel backend 'cuda'"),
}
COMMANDS = {
    "pack": ["pack", "--data", "synthetic", "--seq-length", "64"],
    "train": ["train", "--set", "train.steps=1"],
    "train --dry-run": ["train", "--dry-run"],
    "inspect": ["inspect", "config"],
    "export": ["export", "--run", "nowhere", "--out", "nothing"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_environment_value_is_one_line_from_every_command_before_work(
    name: str, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, BAD[name][0])
    started = []
    monkeypatch.setattr("primus_v4.commands.train.preflight", lambda *a: started.append(a))
    code = main(COMMANDS[command])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    assert len(err) == 1 and err[0].startswith(f"primus-v4 {command.split()[0]}: error: "), err
    assert BAD[name][1] in err[0], err
    assert not started and list(tmp_path.iterdir()) == [], "worked before refusing"


def test_every_bad_value_is_named_at_once_and_good_values_pass() -> None:
    env = {name: value for name, (value, _) in BAD.items()}
    with pytest.raises(ConfigError) as caught:
        check_environment(env)
    for _, words in BAD.values():
        assert words in str(caught.value)
    check_environment({})
    check_environment({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "", "SLURM_RESTART_COUNT": "2",
        "PRIMUS_LOG_LEVEL": "debug", "PRIMUS_V4_TURBO_FP8": "blockwise",
        "PRIMUS_V4_KERNEL_BACKEND": "auto,sparse_attention=triton,grouped_experts=grouped_mm",
    })  # fmt: skip


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK=8 is not below"),
        ({"RANK": "9" * 30}, "is not an integer"),
        ({"PRIMUS_V4_KERNEL_BACKEND": "=triton"}, "names no op"),
    ],
)
def test_ranks_beyond_their_world_and_odd_specs_are_refused(env: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        check_environment(env)


def test_a_bad_log_level_never_fails_an_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loggers are made at import time; a bad level falls back to INFO there (the CLI's
    check then names it) instead of raising out of an import."""
    monkeypatch.setenv("PRIMUS_LOG_LEVEL", "bogus")
    assert log._env_level() == "INFO"
    monkeypatch.setenv("PRIMUS_LOG_LEVEL", "warning")
    assert log._env_level() == "WARNING"
    assert logging.getLevelNamesMapping()[log._env_level()] == logging.WARNING
