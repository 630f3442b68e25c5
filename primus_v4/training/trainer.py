"""The SFT loop: packs -> model -> token-normalized loss -> AdamW, one optimizer step at a time.

Per step: the rows of the global batch (BatchSource), their token counts summed over
micro-batches and data-parallel ranks (the loss denominator, taken up front), one forward and
backward per micro-batch with that micro-batch's share of the global token-mean loss (through
the 1F1B pipeline schedule when pp > 1), fp32 gradients reduce-scattered over each parameter's
replicas (training.optim.zero: ZeRO-1 with fp32 masters), clip by the global norm, a finite
check, the optimizer step, one metrics row.

Where the parallel pieces plug in (identities in one process):
  * `init_runtime`   process groups from the launcher env (torchrun: gloo / RCCL).
  * `_parallelize`   pipeline stage + schedule, expert shards (training/build.py, the spec).
  * `model_inputs`   CP slicing of the pack (rows, global cu_seqlens, MTP streams).
  * `Runtime.ctx`     the rank's ParallelContext: token-count and gradient reductions.
  * `_checkpoints`   save / resume (primus_v4.training.checkpoint.store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from primus_v4.checkpoint_formats.read_record import ReadRecord, recording_reads
from primus_v4.config import ResolvedRun, write_resolved
from primus_v4.config.resolve import check_pretrained, tokenizer_of, train_steps, vision_held
from primus_v4.data.pipeline import build_or_load
from primus_v4.data.stats_table import summary_table
from primus_v4.data.thd import ThdBatch
from primus_v4.data.tokenizer import resolve_tokenizer_dir
from primus_v4.errors import DataError, PrimusError
from primus_v4.log import get_logger
from primus_v4.models import spec_of
from primus_v4.training import run_dirs
from primus_v4.training.batches import BatchSource, Corpus
from primus_v4.training.build import assemble, meta_model
from primus_v4.training.checkpoint import release_reads
from primus_v4.training.checkpoint.lifecycle import RunCheckpoints, check_steps
from primus_v4.training.checkpoint.store import load_latest
from primus_v4.training.evaluation import Evaluator
from primus_v4.training.loss import StepLoss, reduce_counts
from primus_v4.training.metrics.history import keep_rows_through, read_history
from primus_v4.training.metrics.trackers import open_tracker
from primus_v4.training.metrics.writer import (
    MetricsWriter,
    StepMetrics,
    loss_window,
    make_step_metrics,
    plot_loss,
    summarize,
)
from primus_v4.training.optim.zero import build_sharded_optimizer
from primus_v4.training.preemption import stop_on_signals
from primus_v4.training.runtime import Runtime, init_runtime

log = get_logger(__name__)


def build_corpus(run: ResolvedRun) -> Corpus:
    """Pack the corpus through the node-local cache (or load the cached packs)."""
    corpus = build_or_load(run.data)
    log.info("corpus %s:\n%s", run.data.describe(), summary_table(corpus.stats))
    check_images(corpus, run, run.data.describe())
    return corpus


def check_images(corpus: Corpus, run: ResolvedRun, where: str, *, training: bool = True) -> None:
    """Packs with images train on one process or data parallel, from a release with a vision
    tower (its image encoder fills the spans): anything else is one line, before the model is
    built."""
    images = corpus.stats.get("images", 0)
    held, asked = vision_held(run.cfg)
    if not images and held != "frozen" and training:
        raise DataError(f"data {where}: its packs hold no images, so {asked} has nothing to "
                        "train; leave the image encoder frozen")  # fmt: skip
    if not images:
        return
    cfg, what = run.cfg, f"data {where}: its packs hold {images} images"
    spec = spec_of(run.model)
    if spec.attach_images is None:
        raise DataError(f"{what}, and {spec.title} has no vision tower")
    if cfg.model.pretrained is None:
        raise DataError(f"{what}: set model.pretrained to the release whose vision tower (its "
                        "image encoder) reads them")  # fmt: skip
    sizes = {"parallel.pp": cfg.parallel.pp, "parallel.cp": cfg.parallel.cp}
    over = [f"{k}={v}" for k, v in sizes.items() if v > 1]
    if over:
        raise DataError(f"{what}; rows with images train on one process or data parallel for "
                        f"now: {', '.join(over)} must be 1 (or drop the image rows)")  # fmt: skip


def build_model(run: ResolvedRun) -> nn.Module:
    """The whole model on the meta device: shapes only, nothing allocated or drawn. The rank
    keeps its stage and expert shard and materializes only those under `train.seed`
    (`Trainer._parallelize`; same seed -> same weights in every layout)."""
    torch.manual_seed(run.cfg.train.seed)  # the run's RNG state; weights draw from their own
    return meta_model(run.model, run.cfg.model)


def build_optimizer(
    run: ResolvedRun, model: nn.Module, ctx: Any = None, total_steps: int | None = None
) -> tuple[Any, Any]:
    """AdamW on fp32 master weights, state sharded over each parameter's data-parallel replicas
    (primus_v4.training.optim.zero), with linear warmup then cosine decay to min_lr over
    `total_steps` (default train.steps)."""
    return build_sharded_optimizer(run, model, ctx, total_steps=total_steps)


@contextmanager
def _logging_around(bar: Any) -> Iterator[None]:
    """Route the package's log lines through tqdm.write while the bar is shown, keeping the
    handlers' filters (they stamp the rank into every record)."""
    if bar.disable:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    package = logging.getLogger("primus_v4")
    filters = [f for h in package.handlers for f in h.filters]
    with logging_redirect_tqdm(loggers=[package]):
        for handler in package.handlers:
            for f in filters:
                handler.addFilter(f)
        yield


