"""DeepSeek-V3-style router bias update (noaux_tc load balancing without an auxiliary loss).

After each optimizer step, every routed (non-hash) MoE layer moves its per-expert `gate.bias`:
    b_e += rate * sign(mean_load - load_e)
where load_e counts the rows routed to expert e during the step: summed over all micro-batches
of the step (the routers accumulate them while training) and over the data / context / expert
parallel ranks that hold the same layer (one all-reduce over `group`, the stage's DP x CP group,
which contains its EP ranks). The sums are exact integers in float64, so every rank applies the
same update. Padding rows are never routed, so they never count. Pipeline stages update only
the layers they hold (the counts of a layer live on its stage only).

`model.router_bias_update_rate` 0 (the default) turns it off: the bias stays the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from primus_v4.models.deepseek_v4.moe import Router


def routed_routers(modules: Iterable[nn.Module]) -> list[Router]:
    """The routers with a bias (routed layers; hash layers have none), in module order."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, Router) and not m.hashed]


class RouterBiasUpdate:
    """Call `step(apply=<the optimizer stepped>)` once per train step (no-op at rate 0)."""

    def __init__(
        self,
        modules: Iterable[nn.Module],
        *,
        rate: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if rate < 0:
            raise ValueError(f"model.router_bias_update_rate must be >= 0, got {rate}")
        self.rate, self.group = float(rate), group
        self.routers = routed_routers(modules) if rate > 0 else []
        for r in self.routers:
            r.track_load = True
            r.reset_load()

    @torch.no_grad()
    def global_loads(self) -> torch.Tensor:
        """[layers, experts] rows per expert of this step, summed over the group (float64)."""
        loads = torch.stack([r.load.to(torch.float64) for r in self.routers])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(loads, group=self.group)
        return loads

    @torch.no_grad()
    def step(self, *, apply: bool = True) -> None:
        """Update the biases from this step's loads (`apply=False`: a skipped optimizer step,
        the loads are dropped too); then start counting the next step."""
        if not self.routers:
            return
        if not apply:
            for router in self.routers:
                router.reset_load()
            return
        loads = self.global_loads()
        delta = self.rate * torch.sign(loads.mean(-1, keepdim=True) - loads)
        for router, d in zip(self.routers, delta, strict=True):
            router.bias.add_(d.to(device=router.bias.device, dtype=router.bias.dtype))
            router.reset_load()
