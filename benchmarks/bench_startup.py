"""Start-up benchmark: wall time of the CLI answers that need no data, no model and no weights.

Each command runs in a fresh process (`python -m primus_v4 ...`), several times, and the minimum
and the median wall time are printed; a loaded machine moves the median far more than the
minimum. The tree measured is the one `primus_v4` imports from (PYTHONPATH first): run it with
PYTHONPATH pointing at another checkout to time that one under the same conditions.
  help         primus-v4 --help
  dry-run      primus-v4 train --dry-run              (the default run config, checked and printed)
  presets      primus-v4 inspect presets
  bad-arg      primus-v4 train --bogus                (argparse refuses it: exit 2)
  bad-value    primus-v4 train --set train.steps=x    (the config refuses it: exit 3)
  export-bad   primus-v4 export --run missing --out x (the missing run dir refused: exit 8)
Usage: python benchmarks/bench_startup.py [--repeat 5] [--only help,dry-run]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "help": (["--help"], 0),
    "dry-run": (["train", "--dry-run"], 0),
    "presets": (["inspect", "presets"], 0),
    "bad-arg": (["train", "--bogus"], 2),
    "bad-value": (["train", "--set", "train.steps=x"], 3),
    "export-bad": (["export", "--run", "no_such_run_dir", "--out", "out_dir"], None),
}


def time_once(args: list[str], expect: int | None, cwd: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "primus_v4", *args], cwd=cwd, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    if expect is not None and done.returncode != expect:
        raise SystemExit(
            f"primus-v4 {' '.join(args)}: exit {done.returncode}, expected {expect}: "
            f"{done.stderr.strip()[-300:]}"
        )
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(COMMANDS), help="comma-separated names")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    import primus_v4

    print(f"tree: {os.path.dirname(os.path.dirname(primus_v4.__file__))}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; "
          f"{args.repeat} runs each")  # fmt: skip
    print(f"{'command':<12} {'min s':>7} {'median s':>9}")
    with tempfile.TemporaryDirectory() as cwd:
        for name in names:
            argv, expect = COMMANDS[name]
            times = [time_once(argv, expect, cwd) for _ in range(args.repeat)]
            print(f"{name:<12} {min(times):>7.2f} {statistics.median(times):>9.2f}")


if __name__ == "__main__":
    main()
