"""Model families (the math); parallelism and kernels are passed in from outside.

Each family folder exports a `ModelSpec` (model_spec.py). The registry below is torch-free and
imports a family only when it is asked for, so `pack` and config validation stay light.
A release directory is dispatched on its config.json `model_type`.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from primus_v4.errors import CheckpointFormatError, ConfigError

# Imported before `model_spec` (the function) is defined: the submodule's import would otherwise
# rebind the package attribute `model_spec` to the module.
from primus_v4.models.model_spec import GeometrySpec, ModelSpec

PRESET_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"
"""Model presets of every family: YAML of model config fields plus a `family:` line."""
DEFAULT_FAMILY = "deepseek_v4"
FAMILIES: dict[str, str] = {
    "deepseek_v4": "primus_v4.models.deepseek_v4.spec",
    "deepseek_v41": "primus_v4.models.deepseek_v41.spec",
}
"""family name (= config.json `model_type`) -> the module holding its `SPEC`."""
GEOMETRIES: dict[str, str] = {
    "deepseek_v4": "primus_v4.models.deepseek_v4.geometry",
    "deepseek_v41": "primus_v4.models.deepseek_v41.geometry",
}
"""family name -> the torch-free module holding its `GEOMETRY`."""
UNSUPPORTED: dict[str, str] = {}
"""model types we know and cannot build yet, with the one line that says so."""


def check_family(name: str) -> str:
    """`name` if it is a family this version builds (torch-free), else one line saying why."""
    if name in UNSUPPORTED:
        raise ConfigError(f"model family {name!r}: {UNSUPPORTED[name]}")
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return name


def model_spec(name: str = DEFAULT_FAMILY) -> ModelSpec:
    """The spec of the model family `name`."""
    return importlib.import_module(FAMILIES[check_family(name)]).SPEC


def model_geometry(name: str = DEFAULT_FAMILY) -> GeometrySpec:
    """The torch-free geometry of the model family `name` (model_spec.GeometrySpec)."""
    return importlib.import_module(GEOMETRIES[check_family(name)]).GEOMETRY


def release_family(path: str | os.PathLike) -> str:
    """The family of a release directory (or its config.json), from `model_type`; a release
    config.json without one is DeepSeek-V4's (the April release writes none in some copies)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(file.read_text())
    except FileNotFoundError:
        msg = f"{file}: no config.json; pass a release checkpoint directory"
        raise FileNotFoundError(msg) from None
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"{file}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(d, dict):
        raise CheckpointFormatError(
            f"{file}: a config.json holds an object, got {type(d).__name__}"
        )
    kind = d.get("model_type", DEFAULT_FAMILY)
    if kind in UNSUPPORTED:
        raise CheckpointFormatError(f"{file}: model_type {kind!r}: {UNSUPPORTED[kind]}")
    if kind not in FAMILIES:
        raise CheckpointFormatError(
            f"{file}: model_type {kind!r} is not a model family of primus_v4 "
            f"(known: {sorted(FAMILIES)})"
        )
    return kind


def release_spec(path: str | os.PathLike) -> ModelSpec:
    """The spec of the family that owns a release directory."""
    return model_spec(release_family(path))


def spec_of(model: object) -> ModelSpec:
    """The spec of a built model (its class's `family` attribute)."""
    return model_spec(getattr(model, "family", DEFAULT_FAMILY))


def presets() -> dict[str, str]:
    """Every shipped model preset -> the family its file names (read as text: torch-free)."""
    out = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        family = DEFAULT_FAMILY
        for line in path.read_text().splitlines():
            if line.startswith("family:"):
                family = line.partition(":")[2].strip()
        out[path.stem] = family
    return out


def preset_spec(name: str) -> ModelSpec:
    """The spec of the family a shipped preset names."""
    known = presets()
    if name not in known:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(known)}")
    return model_spec(known[name])
