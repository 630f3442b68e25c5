"""Released-checkpoint load and export against plain safetensors, side by side in one run.

Writes a synthetic release-layout checkpoint (FP8 e4m3 linears + FP4 e2m1 experts with ue8m0
scales, bf16 / fp32 / int64 rest; >= 1 GiB stored) into a temp dir, then, each case in a fresh
subprocess (so peaks do not mix) and each three times, alternating (best time kept):
  load     `load_pretrained(dir, dtype=bfloat16)` (dequantize into a whole bf16 model)
           vs the floor: safetensors `safe_open` + `get_tensor` (+ clone: owned bytes, all kept
           like a loader's result) of every stored tensor, and vs the same read of the model's
           bf16 export (the same final bytes: FP4 -> bf16 writes 4x the bytes it reads, and
           each new page costs a fault on first touch, so the first floor is out of reach)
  memory   peak RSS of the load vs the bytes of the loaded model's state
  export   `save_pretrained(model, out, dtype=...)` (bf16, and fp8 incl. quantization)
           vs safetensors `save_file` of the same bytes in the same shard sizes; for fp8 also
           the export's encoding alone (quantizing every tensor, nothing written)
Usage: python benchmarks/bench_checkpoint.py [--layers 11] [--dir /tmp] [--threads N]
(cleans up after)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREADS = [0]  # --threads (0: torch's default)
SHARD_BYTES = 1 << 30  # export shards (both sides): bounds what a writer holds at once
REPEATS = 3  # every timed case, best kept (this kind of machine swings by 2x between runs)


def _config(layers: int) -> dict:
    """A release config.json: hidden 1024, 48 experts of 1024, dense/CSA/HCA layers, MTP."""
    ratios = [0] + [4 if i % 2 else 128 for i in range(1, layers)] + [0]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 16384, "hidden_size": 1024, "num_hidden_layers": layers,
        "num_attention_heads": 8, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 512,
        "o_groups": 2, "o_lora_rank": 256, "num_key_value_heads": 1,
        "n_routed_experts": 48, "num_experts_per_tok": 4, "moe_intermediate_size": 1024,
        "n_shared_experts": 1, "routed_scaling_factor": 1.5, "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "hidden_act": "silu", "swiglu_limit": 10.0, "tie_word_embeddings": False,
        "sliding_window": 128, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 64,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "compress_rope_theta": 160000, "num_nextn_predict_layers": 1,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "compress_ratios": ratios, "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip


def _write_synthetic(directory: Path, config: dict) -> dict:
    import torch

    from primus_v4.checkpoint_formats.sharded import write_checkpoint
    from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter

    cfg = adapter.config_from_release(config)
    table = adapter.release_tensors(cfg)
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, r in table.items():
            if r.kind == "int64":
                yield name, torch.randint(0, cfg.num_moe_experts, r.shape, generator=gen)
            else:
                yield name, torch.randn(r.shape, generator=gen) / math.sqrt(r.shape[-1])

    kinds = {n: r.kind for n, r in table.items()}
    start = time.perf_counter()
    summary = write_checkpoint(directory, tensors(), kinds, config, dtype="fp8")
    values = sum(math.prod(r.shape) for r in table.values() if r.kind in ("fp8", "fp4"))
    return {"bytes": summary.total_bytes, "shards": summary.shards, "values": values,
            "tensors": len(table), "s": time.perf_counter() - start}  # fmt: skip


def _rss_bytes() -> int:
    """This process's peak resident set. VmHWM (Linux) belongs to the process's own address
    space; ru_maxrss would carry the parent's peak over fork + exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: KiB


def _child_floor_load(directory: str) -> dict:
    from safetensors import safe_open

    start, kept = time.perf_counter(), []
    for shard in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                # clone: get_tensor maps the file lazily; a loader must own the bytes, and keeps
                # them all (freed blocks would be reused without the first-touch page faults
                # every loader pays for its result)
                kept.append(f.get_tensor(key).clone())
    seconds = time.perf_counter() - start
    return {"s": seconds, "bytes": sum(t.numel() * t.element_size() for t in kept)}


