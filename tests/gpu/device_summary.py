"""The one summary file of tests/gpu/run_device_checks.sh: the gpu suite's pass/fail counts (its
JUnit XML), TFLOP/s per kernel and backend next to the torch reference (bench_kernels --json),
the training run's tokens/s and losses (its metrics.jsonl), and each part's status and seconds.
A part that left no output is reported as such, not guessed. Exits 1 unless every part passed."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from primus_v4.training.metrics.history import read_history
from primus_v4.training.metrics.writer import loss_window, summarize

GIB = 2**30


def suite_counts(junit: Path) -> dict[str, int] | None:
    """passed / failed / errors / skipped / total over every <testsuite> of pytest's XML."""
    if not junit.is_file():
        return None
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors",
                                                                "skipped")}  # fmt: skip
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {"passed": passed, "failed": total["failures"], "errors": total["errors"],
            "skipped": total["skipped"], "total": total["tests"]}  # fmt: skip


def kernel_rows(bench: Path) -> dict[str, Any] | None:
    if not bench.is_file():
        return None
    return json.loads(bench.read_text())


def train_numbers(metrics: Path) -> dict[str, Any] | None:
    """Steps, mean tokens/s (first step left out), first/last loss means, peak memory."""
    if not metrics.is_file():
        return None
    rows = read_history(metrics)
    if not rows:
        return None
    s = summarize(rows)
    k = loss_window(len(rows))
    return {"steps": s["steps"], "tokens_per_s": s["tokens_per_s"],
            "real_tokens_per_s": s["real_tokens_per_s"],
            "mean_step_seconds": s["mean_step_seconds"], f"loss_first_{k}": s[f"loss_first_{k}"],
            f"loss_last_{k}": s[f"loss_last_{k}"],
            "peak_memory_gib": s["peak_memory_bytes"] / GIB}  # fmt: skip


def _parts(items: list[str]) -> dict[str, dict[str, Any]]:
    """`name=status:seconds` -> {name: {"status": ..., "seconds": ...}}."""
    parts = {}
    for item in items:
        name, rest = item.split("=", 1)
        status, seconds = rest.rsplit(":", 1)
        parts[name] = {"status": status, "seconds": int(seconds)}
    return parts


def _device() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "hip": torch.version.hip,
                            "cuda": torch.version.cuda}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"name": props.name, "memory_gib": props.total_memory / GIB}
    return info


def _report(summary: dict[str, Any]) -> str:
    lines = [f"device check on {summary['device'].get('name', '?')} ({summary['arch']})"]
    for name, part in summary["parts"].items():
        lines.append(f"  {name:<14} {part['status']:<10} {part['seconds']:>4} s")
    suite = summary["gpu_suite"]
    if suite is not None:
        lines.append("  gpu suite: {passed} passed, {failed} failed, {errors} errors, "
                     "{skipped} skipped of {total}".format(**suite))  # fmt: skip
    for row in (summary["kernels"] or {}).get("rows", []):
        tflops = "/".join(f"{v:.3g}" if v is not None else "-"
                          for v in (row["fwd_tflops"], row["bwd_tflops"]))  # fmt: skip
        speed = f"{row['vs_torch']:.2f}x" if row["vs_torch"] else "-"
        lines.append(f"  {row['op']:<17} {row['rows']:>6} {row['backend']:<13} "
                     f"TFLOP/s fwd/bwd {tflops:<15} vs torch {speed}")  # fmt: skip
    if summary["train"] is not None:
        t = summary["train"]
        lines.append(f"  train: {t['steps']} steps, {t['tokens_per_s']:,.0f} tokens/s, "
                     f"peak {t['peak_memory_gib']:.2f} GiB")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--metrics", type=Path, required=True)
    ap.add_argument("--part", action="append", default=[], help="name=status:seconds")
    a = ap.parse_args(argv)
    parts = _parts(a.part)
    summary = {
        "arch": a.arch,
        "device": _device(),
        "parts": parts,
        "seconds": sum(p["seconds"] for p in parts.values()),
        "gpu_suite": suite_counts(a.junit),
        "kernels": kernel_rows(a.bench),
        "train": train_numbers(a.metrics),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(_report(summary))
    print(f"summary: {a.out}")
    return 0 if parts and all(p["status"] == "passed" for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
