"""Per-step metrics: metrics.jsonl rows (and the tracker's), the log line, the end-of-run summary
table, loss.png."""

from __future__ import annotations

import io
import json
import math
import resource
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from primus_v4.durable import open_own, write_durable
from primus_v4.training.metrics.trackers import Tracker
from primus_v4.training.run_dirs import refuse_link


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One optimizer step. Token numbers are over the global batch (all ranks)."""

    step: int
    loss: float
    mtp_loss: float
    aux_loss: float
    grad_norm: float
    lr: float
    total_tokens: int
    real_tokens: int
    supervised_tokens: int
    tokens_per_s: float
    real_tokens_per_s: float
    supervised_tokens_per_s: float
    step_seconds: float
    peak_memory_bytes: int
    nan: bool
    eval_loss: float | None = None
    """Token-mean loss of the whole evaluation corpus after this step (None: not evaluated)."""
    eval_mtp_loss: float | None = None
    eval_draft_loss: float | None = None
    """A drafter in training: its loss per target slot over the evaluation corpus."""
    eval_draft_tau: float | None = None
    """... its expected accepted draft tokens per block there."""
    eval_draft_accept: list[float] | None = None
    """... and its per-slot greedy acceptance there."""
    draft_loss: float | None = None
    """A drafter in training: its objective per draft target slot (ce + kl + confidence terms,
    before its loss weight); None when no drafter trains."""
    draft_ce: float | None = None
    """Its cross entropy to the data token per target slot."""
    draft_kl: float | None = None
    """Its KL(backbone || draft) per target slot."""
    draft_confidence: float | None = None
    """Its confidence head's binary cross entropy per target slot."""
    draft_tau: float | None = None
    """Expected accepted draft tokens per block (greedy, teacher forced), a mean over anchors."""
    draft_accept: list[float] | None = None
    """Per block slot: the share of anchors whose draft is accepted through that slot."""
    draft_grad_norm: float | None = None
    """A drafter trained beside the model: its own gradient norm (clipped apart)."""

    def log_line(self, total_steps: int) -> str:
        evaluated = (
            f" | eval loss {self.eval_loss:.4f} mtp {self.eval_mtp_loss:.4f}"
            if self.eval_loss is not None and self.eval_mtp_loss is not None
            else ""
        )
        if evaluated and self.eval_draft_loss is not None:
            evaluated += f" draft {self.eval_draft_loss:.4f} tau {self.eval_draft_tau:.2f}"
        if self.draft_loss is not None:
            accept = " ".join(f"{a:.2f}" for a in self.draft_accept or [])
            evaluated = (
                f" | draft {self.draft_loss:.4f} (ce {self.draft_ce:.4f} kl {self.draft_kl:.4f})"
                f" tau {self.draft_tau:.2f} accept [{accept}]" + evaluated
            )
        return (
            f"step {self.step}/{total_steps} loss {self.loss:.4f} mtp {self.mtp_loss:.4f} "
            f"aux {self.aux_loss:.2e} gnorm {self.grad_norm:.3f} lr {self.lr:.2e} "
            f"tok/s {self.tokens_per_s:,.0f} (real {self.real_tokens_per_s:,.0f}, "
            f"sup {self.supervised_tokens_per_s:,.0f}) {self.step_seconds:.2f}s"
            + (" NON-FINITE" if self.nan else "")
            + evaluated
        )


def make_step_metrics(
    *,
    step: int,
    losses: dict[str, float],
    grad_norm: float,
    lr: float,
    tokens: tuple[int, int, int],
    seconds: float,
) -> StepMetrics:
    """Throughput from (total, real, supervised) tokens and the step's wall time."""
    total, real, supervised = tokens
    rate = 1.0 / max(seconds, 1e-9)
    values = [losses["loss"], losses["mtp_loss"], losses["aux_loss"], grad_norm]
    draft = {k: v for k, v in losses.items() if k.startswith("draft_")}
    values += [v for k, v in draft.items() if k != "draft_accept"]
    return StepMetrics(
        **draft,
        step=step,
        loss=losses["loss"],
        mtp_loss=losses["mtp_loss"],
        aux_loss=losses["aux_loss"],
        grad_norm=grad_norm,
        lr=lr,
        total_tokens=total,
        real_tokens=real,
        supervised_tokens=supervised,
        tokens_per_s=total * rate,
        real_tokens_per_s=real * rate,
        supervised_tokens_per_s=supervised * rate,
        step_seconds=seconds,
        peak_memory_bytes=peak_memory_bytes(),
        nan=not all(math.isfinite(v) for v in values),
    )


