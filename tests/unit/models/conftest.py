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


@pytest.fixture
def ce_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row count of every chunk the fused LM-head CE computes, in call order (tests clear it)."""
    import primus_v4.kernels.linear_ce as loss_mod

    seen: list[int] = []
    real_chunk_ce = loss_mod._chunk_ce

    def counting(h_CD: torch.Tensor, *args, **kwargs):
        seen.append(h_CD.shape[0])
        return real_chunk_ce(h_CD, *args, **kwargs)

    monkeypatch.setattr(loss_mod, "_chunk_ce", counting)
    return seen
