"""Build (or find) this node's pack cache for a run config, exactly as the trainer would: the same
data config, so the same cache key, and the node-local lock that lets one process per node build.
The recipes call it once per node before torchrun starts (PRIMUS_PREPACK=1, run_scripts/slurm/),
so no rank spends its rendezvous or collective timeouts tokenizing.

usage: prepack.py --config CONFIG [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    from primus_v4.config import load_config
    from primus_v4.config.resolve import pack_spec
    from primus_v4.data.pipeline import build_or_load
    from primus_v4.errors import PrimusError

    parser = argparse.ArgumentParser(prog="prepack.py")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        splits = [None] + (["eval"] if cfg.data.eval_path or cfg.data.eval_fraction > 0 else [])
        for split in splits:
            corpus = build_or_load(pack_spec(cfg, split=split), progress=False)
            name = split or "train"
            print(f"prepack.py: {name} packs ready: {len(corpus)} rows", file=sys.stderr)
    except PrimusError as exc:
        print(f"prepack.py: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
