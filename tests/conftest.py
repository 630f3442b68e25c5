"""Shared test fixtures: the shared data folder, and the skip of `gpu`-marked tests (with a reason)
wherever torch sees no accelerator (gfx942/gfx950 via `gcnArchName` on ROCm; sm_XY on NVIDIA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
ALPACA_DEMO = SHARED_DATA / "alpaca_en_demo.json"


@pytest.fixture(scope="session")
def alpaca_demo() -> Path:
    if not ALPACA_DEMO.exists():
        pytest.fail(f"{ALPACA_DEMO} is missing: the tests expect ../shared/data beside the repo")
    return ALPACA_DEMO


def accelerator_arch() -> str | None:
    """`gfx942`, `gfx950`, `sm_90`, ... for device 0, or None when torch sees no accelerator."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    gcn = getattr(props, "gcnArchName", "") or ""
    if torch.version.hip and gcn:
        return gcn.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
    return f"sm_{props.major}{props.minor}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if accelerator_arch() is not None:
        return
    skip = pytest.mark.skip(
        reason="gpu test: no accelerator (torch.cuda.is_available() is False); runs on "
        "gfx942/gfx950 (ROCm) or NVIDIA"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
