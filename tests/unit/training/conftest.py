"""Fixtures of the runs that start from a release (a tiny random release-layout checkpoint): one
definition, module-scoped in each module that asks for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pretrained_runs import train_one_step, write_pretrained


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pretrained(tmp_path_factory.mktemp("pretrained") / "release")


@pytest.fixture(scope="module")
def trained(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_one_step(checkpoint, tmp_path_factory.mktemp("train"))
