"""The selective-recompute parts a layer can rerun in backward, and the check of a choice of them
(torch-free: the run's validation reads it; the mechanism is models/common/recompute.py)."""

from __future__ import annotations

from collections.abc import Sequence

MODULES = ("layernorm", "mla_up_proj", "core_attn", "shared_experts", "moe")
DEFAULT_MODULES = ("layernorm", "mla_up_proj", "core_attn")


def check_modules(modules: Sequence[str]) -> None:
    from primus_v4.errors import ConfigError

    unknown = sorted(set(modules) - set(MODULES))
    if unknown or not modules:
        raise ConfigError(
            f"recompute_modules {list(modules)}: choose one or more of {list(MODULES)}"
            + (f" ({unknown} unknown)" if unknown else "")
        )
