"""Rank-aware logging: every record carries the rank; non-zero ranks are quiet unless asked.

Library code logs through `get_logger(__name__)`; only the CLI prints.
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "primus_v4"
_configured = False


def current_rank() -> int:
    """Global rank from torch.distributed when it is up, else from the launcher's env (RANK)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return self.all_ranks or record.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(level: str | int = "INFO", *, all_ranks: bool | None = None) -> None:
    """Configure the package logger once; `PRIMUS_LOG_ALL_RANKS=1` lets every rank speak."""
    global _configured
    if all_ranks is None:
        all_ranks = os.environ.get("PRIMUS_LOG_ALL_RANKS", "0") not in ("", "0")
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s [r%(rank)s] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    handler.addFilter(_RankFilter(all_ranks))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    _configured = True


def _env_level() -> str:
    """`PRIMUS_LOG_LEVEL` (any case), INFO when unset or not a level: the CLI's environment check
    names a bad value in one line before any command runs."""
    level = os.environ.get("PRIMUS_LOG_LEVEL", "").strip().upper()
    return level if level in logging.getLevelNamesMapping() else "INFO"


def get_logger(name: str) -> logging.Logger:
    """A logger under the package root; configures a default handler on first use."""
    if not _configured:
        setup_logging(_env_level())
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