def _log_attempt(start_step: int, root: Path | None) -> None:
    """After a restart by torchrun's elastic agent (it counts its restarts of the worker group),
    say which one and the step it resumed: the newest intact checkpoint's, or 0 without one."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts == 0:
        return
    where = (
        f"resumed at step {start_step} from {root}"
        if start_step
        else "no checkpoint to resume: starting again at step 0"
    )
    log.warning("elastic restart %d (TORCHELASTIC_RESTART_COUNT): %s", restarts, where)


@dataclass
class TrainResult:
    rows: list[StepMetrics]
    summary: dict[str, Any]
    output_dir: Path
    skipped_steps: int = 0
    artifacts: dict[str, Path] = field(default_factory=dict)
    stopped_at: int | None = None
    """The step after which a preemption signal stopped the run (None: it ran to the end)."""
    stop_signal: str | None = None
    saved: Path | None = None
    """The checkpoint written when the run stopped early (None without checkpoint.dir)."""
    signum: int | None = None
    """The number of the signal that stopped the run early."""


class NonFiniteError(PrimusError):
    """Loss or gradient norm became NaN/inf with train.nan_policy=error."""


class Trainer:
    """One run. `corpus` and `model` can be passed in (tests); otherwise they are built.

    `evaluate_only` (`primus-v4 eval`): the model built as the run builds it (the same
    assembly, release reads, image encoder, CP splitter and quant-aware context) with its
    evaluator on the evaluation corpus, and nothing else: no training corpus, optimizer,
    scheduler, step hooks or checkpoint manager; it reads no checkpoint dir and records no
    release reads. `load_weights` then puts a checkpoint's model weights in."""

    def __init__(
        self,
        run: ResolvedRun,
        *,
        runtime: Runtime | None = None,
        corpus: Corpus | None = None,
        model: nn.Module | None = None,
        eval_corpus: Corpus | None = None,
        evaluate_only: bool = False,
    ) -> None:
        self.run = run
        self.cfg = run.cfg
        self.spec = spec_of(run.model)
        self.runtime = runtime or init_runtime(
            run.sizes, collective_timeout_s=self.cfg.parallel.collective_timeout_s
        )
        # Which checkpoint this run continues, decided (and verified) before any work: a refused
        # resume costs seconds and writes nothing.
        self.checkpoints = None if evaluate_only else self._checkpoints()
        self.resume_from = self.checkpoints.resume_point() if self.checkpoints else None
        check_pretrained(self.cfg, run.model)  # the release is read, resumed or not: all there?
        self.total_steps = 0  # an evaluation alone takes no step
        if not evaluate_only:
            self._training_corpus(corpus)
        model = model if model is not None else build_model(run)
        self._release_reads: ReadRecord | None = None
        self.model = self._parallelize(model)
        self._images_attached = False
        if not evaluate_only:
            self._attach_images(self.corpus)
        # the evaluation rows' pictures need the encoder too: read before the record is checked
        self.evaluator = self._evaluator(eval_corpus)
        self._check_release_reads()
        self.quant = self._quant_aware()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.step_hooks: list[Any] = []
        if not evaluate_only:
            self._training_parts()
        self.mtp_depths = int(run.model.mtp_num_layers or 0)
        self.cp = self._context_parallel()
        self.mtp_scale = float(run.model.mtp_loss_scaling_factor or 0.0)
        self.start_step = 0
        self.skipped_steps = 0
        self.stopped: tuple[int, str, Path | None, int | None] | None = None

    def _training_corpus(self, corpus: Corpus | None) -> None:
        """The packed training corpus, its batches and the run's step count (checked against
        the resumed checkpoint's step)."""
        self.corpus = corpus if corpus is not None else build_corpus(self.run)
        self.source = BatchSource(
            self.corpus,
            layout=self.cfg.data.layout,
            global_batch_size=self.cfg.train.global_batch_size,
            seed=self.cfg.train.seed,
            shuffle=self.cfg.train.shuffle,
        )
        self.total_steps = self._total_steps()
        if self.resume_from is not None:
            check_steps(self.resume_from, self.total_steps)

    def _training_parts(self) -> None:
        """The optimizer (fp32 masters seeded from the draw), its schedule and the step hooks."""
        self.optimizer, self.scheduler = build_optimizer(
            self.run, self.model, self.runtime.ctx, self.total_steps
        )
        self._seed_masters()
        self.step_hooks = self.spec.step_hooks(
            [self.model], self.cfg.model, group=self.runtime.ctx.dp_cp_group
        )

    def load_weights(self, checkpoint: Path) -> int:
        """The model weights of training checkpoint `checkpoint` (verified by the caller), loaded
        as a resume loads them (a LoRA run's adapters or a drafter over the base read from
        model.pretrained or drawn from the seed); no optimizer, schedule or data state. Returns
        its step."""
        step = load_latest(checkpoint.parent, path=checkpoint, model=self.model)
        assert step is not None  # a path is given: it is loaded or the load raises
        return step

    def _evaluator(self, corpus: Corpus | None) -> Any:
        """Held-out loss (primus_v4.training.evaluation); None without evaluation data."""
        if corpus is None and self.run.eval_data is None:
            return None
        if corpus is None:
            corpus = build_or_load(self.run.eval_data)
            check_images(corpus, self.run, self.run.eval_data.describe(), training=False)
        self._attach_images(corpus)
        return Evaluator(
            corpus,
            layout=self.cfg.data.layout,
            interval=self.cfg.train.eval_interval,
            total_steps=self.total_steps,
        )

    def _total_steps(self) -> int:
        """train.steps, or the steps that train.epochs passes over this corpus take (logged)."""
        steps = train_steps(self.cfg, self.source.rows_per_epoch)
        if self.cfg.train.epochs is not None:
            log.info(
                "train.epochs=%g: %d steps (%d rows per epoch, global batch %d)",
                self.cfg.train.epochs,
                steps,
                self.source.rows_per_epoch,
                self.cfg.train.global_batch_size,
            )
        return steps

    def _parallelize(self, model: nn.Module) -> nn.Module:
        """This rank's pipeline stage with its expert shards (one process: unchanged), the base
        kept as released and adapters added as `model.lora` asks (training/build.py)."""
        parallel = {
            "ctx": self.runtime.ctx,
            "pp_layout": self.cfg.parallel.pp_layout,
            "packed": self.cfg.packed,
            "device": self.runtime.device,
        }
        built = assemble(
            self.run.model,
            self.cfg.model,
            seed=self.cfg.train.seed,
            model=model,
            parallel=parallel,
            weights=self._pretrained_weights(),
        )
        # Random init: the weights were drawn from train.seed while materializing.
        self._drawn = built.drawn
        if built.drawn and self.spec.use_tokenizer is not None:
            # As the export of this run will be read: through its tokenizer (the run's).
            self.spec.use_tokenizer(built.model, resolve_tokenizer_dir(tokenizer_of(self.cfg)))
        self.pipeline: Any = built.pipeline
        return built.model

    def _attach_images(self, corpus: Corpus) -> None:
        """The release's image encoder on the model, once, when `corpus` holds images
        (`check_images` allowed them: a family with a vision tower, a release); its reads go
        into the record of the release's reads, as the text model's do."""
        if not corpus.stats.get("images") or self._images_attached:
            return
        assert self.spec.attach_images is not None and self.cfg.model.pretrained is not None
        record = self._release_reads
        with contextlib.nullcontext() if record is None else recording_reads(record):
            how = self.spec.attach_images(self.model, self.cfg.model.pretrained,
                                          device=self.runtime.device)  # fmt: skip
        self._images_attached = True
        log.info("image encoder of %s: %s", self.cfg.model.pretrained, how)

    def _quant_aware(self) -> Any:
        """train.quant_aware=release: the rank's weights the release stores FP8 / FP4, each
        with its release rounding (models/common/quant_aware.py); None otherwise."""
        if self.cfg.train.quant_aware == "none":
            return None
        quant = self.spec.release.release_rounding(self.model, self.run.model)
        log.info("train.quant_aware=release: %d weights (%d values) and %d adapted weights "
                 "(merged) used as the release stores them, gradients straight through",
                 len(quant.weights), quant.numel(), len(quant) - len(quant.weights))  # fmt: skip
        return quant

    def quantized(self) -> Any:
        """The context of a step's (and an evaluation's) forwards and backwards: the weights as
        the release stores them under train.quant_aware=release, else as they are."""
        return self.quant.applied() if self.quant is not None else contextlib.nullcontext()

    def _seed_masters(self) -> None:
        """A random-init run in a low-precision dtype: the fp32 masters start from the float32
        draws themselves, not from their bf16 rounding, so the masters begin where a float32 run
        begins (a resumed checkpoint overwrites them later like every other state)."""
        initial = getattr(self.model, "initial_values", None)
        if not self._drawn or initial is None or self.cfg.model.dtype == "float32":
            return
        if self.cfg.model.lora.rank:  # the drawn base is frozen: it has no masters
            return
        n = self.optimizer.seed_masters(initial(self.cfg.train.seed))
        log.info("fp32 masters: %d values from the float32 init (not its bf16 rounding)", n)

    def _pretrained_weights(self) -> Any:
        """model.pretrained: a loader of this rank's slice, its reads recorded. A resumed run
        reads the release too: its checkpoint holds the trained weights, not what stays as
        released (frozen Engram tables, the token map, a kept or frozen base), and then
        replaces every weight it holds."""
        directory = self.cfg.model.pretrained
        if directory is None:
            return None
        if self.resume_from is not None:
            log.info(
                "resuming %s: model.pretrained=%s gives what the checkpoint does not hold "
                "(checked against the release the run started from); the checkpoint's weights "
                "then replace the trained ones",
                self.resume_from,
                directory,
            )
        loader = self.spec.release.rank_loader(directory, progress=self._bars())

        def load(model: nn.Module) -> None:
            with recording_reads() as record:
                loader(model)
            self._release_reads = record

        return load

    def _check_release_reads(self) -> None:
        """A first start records what it read of model.pretrained (the text model, a drafter
        it trains, the image encoder) and digests the rest whole (what an export carries); a
        resume reads and digests the same way and is checked against that record (the one its
        checkpoint carries; training/checkpoint/release_reads.py), and every step saved carries
        it on. Called once every read of the release is done."""
        record, root = self._release_reads, self.checkpoints.root if self.checkpoints else None
        if record is None or root is None:
            return
        release = self.cfg.model.pretrained
        with self.spec.release.open(release) as reader:
            release_reads.carry_unread(record, reader, rank=self.runtime.rank,
                                       world=self.run.sizes.world)  # fmt: skip
        rank, world = self.runtime.rank, self.run.sizes.world
        if self.resume_from is not None:
            release_reads.verify(root, release=release, record=record, step=self.resume_from)
        else:
            release_reads.save(root, rank=rank, world=world, release=release, record=record)
        # every step the run saves carries the records: a step copied elsewhere is checked alike
        self.checkpoints.rank_files.update(
            release_reads.step_files(root, rank=rank, world=world, step=self.resume_from)
        )

    def _context_parallel(self) -> Any:
        """The one path from a pack to model inputs, for every CP size: this rank's contiguous
        rows of each pack (all of them at cp = 1), global cu_seqlens, globally shifted MTP
        streams, and this rank's share of the token counts."""
        return self.spec.cp_splitter(
            self.runtime.ctx.cp,
            self.run.model,
            packed=self.cfg.packed,
            device=self.runtime.device,
            seq_length=self.cfg.data.seq_length,
        )

    def token_counts(self, rows: list[ThdBatch]) -> Any:
        """This rank's token counts of a step's rows, summed over the count group."""
        return reduce_counts(self.cp.token_counts(rows), self.runtime.count_group)

    def model_inputs(self, row: ThdBatch) -> dict[str, Any]:
        """Keyword inputs of one row ([1, T] this rank's rows); THD passes packing metadata, BSHD
        does not (the padded row is one causal sequence whose trailing padding no real token
        can see)."""
        return self.cp.model_inputs(row)

    def forward_backward(self, rows: list[ThdBatch]) -> StepLoss:
        """Accumulate gradients of the step's global token-mean loss over this rank's rows."""
        counts = self.token_counts(rows)
        step_loss = StepLoss(counts, mtp_scale=self.mtp_scale)
        self.optimizer.begin(len(rows))  # buckets reduce as the last micro-batch's backward ends
        with self.quantized():
            if self.pipeline is not None:
                self.pipeline.run(
                    [self.model_inputs(row) for row in rows],
                    step_loss,
                    samples=[row.num_samples for row in rows],
                )
            else:
                for row in rows:
                    out = self.model(**self.model_inputs(row))
                    step_loss.objective(out, samples=row.num_samples).backward()
        # Every trainable parameter has an fp32 gradient (zeros when no token reached it, e.g.
        # an expert nobody routed to), summed over its replicas into this rank's shard.
        self.optimizer.reduce_gradients()
        return step_loss

    def _clip(self) -> float:
        """Global grad norm before clipping (clip_grad=0: measured, not clipped)."""
        # Not torch's clip_grad_norm_: gradients are sharded over replicas, split over stages and
        # expert shards, and its float32 norm of the [vocab, hidden] embedding gradient is off by
        # ~1e-4 relative, more than the parity tests allow between layouts (float64 here).
        # A part the model trains beside itself (a drafter) is clipped on its own norm:
        # `clip_apart` {parameter name prefix: the metric stem of its norm}.
        apart = tuple(getattr(self.model, "clip_apart", {}))
        return self.optimizer.clip_grad_norm(self.cfg.train.clip_grad or math.inf, apart=apart)

    def train_step(self, step: int) -> StepMetrics:
        start = time.perf_counter()
        rows = self.source.rows(step, dp_rank=self.runtime.dp_rank, dp_size=self.runtime.dp_size)
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = self.forward_backward(rows)
        grad_norm = self._clip()
        lr = float(self.optimizer.param_groups[0]["lr"])
        losses = step_loss.reported(group=self.runtime.count_group)
        stems = getattr(self.model, "clip_apart", {})
        for prefix, norm in getattr(self.optimizer, "apart_norms", {}).items():
            losses[f"{stems[prefix]}_grad_norm"] = norm
        scalars = [v for v in losses.values() if not isinstance(v, list)]
        finite = all(math.isfinite(v) for v in (*scalars, grad_norm))
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        elif self.cfg.train.nan_policy == "skip":
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        for hook in self.step_hooks:
            hook.step(apply=finite)
        c = step_loss.counts
        return make_step_metrics(
            step=step + 1,
            losses=losses,
            grad_norm=grad_norm,
            lr=lr,
            tokens=(c.total, c.real, c.supervised),
            seconds=time.perf_counter() - start,
        )

    def _checkpoints(self) -> Any:
        """Interval saves, keep_last and resume rules (None when checkpoint.dir is unset)."""
        if self.cfg.checkpoint.dir is None:
            return None
        return RunCheckpoints(self.cfg, world=self.run.sizes.world, model=self.run.model)

    def _state(self) -> dict[str, Any]:
        # The data position is the step itself: BatchSource is a pure function of (seed, step).
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def train(self) -> TrainResult:
        out_dir = Path(self.cfg.output.dir)
        main = self.runtime.is_main
        first = run_dirs.FirstStep(out_dir) if main else None
        rows: list[StepMetrics] = []
        writer: MetricsWriter | None = None
        try:
            if main:  # each checkpoint stores its own config (what export and resume read)
                write_resolved(self.cfg, out_dir)
            if self.checkpoints is not None:
                self.start_step = self.checkpoints.load_latest(**self._state()) or 0
            _log_attempt(self.start_step, self.checkpoints.root if self.checkpoints else None)
            if main and self.start_step > 0:  # rows after the resumed step are redone: drop them
                keep_rows_through(out_dir / "metrics.jsonl", self.start_step)
            if main:
                writer = MetricsWriter(
                    out_dir / "metrics.jsonl",
                    append=self.start_step > 0,
                    tracker=open_tracker(self.cfg, out_dir, resume=self.start_step > 0),
                )
            self._loop(rows, writer)
            result = self._finish(rows, out_dir)
            if writer is not None and writer.tracker is not None:
                artifacts = [
                    result.artifacts[k] for k in ("plot", "metrics") if k in result.artifacts
                ]
                writer.tracker.log_artifacts(artifacts)
        except BaseException:
            if writer is not None:  # the failure is what to report, not a failing close
                writer, closing = None, writer
                with contextlib.suppress(Exception):
                    closing.close()
            if first is not None and not rows:  # nothing recorded: leave output.dir as found
                first.undo()
            raise
        finally:
            if writer is not None:
                writer.close()
        return result

    def _bars(self) -> bool:
        """Progress bars on rank 0 when output.progress_bar and stderr is a terminal (a log
        file gets the step lines alone, not the bar's redraws)."""
        return self.runtime.is_main and self.cfg.output.progress_bar and sys.stderr.isatty()

    def _loop(self, rows: list[StepMetrics], writer: MetricsWriter | None) -> None:
        from tqdm import tqdm

        steps = self.total_steps
        show = self._bars()
        bar = tqdm(
            total=steps, initial=self.start_step, disable=not show, unit="step", dynamic_ncols=True
        )
        self.model.train()
        with bar, _logging_around(bar), stop_on_signals(self.runtime.device) as stop:
            for step in range(self.start_step, steps):
                metrics = self.train_step(step)
                if self.evaluator is not None and self.evaluator.due(step + 1):
                    metrics = dataclasses.replace(metrics, **self.evaluator.run(self))
                rows.append(metrics)
                if writer is not None:
                    writer.write(metrics)
                log.info(metrics.log_line(steps))
                bar.set_postfix(loss=f"{metrics.loss:.3f}", refresh=False)
                bar.update(1)
                if metrics.nan:
                    self._on_non_finite(metrics)
                if self.checkpoints is not None:
                    self.checkpoints.maybe_save(step + 1, final=step + 1 == steps, **self._state())
                if step + 1 < steps and stop.agreed():
                    self._stop_early(step + 1, stop.signal_name or "a signal", stop.signum)
                    break

    def _stop_early(self, step: int, signal_name: str, signum: int | None) -> None:
        """Preemption: save now (when checkpoints are on) so a rerun resumes from `step`."""
        saved = None
        if self.checkpoints is not None:
            saved = self.checkpoints.maybe_save(step, final=True, **self._state())
            saved = saved or self.checkpoints.root / f"step_{step:08d}"  # saved by this step
        self.stopped = (step, signal_name, saved, signum)
        log.warning("stopped after step %d on %s", step, signal_name)

    def _on_non_finite(self, metrics: StepMetrics) -> None:
        if self.cfg.train.nan_policy == "skip":
            log.warning(
                "step %d: non-finite loss or gradient; step skipped (%d so far)",
                metrics.step,
                self.skipped_steps,
            )
            return
        raise NonFiniteError(
            f"step {metrics.step}: non-finite loss={metrics.loss} or grad_norm="
            f"{metrics.grad_norm}; metrics up to this step are in "
            f"{Path(self.cfg.output.dir) / 'metrics.jsonl'}. Lower train.lr, check the data, or "
            "set train.nan_policy=skip to skip such steps"
        )

    def _finish(self, rows: list[StepMetrics], out_dir: Path) -> TrainResult:
        # The summary and plot cover the whole run, resumed parts included (metrics.jsonl).
        history = read_history(out_dir / "metrics.jsonl") if self.runtime.is_main else rows
        summary = summarize(history, skipped=self.skipped_steps)
        result = TrainResult(rows, summary, out_dir, skipped_steps=self.skipped_steps)
        if self.stopped is not None:
            result.stopped_at, result.stop_signal, result.saved, result.signum = self.stopped
        if self.runtime.is_main:
            result.artifacts["metrics"] = out_dir / "metrics.jsonl"
            result.artifacts["config"] = out_dir / "config.yaml"
            if self.cfg.output.plot and history:
                result.artifacts["plot"] = plot_loss(history, out_dir / "loss.png")
            k = loss_window(len(history))
            log.info(
                "done: %d steps, loss first-%d %.4f -> last-%d %.4f, %.1f s",
                summary["steps"],
                k,
                summary[f"loss_first_{k}"],
                k,
                summary[f"loss_last_{k}"],
                summary["total_seconds"],
            )
        return result
