"""The golden checkpoint's model, loaded once for every V4.1 test (tests leave it as found)."""

from __future__ import annotations

import pytest
from dsv41_model import load_model


@pytest.fixture(scope="session")
def golden_model():
    return load_model()
