"""The golden checkpoint's model, loaded once for every V4.1 test (tests leave it as found)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dsv41_model import load_model
from safetensors.torch import load_file

from primus_v4.models.deepseek_v41.release.load import load_pretrained


@pytest.fixture(scope="session")
def golden_model():
    return load_model()


DSPARK_GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "dsv41_dspark_golden"


@pytest.fixture(scope="session")
def dspark_golden() -> dict[str, torch.Tensor]:
    """The DSpark golden data (official code, float32): documents, anchors, drafts."""
    return load_file(DSPARK_GOLDEN / "golden.safetensors")


@pytest.fixture(scope="session")
def dspark_model(dspark_golden):
    """The published-shape tiny release with its draft stages built (float32; tests leave it
    as found)."""
    return load_pretrained(DSPARK_GOLDEN / "checkpoint", dtype=torch.float32, progress=False,
                           token_map=dspark_golden["token_map"], drafter=True)  # fmt: skip