def _child_load(directory: str) -> dict:
    import torch

    from primus_v4.models.deepseek_v4.release.load import load_pretrained

    base = _rss_bytes()
    start = time.perf_counter()
    model = load_pretrained(directory, dtype=torch.bfloat16, progress=False)
    seconds = time.perf_counter() - start
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"s": seconds, "param_bytes": state, "peak_rss": _rss_bytes(), "base_rss": base}


def _child_export(directory: str, scratch: str) -> dict:
    import torch

    from primus_v4.models.deepseek_v4.release.load import load_pretrained, save_pretrained

    model = load_pretrained(directory, dtype=torch.bfloat16, progress=False)
    out: dict = {}
    for dtype in ("bfloat16", "fp8"):
        target = Path(scratch) / f"export_{dtype}"
        best: dict = {}
        for rep in range(REPEATS):  # ours and the floor alternate; the best of each is kept
            if rep:
                shutil.rmtree(target)
            os.sync()  # both sides start with no dirty pages to write back
            start, cpu = time.perf_counter(), time.process_time()
            save_pretrained(model, target, dtype=dtype, max_shard_bytes=SHARD_BYTES, progress=False)
            _keep_best(best, "ours", time.perf_counter() - start, time.process_time() - cpu)
            _keep_best(best, "floor", *_floor_write(target, Path(scratch) / f"floor_{dtype}"))
            if dtype == "fp8":  # what the export's own encoding costs, nothing written
                _keep_best(best, "encode", *_encode_only(model))
        out[dtype] = best
        if dtype == "fp8":
            from primus_v4.checkpoint_formats import native_quant

            native = native_quant.library() is not None
            best["quantizer"] = "the native C pass" if native else "torch ops: no C compiler"

        if dtype == "fp8":  # the bf16 export stays: the second load floor reads it
            shutil.rmtree(target)
    return out


def _keep_best(best: dict, key: str, wall: float, cpu: float) -> None:
    if f"{key}_s" not in best or wall < best[f"{key}_s"]:
        best[f"{key}_s"], best[f"{key}_cpu_s"] = wall, cpu


