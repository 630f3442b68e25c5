"""Pipeline schedule: torch.distributed.pipelining 1F1B over the micro-batches (packs) of a step.

Legend: M = micro-batches of the step on this pipeline, T = rows per micro-batch on this rank,
K = hc_mult streams, D = hidden, P = padded cu_seqlens length.

Why torch.distributed.pipelining (and not a hand-written 1F1B): its schedules already fuse the
send/recv pairs of 1F1B into batched isend/irecv (works on gloo and RCCL), and since torch 2.5
`step(**kwargs)` chunks keyword tensors along dim 0 and hands micro-batch i's chunk to EVERY
stage, not only the first. That carries the packing metadata: each pack's tensors are stacked
[M, ...] (cu_seqlens right-padded by repeating its last value, stripped again by the stage), so
only the streams x_TKD travel between stages (or the tuple a stage's `boundary(t)` describes)
and each stage rebuilds its RowLayout locally.
Shapes are given up front (`input_args`/`output_args`): runtime shape inference would run the
model on meta tensors, which the data-dependent layout code cannot do.

Schedule1F1B needs M >= pp (its warmup holds pp - rank forwards in flight); with fewer packs per
step we fall back to ScheduleGPipe (all forwards, then all backwards), which is exact too.
`scale_grads=False`: the step objective is already normalized by global token counts
(docs/DESIGN.md section 3), so the schedule must not divide gradients by M again.

Loss: the last stage returns (main CE sum, MTP CE sums, aux) per micro-batch and the loss
function is the trainer's `StepLoss.objective`; non-last stages add their balance loss to the
backward through the stage output (see pipeline_stage._AttachAux). Reported sums are summed over
the pipeline afterwards, so every stage logs the same numbers.

Evaluation (`forward_only`) bypasses the schedule: one pack at a time, under no_grad, with
blocking send/recv of the streams between neighbouring stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from primus_v4.errors import PrimusError
from primus_v4.log import get_logger
from primus_v4.mcore import megatron_import
from primus_v4.parallel.groups import ParallelContext

log = get_logger(__name__)


def _row(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1)


OutputFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], Any]
"""(main CE sum, MTP CE sums, aux) of one pack -> the model's output object for the loss."""


def _objective(
    step_loss: Any, output_fn: OutputFn, output: tuple[torch.Tensor, ...], samples: torch.Tensor
) -> Any:
    """The last stage's (main CE sum, MTP CE sums..., aux) of one pack into `step_loss`."""
    loss_sum, *mtp_sums, aux = output
    return step_loss.objective(
        output_fn(loss_sum, list(mtp_sums), aux), samples=samples.reshape(())
    )


