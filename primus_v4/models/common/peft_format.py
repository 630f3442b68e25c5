"""Hugging Face PEFT's LoRA `adapter_config.json`, as every family's PEFT export writes it (which
modules, names and patterns is the family's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def lora_config(
    *,
    rank: int,
    alpha: float,
    dropout: float,
    base_model: str | None,
    target_modules: list[str],
    target_parameters: list[str],
    modules_to_save: list[str] | None,
    rank_pattern: dict[str, int],
    alpha_pattern: dict[str, float],
) -> dict[str, Any]:
    """The config of an inference-mode LoRA adapter. PEFT's parameter LoRA (target_parameters)
    refuses dropout (it cannot apply it to the input), and inference never uses it: with any
    target parameter the dropout is written 0."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0 if target_parameters else dropout,
        "target_modules": target_modules or None,
        "target_parameters": target_parameters or None,
        "modules_to_save": modules_to_save,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def rank_patterns(
    wider: Mapping[str, int], r: int, alpha: float, *, anchor: str | None
) -> tuple[dict[str, int], dict[str, float]]:
    """rank_pattern / alpha_pattern giving each parameter in `wider` rank k r and alpha k alpha.

    PEFT matches a pattern key K as the regex `(.*\\.)?(K)$`, taking the first key that matches,
    and warns about a key that matches no targeted *module*, though parameter keys are matched
    too. With a targeted module `anchor`, each key is `param|anchor` (it then matches a module)
    behind the key `anchor` of rank r, alpha alpha (the global ones), which the anchor module
    meets first: every rank is as meant and PEFT has nothing to warn about."""
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    if wider and anchor is not None:
        ranks[anchor], alphas[anchor] = r, alpha
    for name, k in wider.items():
        key = name if anchor is None else f"{name}|{anchor}"
        ranks[key], alphas[key] = k * r, k * alpha
    return ranks, alphas