def peak_memory_bytes() -> int:
    """Accelerator peak allocation when there is one, else this process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the row parseable by strict readers
    return value


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl, flushed so a crash keeps every row."""

    def __init__(
        self, path: str | Path, *, append: bool = False, tracker: Tracker | None = None
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_link(self.path, "output.dir")
        self._file: IO[str] = open_own(self.path, append=append)
        self.rows: list[StepMetrics] = []
        self.tracker = tracker  # gets the same rows (output.tracker); closed with the writer

    def write(self, metrics: StepMetrics) -> None:
        row = {k: _json_safe(v) for k, v in asdict(metrics).items()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.rows.append(metrics)
        if self.tracker is not None:
            self.tracker.log_step(metrics)

    def close(self) -> None:
        self._file.close()
        if self.tracker is not None:
            self.tracker.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def loss_window(steps: int) -> int:
    """Steps in each first/last loss mean: 5, fewer under 10 steps so the two never overlap."""
    return max(1, min(5, steps // 2))


def summarize(
    rows: Sequence[StepMetrics], *, window: int | None = None, skipped: int = 0
) -> dict[str, Any]:
    """First/last-window mean loss (window: `loss_window(len(rows))` unless given) and mean
    throughput (the first step, which warms up allocators and caches, is left out of the
    throughput means when there are others)."""
    window = window if window is not None else loss_window(len(rows))
    finite = [r for r in rows if not r.nan]
    losses = [r.loss for r in finite]
    timed = finite[1:] if len(finite) > 1 else finite
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    first, last = mean(losses[:window]), mean(losses[-window:])
    return {
        "steps": len(rows),
        "skipped_steps": skipped,
        f"loss_first_{window}": first,
        f"loss_last_{window}": last,
        "loss_drop": first - last,
        "final_loss": losses[-1] if losses else float("nan"),
        "mean_step_seconds": mean([r.step_seconds for r in timed]),
        "tokens_per_s": mean([r.tokens_per_s for r in timed]),
        "real_tokens_per_s": mean([r.real_tokens_per_s for r in timed]),
        "supervised_tokens_per_s": mean([r.supervised_tokens_per_s for r in timed]),
        "real_fraction": mean([r.real_tokens / max(r.total_tokens, 1) for r in finite]),
        "supervised_fraction": mean([r.supervised_tokens / max(r.total_tokens, 1) for r in finite]),
        "peak_memory_bytes": max((r.peak_memory_bytes for r in rows), default=0),
        "total_seconds": sum(r.step_seconds for r in rows),
        **_last_eval(rows),
        **_draft_window(finite, window),
    }


def _draft_window(rows: Sequence[StepMetrics], window: int) -> dict[str, Any]:
    """A drafter in training: its loss and tau over the first and last `window` steps."""
    drafted = [r for r in rows if r.draft_loss is not None]
    if not drafted:
        return {}
    mean = lambda xs: sum(xs) / len(xs)
    out: dict[str, Any] = {}
    for name in ("draft_loss", "draft_tau"):
        values = [getattr(r, name) for r in drafted]
        out[f"{name}_first_{window}"] = mean(values[:window])
        out[f"{name}_last_{window}"] = mean(values[-window:])
    return out


def _last_eval(rows: Sequence[StepMetrics]) -> dict[str, Any]:
    evaluated = [r for r in rows if r.eval_loss is not None]
    if not evaluated:
        return {}
    last = evaluated[-1]
    out = {"eval_step": last.step, "eval_loss": last.eval_loss,
           "eval_mtp_loss": last.eval_mtp_loss}  # fmt: skip
    if last.eval_draft_loss is not None:
        out.update(eval_draft_loss=last.eval_draft_loss, eval_draft_tau=last.eval_draft_tau)
    return out


def format_table(summary: dict[str, Any], title: str = "run summary") -> str:
    """Two aligned columns: name and value."""
    width = max(len(k) for k in summary)
    lines = [title, "-" * (width + 18)]
    for key, value in summary.items():
        if isinstance(value, float):
            text = f"{value:,.4f}" if abs(value) < 100 else f"{value:,.1f}"
        elif key.endswith("bytes"):
            text = f"{value / 2**20:,.1f} MiB"
        else:
            text = str(value)
        lines.append(f"{key:<{width}}  {text:>14}")
    return "\n".join(lines)


def plot_loss(rows: Sequence[StepMetrics], path: str | Path) -> Path:
    """loss.png: loss (and MTP loss), gradient norm and learning rate vs step, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in rows]
    fig, (ax_loss, ax_norm, ax_lr) = plt.subplots(1, 3, figsize=(14, 4))
    ax_loss.plot(steps, [r.loss for r in rows], label="loss", marker=".")
    if any(r.mtp_loss for r in rows):
        ax_loss.plot(steps, [r.mtp_loss for r in rows], label="mtp loss", alpha=0.7)
    evaluated = [r for r in rows if r.eval_loss is not None]
    if evaluated:
        ax_loss.plot([r.step for r in evaluated], [r.eval_loss for r in evaluated],
                     label="eval loss", marker="o", linestyle="--")  # fmt: skip
    drafted = [r for r in rows if r.draft_loss is not None]
    if drafted:
        ax_loss.plot([r.step for r in drafted], [r.draft_loss for r in drafted],
                     label="draft loss", alpha=0.7)  # fmt: skip
        ax_tau = ax_loss.twinx()
        ax_tau.plot([r.step for r in drafted], [r.draft_tau for r in drafted],
                    color="tab:purple", linestyle=":", label="draft tau")  # fmt: skip
        ax_tau.set_ylabel("accepted draft tokens per block (tau)")
        ax_tau.legend(loc="center right")
    ax_loss.set(xlabel="step", ylabel="token-mean CE", title="loss")
    ax_loss.legend()
    ax_norm.plot(steps, [r.grad_norm for r in rows], color="tab:red", marker=".")
    ax_norm.set(xlabel="step", ylabel="global grad norm (before clip)", title="grad norm")
    ax_lr.plot(steps, [r.lr for r in rows], color="tab:green", marker=".")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="lr")
    fig.tight_layout()
    path = Path(path)
    image = io.BytesIO()
    fig.savefig(image, dpi=100, format="png")
    plt.close(fig)
    write_durable(path, image.getvalue())  # replaces a link planted at loss.png, never follows it
    return path