class PipelineRunner:
    """Runs one step's micro-batches through this rank's stage (forward + backward)."""

    def __init__(
        self, model: nn.Module, ctx: ParallelContext, *, device: torch.device, output: OutputFn
    ) -> None:
        """`model` is this rank's stage module (attributes `is_first`, `is_last`,
        `mtp_depths`); `output` builds the model's output object from the last stage's sums."""
        if ctx.pp.size < 2:
            raise PrimusError("PipelineRunner needs parallel.pp >= 2")
        self.model, self.ctx, self.device, self.output_fn = model, ctx, device, output
        self.schedule: Schedule1F1B | ScheduleGPipe | None = None
        # (micro-batches, rows, token-id dtype) the schedule was built for.
        self._shape: tuple[int, int, torch.dtype] | None = None
        self.step_loss: Any = None
        if model.is_last and model.mtp_depths and not model.is_first:
            # The MTP copy of the embedding: summed with the first stage's gradient instead of
            # being counted again in the gradient norm.
            model.embedding.weight.pipeline_duplicate = True  # type: ignore[attr-defined]
        if model.cfg.mtp_num_layers and (model.is_first or model.is_last):
            # Both copies: their gradients are summed here before any data-parallel reduction.
            model.embedding.weight.pipeline_tied = True  # type: ignore[attr-defined]

    def _build(self, m: int, t: int, id_dtype: torch.dtype) -> None:
        model, pp = self.model, self.ctx.pp
        streams = self._boundary(t)
        inputs = torch.empty(1, t, dtype=id_dtype, device="meta") if model.is_first else streams
        if model.is_last:
            scalar = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
            outputs: Any = (scalar,) * (2 + model.mtp_depths)
        else:
            outputs = streams
        stage = PipelineStage(
            model, pp.rank, pp.size, self.device, input_args=inputs, output_args=outputs,
            group=pp.group,
        )  # fmt: skip
        kind = Schedule1F1B if m >= pp.size else ScheduleGPipe
        if kind is ScheduleGPipe:
            log.warning(
                "%d micro-batches per step < pp=%d: using GPipe (1F1B needs at least pp packs "
                "per step; raise train.global_batch_size for less activation memory)", m, pp.size,
            )  # fmt: skip
        # Every rank passes the loss function: pipelining decides from it whether the schedule
        # runs backward at all (only the last stage ever calls it).
        self.schedule = kind(stage, m, loss_fn=self._loss, scale_grads=False)
        self._shape = (m, t, id_dtype)

    def _boundary(self, t: int) -> Any:
        """Meta tensor(s) of what crosses a stage boundary: the model's `boundary(t)` when it
        sends more than the mHC streams [T, K, D]."""
        model = self.model
        if hasattr(model, "boundary"):
            return model.boundary(t)
        cfg = model.cfg
        return torch.empty(
            t, cfg.hc_mult, cfg.hidden_size, dtype=model.stream_dtype, device="meta",
            requires_grad=True,
        )  # fmt: skip

    def _loss(self, output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        # The labels travel as keyword tensors; the target carries this pack's sample count.
        return _objective(self.step_loss, self.output_fn, output, target)

    def _stack(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Per-pack model inputs ([1, T] rows) -> keyword tensors stacked over micro-batches."""
        first = inputs[0]
        if first.get("comm") is not None:
            self.model.comm = first["comm"]  # the CP splitter's SeqComm over this rank's CP group
        t = first["input_ids"].numel()
        cus = []
        for item in inputs:
            psp = item.get("packed_seq_params")
            # Unpacked rows (BSHD): the stage ignores cu_seqlens; a placeholder keeps the stack.
            cu = psp.cu_seqlens_q if psp is not None else torch.tensor([0, t])
            cus.append(cu.to(device=self.device, dtype=torch.long))
        width = max(c.numel() for c in cus)
        cu_MP = torch.stack([torch.cat([c, c[-1:].expand(width - c.numel())]) for c in cus])
        kw = {
            "token_ids": torch.cat([_row(i["input_ids"]) for i in inputs]),
            "position_ids": torch.cat([_row(i["position_ids"]) for i in inputs]),
            "cu_seqlens": cu_MP,
            "labels": torch.cat([_row(i["labels"]) for i in inputs]),
            "loss_mask": torch.cat([_row(i["loss_mask"]).float() for i in inputs]),
            "padding_mask": torch.cat([_row(i["padding_mask"]) for i in inputs]),
        }
        if first.get("mtp_inputs"):
            # CP: streams shifted in global order by the splitter; [M, depths, T].
            for key, attr in (("mtp_ids", "input_ids"), ("mtp_labels", "labels"),
                              ("mtp_mask", "loss_mask")):  # fmt: skip
                kw[key] = torch.stack(
                    [torch.stack([getattr(s, attr) for s in i["mtp_inputs"]]) for i in inputs]
                )
        return kw

    def run(self, inputs: list[dict[str, Any]], step_loss: Any, *, samples: list[int]) -> None:
        """Forward and backward of every micro-batch; gradients accumulate in the stage.
        `samples[i]` is pack i's sample count (its balance loss is a mean over them)."""
        kw = self._stack(inputs)
        # [M, 1]: chunked like the other keyword tensors, one count per pack for every stage.
        kw["aux_samples"] = torch.tensor(samples, dtype=torch.float32, device=self.device)[:, None]
        m, t = kw["token_ids"].shape
        if self._shape != (m, t, kw["token_ids"].dtype):
            self._build(m, t, kw["token_ids"].dtype)
        self.step_loss = step_loss
        self.model.aux_scale = 1.0 / max(step_loss.counts.samples, 1)
        self.model.aux_total = 0.0
        if step_loss.counts.mtp and not step_loss.mtp_sums:
            step_loss.mtp_sums = [0.0] * len(step_loss.counts.mtp)
        args = (kw["token_ids"],) if self.model.is_first else ()
        target = kw["aux_samples"].reshape(m) if self.model.is_last else None
        assert self.schedule is not None
        self.schedule.step(*args, target=target, return_outputs=False, **kw)
        self._reduce_reported(step_loss)
        self._sync_embedding()

    @torch.no_grad()
    def forward_only(self, item: dict[str, Any], step_loss: Any | None, *, samples: int) -> None:
        """Forward of one pack through the pipeline, no backward (evaluation).

        Plain blocking p2p of the streams between neighbouring stages: one pack at a time needs
        no schedule (and leaves the training schedule's buffers untouched). The last stage adds
        the pack's loss sums to `step_loss`; None there runs the forward and discards it (the
        padding forward of a short data-parallel share). Sums stay per stage: `reduce_eval`.
        """
        kw = self._stack([item])
        kw["aux_samples"] = torch.tensor([[float(samples)]], device=self.device)
        model, pp = self.model, self.ctx.pp
        t = kw["token_ids"].shape[1]
        if model.is_first:
            xs: tuple[torch.Tensor, ...] = (kw["token_ids"],)
        else:
            meta = self._boundary(t)
            metas = meta if isinstance(meta, tuple) else (meta,)
            xs = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas)
            for x in xs:
                dist.recv(x, group=pp.group, group_src=pp.rank - 1)
        out = model(*xs, **kw)
        if not model.is_last:
            for y in out if isinstance(out, tuple) else (out,):
                dist.send(y.contiguous(), group=pp.group, group_dst=pp.rank + 1)
        elif step_loss is not None:
            _objective(step_loss, self.output_fn, out, kw["aux_samples"])

    def reduce_eval(self, step_loss: Any) -> None:
        """Evaluation sums (last stage only) summed over the pipeline, so every stage reports
        them; the balance loss is not part of evaluation."""
        if step_loss.counts.mtp and not step_loss.mtp_sums:
            step_loss.mtp_sums = [0.0] * len(step_loss.counts.mtp)
        self.model.aux_total = 0.0
        self._reduce_reported(step_loss)

    def _reduce_reported(self, step_loss: Any) -> None:
        """Loss sums live on the last stage and aux sums on every stage: sum over the pipeline."""
        step_loss.aux_sum += 0.0 if self.model.is_last else self.model.aux_total
        values = [step_loss.loss_sum, step_loss.aux_sum, *step_loss.mtp_sums]
        # On the stage's device: RCCL/NCCL reduce device tensors only.
        sums = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.ctx.pp.group)
        step_loss.loss_sum, step_loss.aux_sum, *mtp = sums.tolist()
        step_loss.mtp_sums = mtp

    def _sync_embedding(self) -> None:
        """Sum the token embedding's gradient over the first and last stage (MTP's copy).

        Done before the DP x CP reduction is fine: both are sums, and they commute.
        """
        model = self.model
        if not model.cfg.mtp_num_layers or not (model.is_first or model.is_last):
            return
        with megatron_import():
            from megatron.core import parallel_state as ps

        weight = model.embedding.weight
        # The optimizer's fp32 accumulation buffer when it owns one (training.optim.zero), else
        # .grad.
        grad = getattr(weight, "main_grad", None)
        if grad is None:
            grad = weight.grad
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        dist.all_reduce(grad, group=ps.get_embedding_group())
