"""The memory plan asks the model family (`ModelSpec.memory`) and counts a drafter in training as
the family builds it: `model.draft.train` joint adds the DSpark stages' weights, gradients and
optimizer state to the backbone's; `only` holds the backbone's weights and the drafter's
gradients and optimizer state alone. memory/ names no family."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from primus_v4.config import load_config, resolve_run
from primus_v4.memory.plan import plan_memory
from primus_v4.models.deepseek_v41.model import DeepseekV41Model

REPO = Path(__file__).resolve().parents[3]
ROWS = {"weights": "weights (float32)", "grads": "fp32 gradient buckets (+ reduced shard)",
        "moments": "fp32 Adam moments (2 per chunk)"}  # fmt: skip


def _rows(mode: str, tmp_path: Path) -> dict[str, float]:
    items = ["model.preset=tiny_v41", f"model.draft.train={mode}", f"output.dir={tmp_path}"]
    (plan,) = plan_memory(resolve_run(load_config(overrides=items), world=1))
    by_name = {name: device + host for name, device, host, _ in plan.rows}
    return {key: by_name[name] for key, name in ROWS.items()}


def _numels(mode: str) -> tuple[int, int]:
    """(all parameters, the drafter's) of the tiny_v41 model built for `mode`."""
    import torch

    from primus_v4.config.resolve import model_config

    cfg = model_config(load_config(overrides=["model.preset=tiny_v41",
                                              f"model.draft.train={mode}"]))  # fmt: skip
    with torch.device("meta"):
        model = DeepseekV41Model(cfg)
    total = sum(p.numel() for p in model.parameters())
    drafter = sum(p.numel() for n, p in model.named_parameters() if n.startswith("dspark."))
    return total, drafter


def test_joint_and_only_count_the_drafter_as_built(tmp_path: Path) -> None:
    off, joint, only = (_rows(m, tmp_path / m) for m in ("off", "joint", "only"))
    total, drafter = _numels("joint")
    assert _numels("off") == (total - drafter, 0)
    assert joint["weights"] - off["weights"] == pytest.approx(4 * drafter)
    assert only["weights"] == joint["weights"]
    assert joint["moments"] - off["moments"] == pytest.approx(8 * drafter)
    assert only["moments"] == pytest.approx(8 * drafter)
    assert only["grads"] < off["grads"] / 3


def test_memory_names_no_family() -> None:
    for path in (REPO / "primus_v4" / "memory").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"v41|deepseek_v4|is_v4|family ==", text), path.name
