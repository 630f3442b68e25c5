"""The learning-rate schedule: linear warmup to train.lr, then cosine decay to train.min_lr."""

from __future__ import annotations

import math
from collections.abc import Callable

from primus_v4.errors import ConfigError


def warmup_cosine(
    *, lr: float, min_lr: float, warmup_steps: int, total_steps: int
) -> Callable[[int], float]:
    """Multiplier of `lr` at scheduler step s (a LambdaLR factor): linear warmup to lr over
    `warmup_steps`, then cosine to min_lr at `total_steps`, min_lr after."""
    if lr <= 0 or not 0 <= min_lr <= lr:
        raise ConfigError(
            f"need 0 < train.lr and 0 <= train.min_lr <= train.lr; got lr={lr}, min_lr={min_lr}"
        )
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ConfigError(
            f"need 0 <= train.warmup_steps <= total steps and total steps >= 1; got "
            f"warmup_steps={warmup_steps}, total_steps={total_steps}"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            # (s + 1) / warmup: the first update already moves (an lr of 0 would waste a step).
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        value = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return value / lr

    return factor
