"""The model's one weight-init rule, deterministic per parameter name.

Every parameter draws from its own CPU generator seeded by (seed, parameter name), and every
expert of an [E, ...] expert weight from (seed, name, global expert index). A value therefore
does not depend on which other modules exist, in which order they were built, or on which
device they live: a pipeline stage or an expert shard [e0:e1] materialized alone on its rank
equals the same parameters (rows) of the whole model built in one process.

Persistent router buffers (the routed layers' `bias`, the hash layers' `tid2eid`) are model
state like parameters: `init_parameters` gives them their random-init values (bias 0, the table
drawn from (hash_seed + layer)), and a loaded checkpoint overwrites them. Derived buffers (RoPE
frequencies) come from the config alone; `init_buffers` recomputes only those after `to_empty`,
so it never touches loaded state.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from primus_v4.models.common.seeds import param_seed
from primus_v4.models.deepseek_v4.attention import Attention
from primus_v4.models.deepseek_v4.compressor import Compressor
from primus_v4.models.deepseek_v4.hyper_connection import HyperHead, HyperMixer
from primus_v4.models.deepseek_v4.moe import MoE, Router
from primus_v4.models.deepseek_v4.norm import RMSNorm

# Parameters that start at a constant; every other parameter is drawn from N(0, std).
# Norm and mHC scales 1 (identity); mHC biases 0 (pre = 1/2, post = 1, uniform 1/K mixing);
# compressor position bias 0 (windows weighed by content only); attention sinks 0 (one extra
# zero logit).
_CONSTANTS: tuple[tuple[type[nn.Module], str, float], ...] = (
    (RMSNorm, "weight", 1.0),
    (nn.RMSNorm, "weight", 1.0),
    (HyperMixer, "scale", 1.0),
    (HyperMixer, "bias", 0.0),
    (HyperHead, "scale", 1.0),
    (HyperHead, "bias", 0.0),
    (Compressor, "ape", 0.0),
    (Attention, "attn_sink", 0.0),
    (nn.Linear, "bias", 0.0),
)
EXPERT_WEIGHTS = ("w_gate_up", "w_down")


def draw_normal(shape: torch.Size, std: float, seed: int, name: str) -> torch.Tensor:
    """N(0, std) float32 on CPU from the (seed, name) generator: the same on every device."""
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    out = torch.empty(shape, dtype=torch.float32, device="cpu")  # even under a device context
    return out.normal_(0.0, std, generator=gen)


def _base(module: nn.Module, attr: str) -> bool:
    """Whether a parameter is the model's own (LoRA adapters, lora.py, draw their own init)."""
    return attr not in getattr(module, "adapter_params", ())


def _constant(module: nn.Module, attr: str) -> float | None:
    """A parameter's constant init value, or None when it is drawn. A module of another family
    names its own constants in a `constant_params` class attribute ({attr: value})."""
    own = getattr(module, "constant_params", {})
    if attr in own:
        return own[attr]
    for kind, name, value in _CONSTANTS:
        if isinstance(module, kind) and attr == name:
            return value
    return None


def drawn_values(
    model: nn.Module, *, seed: int, std: float
) -> Iterator[tuple[nn.Parameter, int, torch.Tensor]]:
    """(parameter, flat offset, float32 values) of every drawn (non-constant) parameter of
    `model`, one piece at a time: a whole parameter, or one expert of an [E, ...] expert weight.
    Drawn lazily, so at most one piece exists at once. These are the exact float32 draws: a bf16
    parameter holds their rounding, the optimizer's fp32 masters can start from them."""
    for prefix, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if _constant(module, attr) is not None or not _base(module, attr):
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if isinstance(module, MoE) and attr in EXPERT_WEIGHTS:
                # Drawn per global expert so a shard [lo, lo + L) is rows of the full tensor.
                lo, per = getattr(module, "expert_offset", 0), p[0].numel()
                for i in range(p.shape[0]):
                    yield p, i * per, draw_normal(p.shape[1:], std, seed, f"{name}.{lo + i}")
            else:
                yield p, 0, draw_normal(p.shape, std, seed, name)


@torch.no_grad()
def init_parameters(model: nn.Module, *, seed: int, std: float) -> None:
    """Initialize every parameter and persistent router buffer of `model` (a whole model, a
    stage or a sharded one)."""
    for module in model.modules():
        if isinstance(module, Router):
            module.init_routing_buffers()
        for attr, p in module.named_parameters(recurse=False):
            value = _constant(module, attr)
            if value is not None:
                p.fill_(value)
    for p, offset, value in drawn_values(model, seed=seed, std=std):
        p.view(-1)[offset : offset + value.numel()].copy_(value.view(-1))


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """Recompute every config-derived (non-persistent) buffer, e.g. after `to_empty`."""
    for module in model.modules():
        if module is not model and callable(getattr(module, "init_buffers", None)):
            module.init_buffers()
