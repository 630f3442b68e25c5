"""GPU suite: `gpu`-marked tests run on an accelerator and skip with a reason everywhere else.

The architecture comes from the device itself: gfx942 (MI300X/MI308X) or gfx950 (MI355X) on
ROCm via `gcnArchName`; on NVIDIA the tests run too (sm_XY) wherever a kernel path exists.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import accelerator_arch


@pytest.fixture(scope="session")
def arch() -> str:
    value = accelerator_arch()
    if value is None:
        pytest.skip("no accelerator")
    return value


@pytest.fixture(scope="session")
def device(arch: str) -> torch.device:
    return torch.device("cuda", 0)
