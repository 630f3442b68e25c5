"""Start-up benchmark: wall time of the CLI answers that need no data, no model and no weights.

Each command runs in a fresh process (`python -m primus_v4 ...`, or a recipe through bash),
once untimed (bytecode written), then several times, and the minimum and the median wall time
are printed; a loaded machine moves the median far more than the minimum. The tree measured is
the one `primus_v4` imports from (PYTHONPATH first). `--before REF` also measures the package
and recipes of a git revision (exported with `git archive` into a temporary directory) side by
side in the same run, the two trees' runs alternating so that both see the same load.
  help          primus-v4 --help
  dry-run       primus-v4 train --dry-run              (the default run config, checked and printed)
  dry-run-v41   primus-v4 train --dry-run --set model.preset=tiny_v41   (DeepSeek-V4.1's geometry)
  dry-run-flash primus-v4 train --dry-run --set model.preset=deepseek_v4_flash --set parallel.pp=4
                (WORLD_SIZE=4: the Flash geometry over four pipeline stages)
  recipe-dry    DRY_RUN=1 PRIMUS_MEMORY_PLAN=0 bash run_scripts/run_local.sh  (validate, print)
  presets       primus-v4 inspect presets
  bad-arg       primus-v4 train --bogus                (argparse refuses it: exit 2)
  bad-value     primus-v4 train --set train.steps=x    (the config refuses it: exit 3)
  export-bad    primus-v4 export --run missing --out x (the missing run dir refused: exit 8)
Usage: python benchmarks/bench_startup.py [--repeat 5] [--only help,dry-run] [--before REF]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLASH = ["--set", "model.preset=deepseek_v4_flash", "--set", "parallel.pp=4"]

# name -> (primus-v4 arguments, or a recipe under run_scripts/; expected exit; extra environment)
COMMANDS: dict[str, tuple[list[str] | str, int | None, dict[str, str]]] = {
    "help": (["--help"], 0, {}),
    "dry-run": (["train", "--dry-run"], 0, {}),
    "dry-run-v41": (["train", "--dry-run", "--set", "model.preset=tiny_v41"], 0, {}),
    "dry-run-flash": (["train", "--dry-run", *FLASH], 0, {"WORLD_SIZE": "4"}),
    "recipe-dry": ("run_local.sh", 0, {"DRY_RUN": "1", "PRIMUS_MEMORY_PLAN": "0"}),
    "presets": (["inspect", "presets"], 0, {}),
    "bad-arg": (["train", "--bogus"], 2, {}),
    "bad-value": (["train", "--set", "train.steps=x"], 3, {}),
    "export-bad": (["export", "--run", "no_such_run_dir", "--out", "out_dir"], None, {}),
}


def time_once(name: str, tree: Path, cwd: str) -> float:
    """Wall seconds of one run of command `name` with the package and recipes of `tree`."""
    command, expect, extra = COMMANDS[name]
    env = {**os.environ, "PYTHONPATH": str(tree), **extra}
    if isinstance(command, str):
        argv = ["bash", str(tree / "run_scripts" / command)]
        env["PRIMUS_PYTHON"] = sys.executable
    else:
        argv = [sys.executable, "-m", "primus_v4", *command]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if expect is not None and done.returncode != expect:
        raise SystemExit(
            f"{name} ({tree}): exit {done.returncode}, expected {expect}: "
            f"{done.stderr.strip()[-300:]}"
        )
    return elapsed


def export_revision(ref: str, into: Path) -> None:
    """The package and the recipes of git revision `ref`, written under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "primus_v4", "run_scripts"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(COMMANDS), help="comma-separated names")
    parser.add_argument("--before", default=None, metavar="REF", help="a git revision to compare")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    import primus_v4

    after = Path(primus_v4.__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as old:
        trees = {"after": after}
        if args.before:
            export_revision(args.before, Path(old))
            trees = {f"before ({args.before})": Path(old), **trees}
        load = os.getloadavg()[0]
        print(f"after: {after}; {os.cpu_count()} CPUs; load average {load:.2f}; "
              f"{args.repeat} runs each, min / median seconds")  # fmt: skip
        print(f"{'command':<14}" + "".join(f"{label:>26}" for label in trees))
        for name in names:
            for tree in trees.values():  # untimed: writes the exported tree's bytecode
                time_once(name, tree, cwd)
            times: dict[str, list[float]] = {label: [] for label in trees}
            for _ in range(args.repeat):
                for label, tree in trees.items():
                    times[label].append(time_once(name, tree, cwd))
            cells = [f"{min(t):.2f} / {statistics.median(t):.2f}" for t in times.values()]
            print(f"{name:<14}" + "".join(f"{cell:>26}" for cell in cells))


if __name__ == "__main__":
    main()
