"""DeepSeek-V4 language model: embedding -> mHC decoder layers -> HyperHead -> norm -> LM head,
plus MTP depths sharing the embedding and the LM head.

Legend: T = rows on this rank (S when CP = 1), K = hc_mult streams, D = hidden, V = vocab.

Packing: one `RowLayout` is built per forward from `packed_seq_params` (global cu_seqlens) and the
SAME object reaches every decoder layer and every MTP depth, with or without activation
checkpointing. `layout=`/`comm=` are the context-parallel seam: under CP, input_ids are this
rank's contiguous rows, cu_seqlens stays global and `comm` moves rows between ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from primus_v4.data.mtp_shift import IGNORE_LABEL, MtpStreams, mtp_streams
from primus_v4.kernels.linear_ce import chunked_linear_ce
from primus_v4.models.deepseek_v4.block import Block, run_block
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.hyper_connection import HyperHead, lift_streams
from primus_v4.models.deepseek_v4.layout import LocalComm, RowLayout, SeqComm
from primus_v4.models.deepseek_v4.moe import Dispatcher, RoutingInputs
from primus_v4.models.deepseek_v4.mtp import MTPDepth
from primus_v4.models.deepseek_v4.norm import RMSNorm
from primus_v4.models.deepseek_v4.weight_init import drawn_values, init_buffers, init_parameters


@dataclass(kw_only=True)
class ModelOutput:
    """Forward results. Sums and counts are local to this rank / micro-batch (docs/DESIGN.md 3).

    logits:          [1, T, V], or None when labels were given (chunked CE, never materialized).
    mtp_logits:      one [1, T, V] per MTP depth (empty when labels were given).
    loss:            main CE, mean over supervised tokens (loss_sum / max(num_tokens, 1)).
    loss_sum:        main CE summed over supervised tokens (float32 scalar).
    num_tokens:      supervised tokens of the main loss (float32 scalar).
    mtp_loss:        per-depth mean CE, averaged over depths (unscaled by mtp_loss_scaling_factor).
    mtp_loss_sums:   per depth, CE summed over its supervised tokens.
    mtp_num_tokens:  per depth, its supervised tokens (fewer than num_tokens: sample ends).
    aux_loss:        MoE balance losses of all layers incl. MTP, already x moe_aux_loss_coeff.
    """

    logits: torch.Tensor | None = None
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    mtp_loss_sums: list[torch.Tensor] = field(default_factory=list)
    mtp_num_tokens: list[torch.Tensor] = field(default_factory=list)
    aux_loss: torch.Tensor | None = None

    @classmethod
    def from_sums(
        cls, loss_sum: torch.Tensor, mtp_loss_sums: list[torch.Tensor], aux_loss: torch.Tensor
    ) -> ModelOutput:
        """The output a pipeline's last stage reports: the loss sums only."""
        return cls(loss_sum=loss_sum, mtp_loss_sums=list(mtp_loss_sums), aux_loss=aux_loss)


