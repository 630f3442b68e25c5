"""The CLI explains itself to users: every option of every command has help text, `train --help`
points to the config reference, `inspect` lists its views, and the reference documents every key."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from primus_v4.cli import build_parser, main
from primus_v4.config.schema import SECTIONS


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    found, todo = {}, [("primus-v4", build_parser())]
    while todo:
        name, parser = todo.pop()
        found[name] = parser
        todo += [(f"{name} {n}", p) for n, p in _subparsers(parser).items()]
    return found


def test_every_option_of_every_command_has_help() -> None:
    parsers = _all_parsers()
    assert {"primus-v4 train", "primus-v4 pack", "primus-v4 inspect checkpoint"} <= set(parsers)
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in parsers.items()
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert missing == []


def test_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Supervised fine-tuning" in out and "examples:" in out
    assert "import" not in out and "lazily" not in out  # not the module's developer docstring


def test_train_help_points_to_the_config_reference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "primus-v4 inspect config" in capsys.readouterr().out


def test_inspect_lists_its_views(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    out = capsys.readouterr().out
    for view in ("config", "presets", "model", "cache", "checkpoint"):
        assert f"\n    {view} " in out or f"\n    {view}\n" in out


def test_config_reference_documents_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "config", "--json"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    keys = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert [e["key"] for e in entries] == keys
    assert [e["key"] for e in entries if len(e["doc"]) < 10] == []


def test_presets_lists_the_shipped_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "presets", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {"tiny", "deepseek_v4_flash"} <= set(shown["model_presets"])
    assert {"tiny_cpu_thd", "deepseek_v4_flash_sft"} <= set(shown["run_configs"])
