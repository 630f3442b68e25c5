"""DeepSeek-V4 (the math): config, layers and the language model. See README.md here.

The names below load on first use, so that `geometry` (the torch-free model config that
`train --dry-run` reads) imports without torch or megatron-core."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DeepseekV4Config": "primus_v4.models.deepseek_v4.config",
    "DeepseekV4Model": "primus_v4.models.deepseek_v4.model",
    "ModelOutput": "primus_v4.models.deepseek_v4.model",
    "param_counts": "primus_v4.models.deepseek_v4.params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
