"""Model definitions (the math); parallelism and kernels are passed in from outside.

Each model folder exports a `ModelSpec` (models/spec.py); `model_spec(name)` finds it.
"""

from primus_v4.models.deepseek_v4.spec import SPEC as DEEPSEEK_V4
from primus_v4.models.model_spec import ModelSpec

SPECS: dict[str, ModelSpec] = {DEEPSEEK_V4.name: DEEPSEEK_V4}


def model_spec(name: str = "deepseek_v4") -> ModelSpec:
    """The spec of the model family `name` (the only one today: deepseek_v4)."""
    if name not in SPECS:
        raise KeyError(f"unknown model family {name!r}; known: {sorted(SPECS)}")
    return SPECS[name]
