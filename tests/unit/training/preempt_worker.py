"""A training process for the preemption tests: the fake LM through `commands.train.execute`
(the CLI's run-and-report path), each step slowed down so a signal lands mid-run.

usage: python preempt_worker.py TMP_DIR SECONDS_PER_STEP [--set items...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))

from test_run_checkpoints import _trainer

from primus_v4.commands.train import execute


def main() -> int:
    tmp, delay, *settings = sys.argv[1:]
    trainer = _trainer(Path(tmp), *settings)
    step = trainer.train_step

    def slow_step(i: int):
        time.sleep(float(delay))
        return step(i)

    trainer.train_step = slow_step  # type: ignore[method-assign]
    return execute(trainer)


if __name__ == "__main__":
    sys.exit(main())
