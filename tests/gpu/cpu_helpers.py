"""Load the CPU test modules whose helpers the device tests reuse (same packs, same checks).

Loaded by file path under a private name, so pytest never collects their tests a second time
and a basename shared with another test file cannot clash.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def load(relative: str) -> ModuleType:
    """tests/<relative> as a module named `_cpu_tests.<stem>` (cached)."""
    path = TESTS / relative
    name = f"_cpu_tests.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
