"""Shared test fixtures: the shared data folder and GPU detection for `gpu`-marked tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
ALPACA_DEMO = SHARED_DATA / "alpaca_en_demo.json"


@pytest.fixture(scope="session")
def alpaca_demo() -> Path:
    if not ALPACA_DEMO.exists():
        pytest.fail(f"{ALPACA_DEMO} is missing: the tests expect ../shared/data beside the repo")
    return ALPACA_DEMO
