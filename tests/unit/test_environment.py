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
    "NODE_RANK": ("-1", "NODE_RANK=-1 must be >= 0"),
    "MASTER_ADDR": ("", "MASTER_ADDR='' is not a host name or address"),
    "PRIMUS_V4_NATIVE_QUANT": ("off", "PRIMUS_V4_NATIVE_QUANT='off' is not a switch; use 1 or 0"),
    "PRIMUS_V4_TRACEBACK": ("true", "PRIMUS_V4_TRACEBACK='true' is not a switch"),
    "PRIMUS_LOG_ALL_RANKS": (" 0", "PRIMUS_LOG_ALL_RANKS=' 0' is not a switch"),
    "TRITON_INTERPRET": ("y", "TRITON_INTERPRET='y' is not a switch"),
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


INTEGERS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # fmt: skip


def _refusal(
    command: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path, capsys
) -> str:
    """The one line `command` fails with under `env`, after checking it is exit 3 before work."""
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = []
    monkeypatch.setattr("primus_v4.commands.train.preflight", lambda *a: started.append(a))
    code = main(COMMANDS[command])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    assert len(err) == 1 and err[0].startswith(f"primus-v4 {command.split()[0]}: error: "), err
    assert not started and list(tmp_path.iterdir()) == [], "worked before refusing"
    return err[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_environment_value_is_one_line_from_every_command_before_work(
    name: str, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys
) -> None:
    line = _refusal(command, {name: BAD[name][0]}, monkeypatch, tmp_path, capsys)
    assert BAD[name][1] in line, line


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("value", ["--0", "--1", "--2"])
@pytest.mark.parametrize("name", INTEGERS)
def test_a_doubled_minus_is_not_an_integer_for_any_command(
    name: str, value: str, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys
) -> None:
    """`--1` passed a check that stripped the minus signs before looking for digits, and int()
    then failed every command with an internal error (exit 70)."""
    line = _refusal(command, {name: value}, monkeypatch, tmp_path, capsys)
    assert f"{name}={value!r} is not an integer" in line, line


@pytest.mark.parametrize("name", INTEGERS)
@pytest.mark.parametrize(
    "value", ["--1", "-+1", "+1", " 1", "1 ", "\t0", "00", "01", "-0", "1_0", "0x1", "1.0", "1\n"]
)
def test_only_the_plain_form_of_an_integer_passes(name: str, value: str) -> None:
    """int() reads all but the first four, but RANK and NODE_RANK are compared with '0' as text:
    ' 0' or '00' would make rank 0 a follower."""
    with pytest.raises(ConfigError, match=f"{name}=.* is not an integer as a launcher writes"):
        check_environment({name: value})


def test_what_passes_is_read_alike_by_int_and_as_text() -> None:
    candidates = ["0", "7", "-3", "10", "65535", "9" * 18, "00", " 0", "+0", "-0", "0 ", "07"]
    for value in candidates:
        try:
            check_environment({"TORCHELASTIC_RESTART_COUNT": value, "MASTER_PORT": "1"})
        except ConfigError as exc:
            assert "is not an integer" in str(exc) or "must be" in str(exc), exc
            continue
        assert str(int(value)) == value and (value == "0") == (int(value) == 0), value


@pytest.mark.parametrize(
    ("name", "empty_is_unset"),
    [("RANK", False), ("WORLD_SIZE", False), ("LOCAL_RANK", False), ("MASTER_PORT", False),
     ("LOCAL_WORLD_SIZE", True), ("NODE_RANK", True), ("TORCHELASTIC_RESTART_COUNT", True),
     ("SLURM_RESTART_COUNT", True)],
)  # fmt: skip
def test_an_empty_integer_is_unset_only_where_its_readers_take_it_so(
    name: str, empty_is_unset: bool
) -> None:
    """RANK, WORLD_SIZE and LOCAL_RANK are read with int() and MASTER_PORT by torch's env://
    rendezvous (an empty RANK failed `pack` with exit 70); the restart counts and NODE_RANK are
    read as 0 when empty. Blanks are never empty: int('  ') fails too."""
    if empty_is_unset:
        check_environment({name: ""})
    else:
        with pytest.raises(ConfigError, match=f"{name}='' is not an integer"):
            check_environment({name: ""})
    with pytest.raises(ConfigError, match=f"{name}='  ' is not an integer"):
        check_environment({name: "  "})


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
        "NODE_RANK": "", "MASTER_ADDR": "node-0.svc.cluster.local", "PRIMUS_V4_NATIVE_QUANT": "0",
        "PRIMUS_V4_TRACEBACK": "1", "PRIMUS_LOG_ALL_RANKS": "", "TRITON_INTERPRET": "True",
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


@pytest.mark.parametrize("host", ["10.0.0.1", "n0", "[fe80::1%eth0]", "fe80::1", "node-0.svc"])
def test_a_host_passes_and_a_blank_or_spaced_one_does_not(host: str) -> None:
    """A MASTER_ADDR that is set, even empty, sends a single process to torch's env:// rendezvous:
    an empty one failed the run after packing (exit 70), one with a space waited out a timeout."""
    check_environment({"MASTER_ADDR": host})
    for bad in ("", " ", f"{host} ", f"{host};x"):
        with pytest.raises(ConfigError, match=r"MASTER_ADDR=.* is not a host name or address"):
            check_environment({"MASTER_ADDR": bad})


@pytest.mark.parametrize("value", ["y", "2", " 1", "1 ", "enable"])
def test_triton_interpret_takes_the_words_triton_and_the_registry_read_alike(value: str) -> None:
    """Triton reads 'y' as on and ' 1' as off, the kernel registry the other way round; a run
    where they disagree sends GPU tensors to the interpreter or CPU tensors to compiled kernels."""
    for word in ("", "0", "1", "TRUE", "false", "On", "off", "yes", "no"):
        check_environment({"TRITON_INTERPRET": word})
    with pytest.raises(ConfigError, match=r"TRITON_INTERPRET=.* is not a switch"):
        check_environment({"TRITON_INTERPRET": value})
