"""Evaluation: token-mean loss and MTP loss of the whole evaluation corpus, forward only (and a
drafter's loss, tau and per-slot acceptance when one trains).

Every evaluation row (a pack for thd, a sample for bshd) is seen exactly once: data-parallel
rank r takes rows r, r + dp, ...; CP ranks of one replica split each row like in training. The
denominators are the supervised-token counts of the whole corpus summed over DP x CP before any
division (the training loss's rule), so the number is the same under every layout. Ranks whose
share is one row short run a forward on row 0 and discard it, so every rank runs the same
number of forwards (expert-parallel all-to-alls stay matched). Under pipeline parallelism each
row runs forward through the stages one at a time (PipelineRunner.forward_only) and the last
stage's sums are summed over the pipeline, so every rank reports the same numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from primus_v4.data.thd import ThdBatch, TokenCounts
from primus_v4.training.batches import Corpus
from primus_v4.training.loss import StepLoss


class Evaluator:
    """Runs the evaluation of one trainer's model on `corpus`."""

    def __init__(self, corpus: Corpus, *, layout: str, interval: int, total_steps: int) -> None:
        self.corpus = corpus
        self.layout = layout
        self.interval = interval
        self.total_steps = total_steps
        self.num_rows = len(corpus) if layout == "thd" else corpus.num_samples
        if self.num_rows == 0:
            raise ValueError("the evaluation corpus has no rows")
        self.counts: TokenCounts | None = None
        """The token counts of the last `run` (the whole corpus: summed over DP x CP)."""

    def due(self, step: int) -> bool:
        """After optimizer step `step` (1-based): every `interval` steps and after the last."""
        return step == self.total_steps or (self.interval > 0 and step % self.interval == 0)

    def _row(self, i: int) -> ThdBatch:
        return self.corpus.thd_batch(i) if self.layout == "thd" else self.corpus.bshd_batch(i)

    def _share(self, dp_rank: int, dp_size: int) -> tuple[list[ThdBatch], int]:
        """This replica's rows and how many forwards every rank runs."""
        mine = [self._row(i) for i in range(dp_rank, self.num_rows, dp_size)]
        return mine, self.forwards(dp_size)

    def forwards(self, dp_size: int) -> int:
        """How many forwards every rank runs in one evaluation (a progress bar's total)."""
        return math.ceil(self.num_rows / dp_size)

    def _forwards(
        self,
        trainer: Any,
        rows: list[ThdBatch],
        forwards: int,
        step_loss: Any,
        progress: Callable[[int], None] | None,
    ) -> None:
        for k in range(forwards):
            row = rows[k] if k < len(rows) else self._row(0)
            counted = k < len(rows)  # the padding forward of a short share is not counted
            inputs = trainer.model_inputs(row)
            if trainer.pipeline is not None:
                trainer.pipeline.forward_only(
                    inputs, step_loss if counted else None, samples=row.num_samples
                )
            else:
                out = trainer.model(**inputs)
                if counted:
                    step_loss.objective(out, samples=row.num_samples)
            if progress is not None:
                progress(1)

    @torch.no_grad()
    def run(
        self, trainer: Any, *, progress: Callable[[int], None] | None = None
    ) -> dict[str, float]:
        """{"eval_loss", "eval_mtp_loss"} of the trainer's current weights (`progress` is
        called with 1 after each forward); the corpus's token counts are left in `counts`."""
        rt = trainer.runtime
        rows, forwards = self._share(rt.dp_rank, rt.dp_size)
        step_loss = StepLoss(trainer.token_counts(rows), mtp_scale=trainer.mtp_scale)
        self.counts = step_loss.counts
        was_training = trainer.model.training
        trainer.model.eval()
        # the weights as training uses them (train.quant_aware=release: as the release stores)
        quantized = getattr(trainer, "quantized", contextlib.nullcontext)
        try:
            with quantized():
                self._forwards(trainer, rows, forwards, step_loss, progress)
        finally:
            trainer.model.train(was_training)
        if trainer.pipeline is not None:
            trainer.pipeline.reduce_eval(step_loss)  # the sums live on the last stage
        losses = step_loss.reported(group=rt.count_group)
        out = {"eval_loss": losses["loss"], "eval_mtp_loss": losses["mtp_loss"]}
        for key in ("draft_loss", "draft_tau", "draft_accept"):  # a drafter in training
            if key in losses:
                out[f"eval_{key}"] = losses[key]
        return out
