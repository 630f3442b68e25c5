"""One pipeline stage of DeepseekV41Model: the model's own submodules, cut by a `StageSpec`.

Legend: T = rows on this rank, S = rows of the whole pack (T x cp), K = hc_mult streams,
D = hidden, H = head dim, I = index head dim, Kt = index top-k, B = candidate blocks kept.

Why the shared tensors cross the stage boundary (rather than cuts that never split a kv source
from its users): Flash's ratio-1 source (layer 20) is read by every layer from 20 to 39 and its
candidates by the reindex layers 24-36, so a cut that respected the sharing could not split the
second half of the model at all (stages of 8, 6, 6 and 20 layers at most). Sending the shared
cache costs per row 4 x hidden stream values + (H + I) pool values + (Kt + B) int64 indices,
small beside the streams at Flash sizes, and leaves every even split valid.

What crosses a boundary, always the same four tensors (fixed shapes, as the schedule needs):
- x_TKD: the mHC streams (stream dtype), as in DeepSeek-V4;
- pre_TK: the last FFN's pre (float32), which the next layer collapses its input with;
- pool_SX: the latest kv source's RoPE'd compressed KV [P, H] and its index keys [P, I], side
  by side and zero-padded to S rows (the pool of a pack has at most one position per row);
- index_TX: the latest index source's selection [T, Kt] and the candidate blocks [T, B] (int64).
A part the receiving stage has no source for yet (before the first kv / index / candidate source)
is sent as zeros and not read: the receiver knows from the config which parts are live and how
long the pool is (its own `PoolPlan`, rebuilt from cu_seqlens). The pool's gradient returns to
the source through the schedule's backward; the index keys and selections carry none (the
indexer is discrete and runs without autograd, as on one process).
Token ids reach every stage as keyword tensors (DeepSeek-V4's stage does the same for hash
routing), so a stage holding an Engram layer hashes its n-grams locally.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from primus_v4.models.deepseek_v4.hyper_connection import lift_streams
from primus_v4.models.deepseek_v4.infra.pipeline_stage import PipelineStageModel as V4Stage
from primus_v4.models.deepseek_v4.layout import LocalComm, SeqComm
from primus_v4.models.deepseek_v4.model import ModelOutput
from primus_v4.models.deepseek_v41.attention import SharedCache
from primus_v4.models.deepseek_v41.model import DeepseekV41Model
from primus_v4.parallel.pipeline_layout import StageSpec


class PipelineStageModel(DeepseekV41Model):
    """The stage's share of a built DeepseekV41Model (modules are moved, not copied).

    Subclassing reuses the model's layer loop, head and mask code; `__init__` deliberately skips
    DeepseekV41Model's (which would build and initialize every layer)."""

    def __init__(
        self,
        full: DeepseekV41Model,
        spec: StageSpec,
        *,
        packed: bool = True,
        comm: SeqComm | None = None,
    ) -> None:
        nn.Module.__init__(self)
        cfg = self.cfg = full.cfg
        self.spec, self.packed = spec, packed
        self.comm: SeqComm = comm or LocalComm()
        self.checkpoint = full.checkpoint
        self.is_first, self.is_last = spec.has_embedding, spec.has_loss
        self.mtp_depths = 0
        if self.is_first:
            self.embedding = full.embedding
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in spec.decoder_layers})
        if self.is_last:
            self.final_norm, self.lm_head = full.final_norm, full.lm_head
        self.mtp = nn.ModuleList()
        engram = any(i in cfg.engram_layer_ids for i in spec.decoder_layers)
        self.engram_rows = full.engram_rows if engram else None
        self.stream_dtype = full.embedding.weight.dtype
        self.head_dim = full.layers[0].attn.head_dim
        self.aux_scale = 1.0  # d(objective)/d(aux) per sample; set per step by the runner
        self.aux_total = 0.0  # this stage's balance losses x sample counts, over the step's packs

    def boundary(self, t: int) -> tuple[torch.Tensor, ...]:
        """Meta tensors of what crosses a stage boundary for T = `t` local rows."""
        cfg, s = self.cfg, t * self.comm.size
        topk = cfg.index_topk + max(cfg.candidate_topk_blocks, 0)

        def meta(*shape: int, dtype: torch.dtype = self.stream_dtype) -> torch.Tensor:
            grad = dtype.is_floating_point
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

        return (
            meta(t, cfg.hc_mult, cfg.hidden_size),
            meta(t, cfg.hc_mult, dtype=torch.float32),
            meta(s, self.head_dim + cfg.index_head_dim),
            meta(t, topk, dtype=torch.int64),
        )

    def forward(  # type: ignore[override]
        self,
        *inputs: torch.Tensor,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        padding_mask: torch.Tensor,
        aux_samples: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """First stage: inputs = (token ids [1, T],); later stages: the four boundary tensors.

        Returns the boundary tensors (non-last stages) or (main CE sum, aux) of this pack."""
        ids_T, layout, pos_T, pad_T = self._stage_rows(token_ids, position_ids, cu_seqlens,
                                                       padding_mask)  # fmt: skip
        shared = self.shared_cache(layout, ids_T.device)
        if self.is_first:
            x_TKD = lift_streams(self.embedding(ids_T), self.cfg.hc_mult)
            pre_TK = torch.zeros(x_TKD.shape[:2], dtype=torch.float32, device=ids_T.device)
            pre_TK[:, 0] = 1.0
        else:
            x_TKD, pre_TK, pool_SX, index_TX = inputs
            shared = self._received(shared, pool_SX, index_TX)
        x_TKD, pre_TK, shared, aux = self.run_blocks(
            self.layers.values(), x_TKD, pre_TK, shared, ids_T, pos_T, layout, pad_T
        )
        if not self.is_last:
            return self._sent(self._attach_aux(x_TKD, aux, aux_samples), pre_TK, shared)
        last = self.layers[str(self.spec.decoder_layers[-1])]
        labels_T = labels.reshape(-1)
        mask_T = self._main_mask(labels_T, loss_mask.reshape(-1), pad_T)
        out = ModelOutput()
        self._head(out, self.final_norm(last.ffn_mix.collapse(x_TKD, pre_TK)), labels_T, mask_T,
                   mtp=False)  # fmt: skip
        return (out.loss_sum, aux)

    def _live(self, before: int) -> tuple[int | None, int | None, bool]:
        """(kv source, index source, candidates made) of the layers before layer `before`."""
        cfg = self.cfg
        if before == 0:
            return None, None, False
        cand = 0 <= cfg.candidate_source_layer_id < before
        return cfg.kv_source(before - 1), cfg.index_source(before - 1), cand

    def _sent(
        self, x_TKD: torch.Tensor, pre_TK: torch.Tensor, shared: SharedCache
    ) -> tuple[torch.Tensor, ...]:
        _, _, pool_meta, index_meta = self.boundary(x_TKD.shape[0])
        pool = x_TKD.new_zeros(pool_meta.shape)
        index = torch.zeros(index_meta.shape, dtype=torch.int64, device=x_TKD.device)
        if shared.pool_kv_PD is not None:
            part = torch.cat([shared.pool_kv_PD, shared.keys_PI.detach()], 1).to(pool.dtype)
            pool = torch.cat([part, pool[part.shape[0] :]])
        if shared.selection_TK is not None:
            index[:, : self.cfg.index_topk] = shared.selection_TK
        if shared.candidates_TB is not None:
            index[:, self.cfg.index_topk :] = shared.candidates_TB
        return x_TKD, pre_TK, pool, index

    def _received(
        self, shared: SharedCache, pool_SX: torch.Tensor, index_TX: torch.Tensor
    ) -> SharedCache:
        kv_src, index_src, cand = self._live(self.spec.decoder_layers[0])
        k = self.cfg.index_topk
        if kv_src is not None:
            n = shared.plans[self.cfg.compress_ratios[kv_src]].pos_P.shape[0]
            kv_PD, keys_PI = pool_SX[:n].split([self.head_dim, pool_SX.shape[1] - self.head_dim], 1)
            shared = replace(shared, pool_kv_PD=kv_PD, keys_PI=keys_PI.detach())
        if index_src is not None:
            shared = replace(shared, selection_TK=index_TX[:, :k])
        if cand:
            shared = replace(shared, candidates_TB=index_TX[:, k:])
        return shared

    _stage_rows = V4Stage._stage_rows
    _attach_aux = V4Stage._attach_aux


def build_stage(
    full: DeepseekV41Model,
    spec: StageSpec,
    *,
    packed: bool = True,
    comm: SeqComm | None = None,
) -> PipelineStageModel:
    """This rank's stage of `full` (parameter names equal the full model's)."""
    return PipelineStageModel(full, spec, packed=packed, comm=comm)
