"""One pipeline stage of DeepseekV4Model: the model's own submodules, cut by a `StageSpec`.

Legend: T = rows on this rank, K = hc_mult streams, D = hidden, N = segments, P = padded N + 1.

What crosses a stage boundary is only the mHC streams x_TKD. Everything else a stage needs is
per-micro-batch metadata that every rank of the pipeline already holds (all stages of one
pipeline train the same rows), passed to each stage as keyword tensors: token ids (hash routing),
positions, `cu_seqlens` (the RowLayout is rebuilt from it on every stage, never sent), labels,
masks and, under CP, the globally shifted MTP streams.

The last stage holds the final HyperHead, norm, LM head, the MTP depths and, with MTP, its own
copy of the token embedding (MTP embeds token t+k there). The copy starts equal to the first
stage's and its gradient is summed with the first stage's over the embedding group before the
optimizer step (megatron's tied-embedding scheme), so both copies take identical updates.

Parameter names equal the full model's (`embedding.weight`, `layers.7.attn...`, `mtp.0...`), so
checkpoints and the PP = 1 reference line up name by name.
"""

from __future__ import annotations

import torch
from torch import nn

from primus_v4.data.mtp_shift import MtpStreams
from primus_v4.models.deepseek_v4.block import run_block
from primus_v4.models.deepseek_v4.hyper_connection import lift_streams
from primus_v4.models.deepseek_v4.layout import LocalComm, RowLayout, SeqComm
from primus_v4.models.deepseek_v4.model import DeepseekV4Model, ModelOutput
from primus_v4.models.deepseek_v4.moe import RoutingInputs
from primus_v4.parallel.pipeline_layout import StageSpec


