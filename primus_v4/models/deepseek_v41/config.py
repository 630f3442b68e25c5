"""DeepSeek-V4.1 model configuration: DeepSeek-V4's config plus the V4.1 fields (geometry.py:
each documented where declared, and what V4.1 reads differently)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v41.geometry import (  # noqa: F401 (re-exported)
    LAYER_KINDS,
    DeepseekV41Fields,
)
from primus_v4.models.deepseek_v41.release.config_json import fields_from_release


@dataclass(kw_only=True)
class DeepseekV41Config(DeepseekV41Fields, DeepseekV4Config):
    """DeepseekV4Config + the DeepSeek-V4.1 fields."""


def config_from_release(
    d: dict[str, Any], *, source: str = "config.json", **overrides: Any
) -> DeepseekV41Config:
    """DeepseekV41Config from a release config.json dict; `overrides` set training fields."""
    return DeepseekV41Config(**{**fields_from_release(d, source=source), **overrides})