def _floor_write(export: Path, copies: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of safetensors `save_file` writing exactly the bytes the export
    wrote, in final form, shard by shard, into files that stay (as the export's do) until both
    are timed: a file deleted before write-back would never reach the disk."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    copies.mkdir()
    os.sync()
    wall = cpu = 0.0
    for shard in sorted(export.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
        start, cpu0 = time.perf_counter(), time.process_time()
        save_file(tensors, copies / shard.name, metadata={"format": "pt"})
        wall += time.perf_counter() - start
        cpu += time.process_time() - cpu0
        del tensors
    shutil.rmtree(copies)
    return wall, cpu


def _encode_only(model) -> tuple[float, float]:
    """(wall, CPU) seconds of the fp8 export's encoding pipeline alone (the same worker threads
    quantizing every tensor, their results dropped): the export's compute floor."""
    from primus_v4.checkpoint_formats.sharded import _encoded
    from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter

    kinds = {r.name: r.kind for r in adapter.release_tensors(model.cfg).values()}
    start, cpu = time.perf_counter(), time.process_time()
    for _ in _encoded(adapter.to_release(model.cfg, model.state_dict()), kinds.__getitem__, "fp8"):
        pass
    return time.perf_counter() - start, time.process_time() - cpu


def _run_child(*args: str) -> dict:
    env = dict(os.environ)
    if THREADS[0]:  # torch reads it at start: every child (ours and the floors) alike
        env["OMP_NUM_THREADS"] = str(THREADS[0])
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _report(written: dict, floor: list[dict], ours: list[dict], export: dict,
            bf16: list[dict]) -> None:  # fmt: skip
    f, o = min(r["s"] for r in floor), min(r["s"] for r in ours)
    f16 = min(r["s"] for r in bf16)
    best = min(ours, key=lambda r: r["s"])
    mem = max(r["peak_rss"] for r in ours)
    growth = max(r["peak_rss"] - r["base_rss"] for r in ours)
    params = best["param_bytes"]
    rows = [
        ("checkpoint (stored, FP8+FP4)", f"{written['bytes'] / 2**30:.3f} GiB",
         f"{written['shards']} shards, {written['tensors']} tensors"),
        ("load: safetensors floor", f"{f:.2f} s", "get_tensor + clone of every stored tensor"),
        ("load: safetensors bf16 floor", f"{f16:.2f} s",
         f"the same model as a bf16 checkpoint ({bf16[0]['bytes'] / 2**30:.2f} GiB read)"),
        ("load: load_pretrained bf16", f"{o:.2f} s",
         f"{o / f:.2f}x the FP8/FP4 floor (target <= 1.5x), {o / f16:.2f}x the bf16 floor"),
        ("load: peak RSS", f"{mem / 2**30:.2f} GiB",
         f"params {params / 2**30:.2f} GiB: {mem / params:.2f}x (target <= 1.3x); growth during "
         f"the load {growth / 2**30:.2f} GiB = {growth / params:.2f}x"),
    ]  # fmt: skip
    for dtype, e in export.items():
        rows.append((f"export {dtype}: ours", f"{e['ours_s']:.2f} s",
                     f"safetensors {e['floor_s']:.2f} s: ratio {e['ours_s'] / e['floor_s']:.2f}x "
                     f"(target <= 1.5x); CPU time (all threads) ours {e['ours_cpu_s']:.2f} s, "
                     f"safetensors {e['floor_cpu_s']:.2f} s"))  # fmt: skip
        if "encode_s" in e:
            rows.append((f"export {dtype}: encoding alone", f"{e['encode_s']:.2f} s",
                         f"{e['encode_s'] / e['floor_s']:.2f}x the safetensors write, CPU "
                         f"{e['encode_cpu_s']:.2f} s: quantizing {written['values'] / 1e9:.2f} G "
                         f"values, {e['encode_cpu_s'] / written['values'] * 1e9:.2f} ns CPU "
                         f"each ({e['quantizer']})"))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'value':>10}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    checks = [
        ("load time <= 1.5x safetensors (FP8/FP4 floor)", o / f <= 1.5),
        ("load time <= 1.5x safetensors (bf16 floor)", o / f16 <= 1.5),
        ("peak RSS <= 1.3x parameter bytes", mem / params <= 1.3),
        *((f"export {d} <= 1.5x safetensors", e["ours_s"] / e["floor_s"] <= 1.5)
          for d, e in export.items()),
    ]  # fmt: skip
    for name, ok in checks:
        print(f"check: {name}: {'PASS' if ok else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=11, help="decoder layers (11: ~1.08 GiB)")
    parser.add_argument("--dir", default=None, help="where the temp dir goes (default: $TMPDIR)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in every case (default: torch's; on a shared machine "
                             "1 avoids stalls of a descheduled second thread)")  # fmt: skip
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    THREADS[0] = args.threads
    if args.child:
        kind, *rest = args.child
        fn = {"floor": _child_floor_load, "load": _child_load, "export": _child_export}[kind]
        print(json.dumps(fn(*rest)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir))
    try:
        ckpt = tmp / "release"
        written = _write_synthetic(ckpt, _config(args.layers))
        floor, ours = [], []
        for _ in range(REPEATS):  # alternate, best of each: page cache and machine load alike
            floor.append(_run_child("floor", str(ckpt)))
            ours.append(_run_child("load", str(ckpt)))
        export = _run_child("export", str(ckpt), str(tmp))
        bf16 = [_run_child("floor", str(tmp / "export_bfloat16")) for _ in range(REPEATS)]
        import torch

        threads = args.threads or torch.get_num_threads()
        print(f"torch threads per case: {threads} (of {os.cpu_count()} CPUs)")
        _report(written, floor, ours, export, bf16)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
