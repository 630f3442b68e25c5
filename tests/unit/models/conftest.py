"""Model tests run tiny graphs: one intra-op thread avoids oversubscribing shared CI cores."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # On a loaded 2-core box, 2 intra-op threads made these tests ~5x slower than 1.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
