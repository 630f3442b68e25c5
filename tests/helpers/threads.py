"""One torch thread for a test: the golden comparisons were computed with one, and sums taken
over another thread count add small products in another order."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
