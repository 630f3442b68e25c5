"""`inspect memory` vs the measured peak memory of tiny CPU runs (not a test).

Each case runs 2 steps of the tiny model (full vocab, synthetic corpus) in fresh processes. The
measured number is the peak of the bytes malloc has handed out and not taken back (glibc
mallinfo2: in-use heap + mmapped chunks; RSS would also count freed heap pages), sampled after
every module's forward, every parameter's gradient accumulation in backward, every CE chunk and
the optimizer step, minus the same number just before the trainer is built (after imports and the
corpus): what the plan covers. The plan's device + host total, given the corpus's supervised
fraction (the rows the LM head sees), is printed beside it.

    python benchmarks/bench_memory_plan.py   # the comparison table

The activation terms are counted from the code (models/common/activations.py); at Flash width
they are measured by benchmarks/bench_activation_width.py.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

CASES = [  # (seq, recompute, dp, offload)
    (1024, False, 1, 0.0), (2048, False, 1, 0.0), (4096, False, 1, 0.0),
    (4096, True, 1, 0.0), (2048, True, 1, 0.0), (4096, False, 1, 0.5),
    (2048, False, 2, 0.0), (4096, False, 2, 0.5), (4096, True, 2, 0.0),
]  # fmt: skip


def _settings(tmp: str, seq: int, recompute: bool, dp: int, offload: float) -> list[str]:
    items = [
        "data.path=synthetic:rows=64", f"data.seq_length={seq}",
        f"data.cache_dir={tmp}/cache", f"data.lock_dir={tmp}/locks",
        f"train.global_batch_size={dp}", "train.steps=2", "train.warmup_steps=1",
        f"optim.offload_fraction={offload}", f"output.dir={tmp}/out",
        "output.progress_bar=false", "output.plot=false",
    ]  # fmt: skip
    if recompute:
        items += ["model.overrides.recompute_granularity=full",
                  "model.overrides.recompute_method=uniform",
                  "model.overrides.recompute_num_layers=1"]  # fmt: skip
    return items


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _in_use() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def _sampled(trainer, peak: list[int]) -> None:
    """Sample the in-use bytes at every point where the peak can sit (see the docstring)."""
    import primus_v4.kernels.linear_ce as loss

    def sample(*_args, **_kwargs) -> None:
        peak[0] = max(peak[0], _in_use())

    for module in trainer.model.modules():
        module.register_forward_hook(sample)
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(sample)
    chunk_ce = loss._chunk_ce

    def sampled_chunk_ce(*args, **kwargs):
        out = chunk_ce(*args, **kwargs)  # its [C, V] buffer is still alive here
        sample()
        return out

    loss._chunk_ce = sampled_chunk_ce
    trainer.optimizer.register_step_post_hook(sample)


def _rank(rank: int, world: int, port: int, items: list[str], out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    from primus_v4.config import load_config, resolve_run
    from primus_v4.training.trainer import Trainer, build_corpus

    run = resolve_run(load_config(overrides=items), world=world)
    corpus = build_corpus(run)
    if world > 1:
        torch.distributed.init_process_group("gloo")
    base = _in_use()
    peak = [base]
    trainer = Trainer(run, corpus=corpus)
    _sampled(trainer, peak)
    trainer.train()
    out.put((peak[0] - base, float(corpus.stats["supervised_fraction"])))


def measured(items: list[str], world: int) -> tuple[int, float]:
    """(peak in-use bytes of the busiest rank, the corpus's supervised fraction)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, items, queue)) for r in range(world)]
    for p in procs:
        p.start()
    values = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return max(v[0] for v in values), values[0][1]


def planned(items: list[str], world: int, supervised: float) -> float:
    from primus_v4.config import load_config, resolve_run
    from primus_v4.memory.plan import plan_memory

    run = resolve_run(load_config(overrides=items), world=world)
    plans = plan_memory(run, supervised_fraction=supervised)
    return max(p.device_total + p.host_total for p in plans)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"{'seq':>5} {'recompute':>9} {'dp':>3} {'offload':>7} {'plan MiB':>9} "
          f"{'measured MiB':>12} {'plan/measured':>13}")  # fmt: skip
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for seq, recompute, dp, offload in CASES:
            items = _settings(tmp, seq, recompute, dp, offload)
            got, supervised = measured(items, dp)
            plan = planned(items, dp, supervised)
            worst = max(worst, abs(plan / got - 1))
            print(f"{seq:>5} {recompute!s:>9} {dp:>3} {offload:>7} {plan / 2**20:>9.1f} "
                  f"{got / 2**20:>12.1f} {plan / got:>13.3f}", flush=True)  # fmt: skip
    print(f"largest deviation of the plan from the measured peak: {100 * worst:.1f}%")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
