"""AdamW with linear warmup + cosine decay, and optional optimizer-state offload to host memory.

`offload_fraction` f keeps about f of the optimizer state (by parameter numel) and its update on
the host: those parameters get a host-side copy that a host AdamW steps (grads copied down,
parameters copied back); the rest are stepped by a device AdamW. Both sides run the same torch
AdamW code with the same `foreach` flag on tensors of the parameter's own dtype, so on CPU the
steps are bit-identical to no offload; on a GPU the host side rounds like CPU kernels do.

The optimizer's `state_dict()` has torch's standard AdamW format (state indexed by parameter
position), whatever the split, so a checkpoint resumes under a different offload fraction and
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` maps it to parameter names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from primus_v4.errors import ConfigError
from primus_v4.log import get_logger

log = get_logger(__name__)

ParamsArg = Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter]


def _no_decay(name: str | None, param: torch.Tensor) -> bool:
    # Norm gains, biases and other vectors are not weight-decayed (decay would pull gains to 0).
    if param.ndim < 2:
        return True
    return name is not None and (name.endswith(".bias") or "norm" in name.lower())


def param_groups(params: ParamsArg, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, decayed and not decayed, from named or plain parameters (frozen ones skipped)."""
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    for item in params:
        name, p = item if isinstance(item, tuple) else (None, item)
        if not p.requires_grad:
            continue
        (keep if _no_decay(name, p) else decay).append(p)
    if not decay and not keep:
        raise ConfigError("build_optimizer got no trainable parameters")
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]


def pick_offloaded(params: list[torch.Tensor], fraction: float) -> set[int]:
    """Indices of parameters kept on host: largest first, while they fit in fraction x numel."""
    total = sum(p.numel() for p in params)
    budget = fraction * total
    chosen: set[int] = set()
    used = 0
    # Largest-first reaches the budget with the fewest tensors (fewer, larger host copies).
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        if used + params[i].numel() <= budget + 1e-9 * total:
            chosen.add(i)
            used += params[i].numel()
    return chosen


def _host_copy(p: torch.Tensor) -> torch.Tensor:
    copy = p.detach().to("cpu", copy=True)
    # Pinned memory makes the per-step host<->device copies asynchronous-capable DMA.
    return copy.pin_memory() if p.is_cuda else copy


