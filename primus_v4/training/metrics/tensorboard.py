"""Optional TensorBoard event files (`output.tensorboard: true`, the `tensorboard` extra): the
same numeric scalars as metrics.jsonl, one point per step, under <output.dir>/tensorboard."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from primus_v4.config.preflight import TENSORBOARD_MISSING as MISSING
from primus_v4.config.preflight import tensorboard_available as available
from primus_v4.errors import ConfigError


class TensorBoardSink:
    """Writes each metrics row's numbers as scalars at its step."""

    def __init__(self, log_dir: str | Path) -> None:
        if not available():
            raise ConfigError(MISSING)
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(log_dir))

    def write(self, metrics: Any) -> None:
        for key, value in asdict(metrics).items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # flags and not-evaluated (None) values are not scalars
            self._writer.add_scalar(key, value, global_step=metrics.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
