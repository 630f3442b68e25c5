"""`primus-v4 inspect kernels`: per op, the backend used here and why every other one is refused;
an explicit backend that cannot run is an error naming the op and the reason."""

from __future__ import annotations

import json
import os

import pytest
import torch

from primus_v4.cli import main
from primus_v4.kernels import registry


def _rows(capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    return {r["op"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU table (auto = torch)")
def test_cpu_table_names_every_op_and_every_refusal(capsys, monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert main(["inspect", "kernels", "--json"]) == 0
    rows = _rows(capsys)
    assert set(rows) == {"sparse_attention", "grouped_experts", "compressor_pool", "indexer_topk",
                         "release_round"}  # fmt: skip
    for row in rows.values():
        assert row["chosen"] == "torch"
        assert set(row["refused"]) == set(registry.BACKENDS) - {"torch"}
    assert "CPU" in rows["sparse_attention"]["refused"]["triton"]
    assert "CPU" in rows["grouped_experts"]["refused"]["grouped_mm"]
    assert "no triton kernel" in rows["grouped_experts"]["refused"]["triton"]
    assert main(["inspect", "kernels"]) == 0
    text = capsys.readouterr().out
    assert "no GPU (CPU)" in text and "sparse_attention" in text


def test_explicit_backends_per_op(capsys, monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert main(["inspect", "kernels", "--json", "--backend", "grouped_experts=grouped_mm"]) == 0
    assert _rows(capsys)["grouped_experts"]["chosen"] == "grouped_mm"
    assert main(["inspect", "kernels", "--json", "--backend", "indexer_topk=triton"]) == 1
    error = _rows(capsys)["indexer_topk"]["refused"]["error"]
    assert "'triton' was requested for op 'indexer_topk'" in error
    assert "no triton kernel is registered" in error
    assert main(["inspect", "kernels", "--json", "--backend", "no_such_op=torch"]) == 1
    assert "unknown kernel op 'no_such_op'" in capsys.readouterr().out
    assert registry.ENV_VAR not in os.environ  # the view leaves the env as it was