class OffloadAdamW(Optimizer):
    """AdamW whose state for some parameters lives (and is updated) on the host.

    `param_groups` hold the model's parameters, so LR schedulers and grad clipping see one
    ordinary optimizer. Sub-optimizers do the work: `_device` over the kept parameters, `_host`
    over host copies of the offloaded ones.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        offload_fraction: float,
        foreach: bool | None = None,
    ) -> None:
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        flat = [p for g in self.param_groups for p in g["params"]]
        offloaded = pick_offloaded(flat, offload_fraction)
        self._host_of: dict[int, torch.Tensor] = {
            id(flat[i]): _host_copy(flat[i]) for i in sorted(offloaded)
        }
        self._foreach = foreach
        self._device = self._sub(lambda p: id(p) not in self._host_of)
        self._host = self._sub(lambda p: id(p) in self._host_of, host=True)
        n_host = sum(flat[i].numel() for i in offloaded)
        n_all = sum(p.numel() for p in flat)
        log.info(
            "optimizer state on host: %d / %d parameters (%.1f%%, asked %.1f%%)",
            n_host,
            n_all,
            100.0 * n_host / max(n_all, 1),
            100.0 * offload_fraction,
        )

    def _sub(self, keep, *, host: bool = False) -> AdamW | None:
        """An AdamW over the selected parameters, one sub-group per group (possibly empty)."""
        groups = []
        for g in self.param_groups:
            ps = [p for p in g["params"] if keep(p)]
            if host:
                ps = [self._host_of[id(p)] for p in ps]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
        if not any(g["params"] for g in groups):
            return None
        opt = AdamW([g for g in groups if g["params"]], foreach=self._foreach)
        # Remember which of our groups each sub-group mirrors (empty ones were dropped).
        opt._mirror = [i for i, g in enumerate(groups) if g["params"]]  # type: ignore[attr-defined]
        return opt

    def _sync_hyperparams(self) -> None:
        for sub in (self._device, self._host):
            if sub is None:
                continue
            for sub_group, i in zip(sub.param_groups, sub._mirror, strict=True):  # type: ignore[attr-defined]
                for key, value in self.param_groups[i].items():
                    if key != "params":
                        sub_group[key] = value

    def _link_state(self) -> None:
        """Expose the sub-optimizers' per-parameter state under our own parameters."""
        for g in self.param_groups:
            for p in g["params"]:
                host = self._host_of.get(id(p))
                sub, key = (self._host, host) if host is not None else (self._device, p)
                if sub is not None and key in sub.state:
                    self.state[p] = sub.state[key]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparams()
        if self._device is not None:
            self._device.step()
        if self._host is not None:
            pairs = [
                (p, self._host_of[id(p)])
                for g in self.param_groups
                for p in g["params"]
                if id(p) in self._host_of
            ]
            for p, host in pairs:
                host.grad = None if p.grad is None else p.grad.detach().to(host.device)
            self._host.step()
            for p, host in pairs:
                p.copy_(host, non_blocking=True)
                host.grad = None
        self._link_state()
        return loss

    @torch.no_grad()
    def refresh_host_copies(self) -> None:
        """Re-copy offloaded parameters to host (after the model's weights were loaded)."""
        for g in self.param_groups:
            for p in g["params"]:
                host = self._host_of.get(id(p))
                if host is not None:
                    host.copy_(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load torch's AdamW format; offloaded state goes straight to host (no device spike)."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ConfigError(
                "optimizer checkpoint does not match the model: parameter group sizes "
                f"{[len(g['params']) for g in groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        by_index = {}
        for mine, saved in zip(self.param_groups, groups, strict=True):
            mine.update({k: v for k, v in saved.items() if k != "params"})
            by_index.update(zip(saved["params"], mine["params"], strict=True))
        self.state.clear()
        for sub in (self._device, self._host):
            if sub is not None:
                sub.state.clear()
        for index, values in state_dict["state"].items():
            p = by_index[index]
            host = self._host_of.get(id(p))
            target = host if host is not None else p
            sub = self._host if host is not None else self._device
            sub.state[target] = {  # type: ignore[union-attr]
                k: _own_copy(k, v, target) for k, v in values.items()
            }
        self._sync_hyperparams()
        self._link_state()
        self.refresh_host_copies()


def _own_copy(key: str, value: Any, param: torch.Tensor) -> Any:
    """A private copy of one saved state value (the caller may keep using the saved tensors)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        # AdamW keeps its step counter on CPU (non-capturable); moments follow the parameter.
        return value.clone()
    return value.to(device=param.device, dtype=param.dtype, copy=True)


def warmup_cosine(*, lr: float, min_lr: float, warmup_steps: int, total_steps: int):
    """Multiplier of `lr` at scheduler step s: linear warmup to lr, then cosine to min_lr."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            # (s + 1) / warmup: the first update already moves (an lr of 0 would waste a step).
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return value / lr

    return factor


def check_hyperparams(
    *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, offload_fraction: float
) -> None:
    """The optimizer and schedule settings every AdamW here accepts (ConfigError otherwise)."""
    if not 0.0 <= offload_fraction <= 1.0:
        raise ConfigError(f"optim.offload_fraction must be in [0, 1], got {offload_fraction}")
    if lr <= 0 or not 0 <= min_lr <= lr:
        raise ConfigError(
            f"need 0 < optim.lr and 0 <= optim.min_lr <= lr; got lr={lr}, min_lr={min_lr}"
        )
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ConfigError(
            f"need 0 <= warmup_steps <= total_steps and total_steps >= 1; got "
            f"warmup_steps={warmup_steps}, total_steps={total_steps}"
        )


def build_optimizer(
    params: ParamsArg,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    offload_fraction: float = 0.0,
    foreach: bool | None = None,
) -> tuple[OffloadAdamW, LambdaLR]:
    """AdamW (no decay on norms, biases, 1-D params) + warmup/cosine schedule.

    `foreach=None` lets torch choose per device (for-loop on CPU, foreach on GPU); both sides of
    the offload split then use the same choice, which bit-identity relies on.
    """
    check_hyperparams(lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps,
                      offload_fraction=offload_fraction)  # fmt: skip
    optimizer = OffloadAdamW(
        param_groups(params, weight_decay),
        lr=lr,
        betas=betas,
        eps=eps,
        offload_fraction=offload_fraction,
        foreach=foreach,
    )
    schedule = warmup_cosine(
        lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps
    )
    return optimizer, LambdaLR(optimizer, schedule)
