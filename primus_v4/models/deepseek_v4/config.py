"""DeepSeek-V4 model configuration: megatron-core `TransformerConfig` plus the V4-only fields.

Inherited fields used by this model: num_layers, hidden_size, num_attention_heads, kv_channels
(per-head dim, 512), num_query_groups (1: one shared KV latent), layernorm_epsilon,
init_method_std, num_moe_experts, moe_router_topk, moe_ffn_hidden_size,
moe_shared_expert_intermediate_size, moe_router_topk_scaling_factor, moe_aux_loss_coeff,
mtp_num_layers, mtp_loss_scaling_factor. Presets live as YAML in primus_v4/configs/models/.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from primus_v4.mcore import megatron_import

with megatron_import():
    from megatron.core.transformer import TransformerConfig

from primus_v4.models.deepseek_v4.geometry import (  # noqa: F401 (re-exported)
    LAYER_KINDS,
    PRESET_DIR,
    SIZE_BOUNDS,
    DeepseekV4Fields,
    check_sizes,
)


@dataclass(kw_only=True)
class DeepseekV4Config(DeepseekV4Fields, TransformerConfig):
    """TransformerConfig + DeepSeek-V4 fields (geometry.py: each documented where declared)."""

    def __post_init__(self) -> None:
        check_sizes(vars(self), source="model config")
        # Selective recompute names this model's parts (models/common/recompute.py);
        # Megatron's checks of its own module list do not apply to them.
        modules, self.recompute_modules = self.recompute_modules, []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            super().__post_init__()
        self.recompute_modules = modules
        if self.recompute_granularity == "selective":
            from primus_v4.models.common.recompute_choice import DEFAULT_MODULES, check_modules

            self.recompute_modules = list(DEFAULT_MODULES if modules is None else modules)
            check_modules(self.recompute_modules)
        self._check_model()
