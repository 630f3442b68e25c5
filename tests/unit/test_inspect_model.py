"""`primus-v4 inspect model`: parameter counts by component; unknown presets are clear errors."""

from __future__ import annotations

import json

import pytest

from primus_v4.cli import main
from primus_v4.errors import ExitCode


def test_inspect_model_reports_structure_and_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "model", "deepseek_v4_flash", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = report["layer_kinds"]
    assert (kinds.count("dense"), kinds.count("csa"), kinds.count("hca")) == (2, 21, 20)
    parts = ("embedding", "attention", "compressor_indexer", "router", "experts", "shared")
    parts += ("mhc", "norms", "mtp", "head")
    assert report["total"] == sum(report[p] for p in parts)
    # Routed experts dominate a 256-expert MoE; only top-6 of them are active per token.
    assert report["experts"] > 0.9 * report["total"]
    assert report["active_per_token"] < 0.1 * report["total"]


def test_inspect_unknown_preset_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "model", "no_such_model"]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "unknown model preset 'no_such_model'" in err and "deepseek_v4_flash" in err
