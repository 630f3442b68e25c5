"""Print the global batch a one-machine run uses when the caller did not choose one: the config's
train.global_batch_size raised to the next multiple of micro batch x dp (dp = world / (tp x pp x
cp)), so `NPROC=2 bash run_scripts/run_local.sh` runs on a config written for one process.
Prints nothing when the config's value already divides, or when the config does not load (the
trainer's validation that follows names the problem in one line).

usage: fit_global_batch.py WORLD CONFIG [--set KEY=VALUE ...]
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from primus_v4.config import load_config
    from primus_v4.errors import PrimusError

    world, config, rest = int(argv[0]), argv[1], argv[2:]
    sets = [rest[i + 1] for i in range(0, len(rest) - 1, 2) if rest[i] == "--set"]
    try:
        cfg = load_config(config, sets)
    except PrimusError:
        return 0
    p, t = cfg.parallel, cfg.train
    model = p.tp * p.pp * p.cp
    if world % model:
        return 0  # the validation says which sizes disagree
    step = t.micro_batch_size * (world // model)
    if t.global_batch_size % step:
        print(-(-t.global_batch_size // step) * step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