def _row(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """[1, T] (micro-batch 1: the pack is the batch) or [T] -> [T]."""
    if t is None or t.dim() == 1:
        return t
    if t.dim() != 2 or t.shape[0] != 1:
        raise ValueError(f"{name} must be [1, T] (one pack per micro-batch), got {tuple(t.shape)}")
    return t[0]


def build_layout(rows: int, packed_seq_params: object | None, comm: SeqComm | None) -> RowLayout:
    """RowLayout from megatron PackedSeqParams (global cu_seqlens), or one unpacked sequence."""
    cu = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
    if cu is None:
        return RowLayout.unpacked(rows, comm=comm)
    return RowLayout.from_cu_seqlens(cu, local_rows=rows, comm=comm)


class DeepseekV4Model(nn.Module):
    """The whole model on one pipeline stage (float32 on the current device by default).

    Built under `torch.device("meta")` it allocates nothing and draws nothing: a rank cuts its
    stage and expert shard there, then `to_empty` + `init_weights(seed)` materialize only those.
    """

    family = "deepseek_v4"
    """The model family (models/__init__.py): how `primus_v4.save_pretrained` finds its spec."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        *,
        dispatcher: Dispatcher | None = None,
        activation_checkpointing: bool | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        d, eps = cfg.hidden_size, cfg.layernorm_epsilon
        if activation_checkpointing is None:
            activation_checkpointing = cfg.recompute_granularity == "full"
        self.checkpoint = activation_checkpointing
        self.embedding = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, layer_idx=i, compress_ratio=r, dispatcher=dispatcher)
            for i, r in enumerate(cfg.compress_ratios)
        )
        self.head_hc = HyperHead(hidden=d, k=cfg.hc_mult, eps=cfg.hc_eps, norm_eps=eps)
        self.final_norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            MTPDepth(cfg, depth=k + 1, dispatcher=dispatcher)
            for k in range(cfg.mtp_num_layers or 0)
        )
        for depth in self.mtp:
            depth.checkpoint = activation_checkpointing
        if not self.embedding.weight.is_meta:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """The one place weights are initialized (also of a stage or an expert shard): each
        parameter N(0, init_method_std) from a generator of (seed, its name), or its constant
        (norm scales 1, mHC biases 0, ...; see `weight_init.py`); then the config-derived buffers.

        seed None: `torch.initial_seed()`, i.e. the seed of the last `torch.manual_seed`."""
        seed = torch.initial_seed() if seed is None else seed
        init_parameters(self, seed=seed, std=self.cfg.init_method_std)
        init_buffers(self)

    def initial_values(self, seed: int) -> Iterator[tuple[nn.Parameter, int, torch.Tensor]]:
        """The float32 draws `init_weights(seed)` rounds into non-float32 parameters, as
        (parameter, flat offset, values) pieces (`weight_init.drawn_values`): what fp32 master
        weights of a random-init run start from."""
        return drawn_values(self, seed=seed, std=self.cfg.init_method_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        packed_seq_params: object | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        layout: RowLayout | None = None,
        comm: SeqComm | None = None,
        mtp_inputs: list[MtpStreams] | None = None,
    ) -> ModelOutput:
        ids_T, layout, pos_T, pad_T = self._rows(
            input_ids, position_ids, packed_seq_params, padding_mask, layout, comm
        )
        labels_T = _row(labels, "labels")
        mask_T = None if labels_T is None else self._main_mask(labels_T, loss_mask, pad_T)

        x_TKD = lift_streams(self.embedding(ids_T), self.cfg.hc_mult)
        routing = RoutingInputs.build(ids_T, layout, pad_T)
        aux = x_TKD.new_zeros((), dtype=torch.float32)
        for block in self.layers:
            x_TKD, layer_aux = run_block(
                block,
                x_TKD,
                positions_T=pos_T,
                layout=layout,
                routing=routing,
                checkpoint=self.checkpoint,
            )
            aux = aux + layer_aux
        h_TD = self.head_hc(x_TKD)
        out = ModelOutput()
        self._head(out, self.final_norm(h_TD), labels_T, mask_T, mtp=False)
        if self.mtp:
            streams = mtp_inputs or self._local_mtp_streams(ids_T, layout, labels_T, mask_T, pad_T)
            aux = aux + self._mtp(out, x_TKD, streams, pos_T, layout, pad_T)
        if labels_T is not None and out.mtp_loss is None:
            out.mtp_loss = aux.new_zeros(())  # no MTP depth: a zero the trainer can always add
        out.aux_loss = aux
        return out

    @staticmethod
    def _rows(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        packed_seq_params: object | None,
        padding_mask: torch.Tensor | None,
        layout: RowLayout | None,
        comm: SeqComm | None,
    ) -> tuple[torch.Tensor, RowLayout, torch.Tensor, torch.Tensor | None]:
        """(ids [T], the pack's layout, positions [T], padding [T] or None) of one pack."""
        ids_T = _row(input_ids, "input_ids")
        t = ids_T.shape[0]
        if layout is None:
            layout = build_layout(t, packed_seq_params, comm or LocalComm())
        if layout.local_rows != t:
            raise ValueError(f"layout has {layout.local_rows} local rows, input_ids has {t}")
        pos_T = _row(position_ids, "position_ids")
        if pos_T is None:
            pos_T = torch.arange(t, device=ids_T.device) - layout.seq_start_T.to(ids_T.device)
        return ids_T, layout, pos_T, _row(padding_mask, "padding_mask")

    def _mtp(
        self,
        out: ModelOutput,
        x_TKD: torch.Tensor,
        streams: list[MtpStreams],
        pos_T: torch.Tensor,
        layout: RowLayout,
        pad_T: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run every MTP depth on the last layer's streams (before the HyperHead collapse) with
        the SAME layout; returns their aux loss."""
        aux = x_TKD.new_zeros((), dtype=torch.float32)
        for depth, s in zip(self.mtp, streams, strict=True):
            x_TKD, normed_TD, layer_aux = depth(
                x_TKD,
                self.embedding(s.input_ids),
                positions_T=pos_T,
                layout=layout,
                routing=RoutingInputs.build(s.input_ids, layout, pad_T),
            )
            aux = aux + layer_aux
            self._head(out, normed_TD, s.labels, s.loss_mask, mtp=True)
        if out.mtp_loss_sums:
            means = [
                total / n.clamp(min=1.0)
                for total, n in zip(out.mtp_loss_sums, out.mtp_num_tokens, strict=True)
            ]
            out.mtp_loss = torch.stack(means).mean()
        return aux

    @staticmethod
    def _main_mask(
        labels_T: torch.Tensor, loss_mask: torch.Tensor | None, pad_T: torch.Tensor | None
    ) -> torch.Tensor:
        mask_T = _row(loss_mask, "loss_mask")
        mask_T = (labels_T != IGNORE_LABEL) if mask_T is None else mask_T
        mask_T = mask_T.to(torch.float32)
        if pad_T is not None:
            mask_T = torch.where(pad_T.bool(), 0.0, mask_T)  # padding never counts
        return mask_T

    def _local_mtp_streams(
        self,
        ids_T: torch.Tensor,
        layout: RowLayout,
        labels_T: torch.Tensor | None,
        mask_T: torch.Tensor | None,
        pad_T: torch.Tensor | None,
    ) -> list[MtpStreams]:
        if layout.comm.size > 1:
            raise ValueError(
                "MTP under context parallel needs mtp_inputs=: shift the global pack with "
                "primus_v4.models.deepseek_v4.mtp.mtp_streams and slice it like input_ids"
            )
        return [
            mtp_streams(
                input_ids_S=ids_T,
                cu_seqlens=layout.cu_seqlens,
                depth=k + 1,
                labels_S=labels_T,
                loss_mask_S=mask_T,
                padding_mask_S=pad_T,
            )
            for k in range(len(self.mtp))
        ]

    def _head(
        self,
        out: ModelOutput,
        normed_TD: torch.Tensor,
        labels_T: torch.Tensor | None,
        mask_T: torch.Tensor | None,
        *,
        mtp: bool,
    ) -> None:
        """Logits when no labels; otherwise chunked CE sums and token counts."""
        if labels_T is None:
            logits = self.lm_head(normed_TD).unsqueeze(0)
            if mtp:
                out.mtp_logits.append(logits)
            else:
                out.logits = logits
            return
        loss_sum = chunked_linear_ce(
            normed_TD,
            self.lm_head.weight,
            labels_T,
            mask_T,
            chunk=self.cfg.ce_chunk_size,
            all_rows=self.cfg.lm_head_rows == "all",
        )
        num = mask_T.sum().to(torch.float32)
        if mtp:
            out.mtp_loss_sums.append(loss_sum)
            out.mtp_num_tokens.append(num)
        else:
            out.loss_sum, out.num_tokens = loss_sum, num
            out.loss = loss_sum / num.clamp(min=1.0)