class _AttachAux(torch.autograd.Function):
    """Identity on the stage output whose backward also feeds d(objective)/d(aux) = weight.

    A non-last stage's MoE balance loss never reaches the loss stage; hanging it on the output
    (megatron's MoEAuxLossAutoScaler) lets the schedule's ordinary backward of the output
    include it, with the same weight the one-process objective gives it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux, weight)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        aux, weight = ctx.saved_tensors
        return grad, weight.to(aux.dtype).expand_as(aux), None


def strip_cu_seqlens(cu_P: torch.Tensor) -> torch.Tensor:
    """Undo the right padding (repeats of the last value) that made per-pack cu_seqlens stack."""
    cu_P = cu_P.flatten()
    keep = torch.ones_like(cu_P, dtype=torch.bool)
    keep[1:] = cu_P[1:] > cu_P[:-1]
    return cu_P[keep]


class PipelineStageModel(DeepseekV4Model):
    """The stage's share of a built DeepseekV4Model (modules are moved, not copied).

    Subclassing reuses the model's head, MTP and mask code unchanged; `__init__` deliberately
    skips DeepseekV4Model's (which would build and initialize every layer).
    """

    def __init__(
        self,
        full: DeepseekV4Model,
        spec: StageSpec,
        *,
        packed: bool = True,
        comm: SeqComm | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.cfg = full.cfg
        self.spec = spec
        self.packed = packed
        self.comm: SeqComm = comm or LocalComm()
        self.checkpoint = full.checkpoint
        self.is_first, self.is_last = spec.has_embedding, spec.has_loss
        self.mtp_depths = len(spec.mtp_depths)
        if self.is_first or (self.is_last and self.mtp_depths):
            self.embedding = full.embedding
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in spec.decoder_layers})
        if self.is_last:
            self.head_hc, self.final_norm = full.head_hc, full.final_norm
            self.lm_head = full.lm_head
        self.mtp = nn.ModuleList(full.mtp[d] for d in spec.mtp_depths)
        if self.mtp_depths and spec.mtp_depths != tuple(range(len(full.mtp))):
            raise ValueError(f"stage {spec.index}: MTP depths must all sit on the last stage")
        self.stream_dtype = full.embedding.weight.dtype
        # d(objective)/d(aux) of a pack = aux_scale x its sample count; set per step by the runner.
        self.aux_scale = 1.0
        self.aux_total = 0.0  # this stage's balance losses x sample counts, over the step's packs

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        *,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        padding_mask: torch.Tensor,
        aux_samples: torch.Tensor,
        mtp_ids: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
        mtp_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """First stage: x = token ids [1, T]; later stages: x = streams [T, K, D] (received).

        Returns the streams (non-last stages) or (main CE sum, per-depth MTP CE sums..., aux) of
        this micro-batch (last stage; the runner's loss function turns them into the objective).
        """
        ids_T, layout, pos_T, pad_T = self._stage_rows(token_ids, position_ids, cu_seqlens,
                                                       padding_mask)  # fmt: skip
        x_TKD = lift_streams(self.embedding(ids_T), self.cfg.hc_mult) if self.is_first else x
        routing = RoutingInputs.build(ids_T, layout, pad_T)
        aux = x_TKD.new_zeros((), dtype=torch.float32)
        for block in self.layers.values():
            x_TKD, layer_aux = run_block(
                block, x_TKD, positions_T=pos_T, layout=layout, routing=routing,
                checkpoint=self.checkpoint,
            )  # fmt: skip
            aux = aux + layer_aux
        if not self.is_last:
            if x_TKD.dtype != self.stream_dtype:
                raise TypeError(
                    f"stage {self.spec.index} sends {x_TKD.dtype} streams but the receive buffers "
                    f"are {self.stream_dtype}"
                )
            return self._attach_aux(x_TKD, aux, aux_samples)
        return self._last_stage(x_TKD, ids_T, pos_T, layout, pad_T, labels, loss_mask, aux,
                                (mtp_ids, mtp_labels, mtp_mask))  # fmt: skip

    def _stage_rows(
        self,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        padding_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, RowLayout, torch.Tensor, torch.Tensor]:
        """(ids [T], the RowLayout rebuilt from the stacked cu_seqlens, positions, padding)."""
        ids_T = token_ids.reshape(-1)
        t = ids_T.shape[0]
        if self.packed:
            cu = strip_cu_seqlens(cu_seqlens)
            layout = RowLayout.from_cu_seqlens(cu, local_rows=t, comm=self.comm)
        else:
            layout = RowLayout.unpacked(t, comm=self.comm)
        return ids_T, layout, position_ids.reshape(-1), padding_mask.reshape(-1)

    def _attach_aux(
        self, x_TKD: torch.Tensor, aux: torch.Tensor, aux_samples: torch.Tensor
    ) -> torch.Tensor:
        """The streams a non-last stage sends, carrying its balance loss's backward."""
        samples = aux_samples.reshape(())  # this pack's sample count
        self.aux_total += float(aux.detach() * samples)
        return _AttachAux.apply(x_TKD, aux, samples * self.aux_scale)

    def _last_stage(
        self,
        x_TKD: torch.Tensor,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        layout: RowLayout,
        pad_T: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        aux: torch.Tensor,
        mtp: tuple[torch.Tensor | None, ...],
    ) -> tuple[torch.Tensor, ...]:
        labels_T = labels.reshape(-1)
        mask_T = self._main_mask(labels_T, loss_mask.reshape(-1), pad_T)
        h_TD = self.head_hc(x_TKD)
        out = ModelOutput()
        self._head(out, self.final_norm(h_TD), labels_T, mask_T, mtp=False)
        if self.mtp_depths:
            if mtp[0] is not None:
                ids_kT, labels_kT, mask_kT = (m.reshape(self.mtp_depths, -1) for m in mtp)
                streams = [
                    MtpStreams(input_ids=ids_kT[k], labels=labels_kT[k], loss_mask=mask_kT[k])
                    for k in range(self.mtp_depths)
                ]
            else:
                streams = self._local_mtp_streams(ids_T, layout, labels_T, mask_T, pad_T)
            aux = aux + self._mtp(out, x_TKD, streams, pos_T, layout, pad_T)
        return (out.loss_sum, *out.mtp_loss_sums, aux)


def build_stage(
    full: DeepseekV4Model,
    spec: StageSpec,
    *,
    packed: bool = True,
    comm: SeqComm | None = None,
) -> PipelineStageModel:
    """This rank's stage of `full`: on the meta device shapes only, then `init_weights(seed)`
    gives each kept parameter its one-process value (parameter names equal the full model's)."""
    return PipelineStageModel(full, spec, packed=packed, comm=comm)
