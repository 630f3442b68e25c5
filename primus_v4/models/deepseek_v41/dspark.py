"""DeepSeek-V4.1's DSpark drafter: the release's draft stages (`mtp.0..`) that servers speculate
with, as a part of the V4.1 model (docs/DESIGN.md section 15).

Legend: T = rows of the pack, K = anchors, B = draft block size, N = K x B block rows,
S = mHC streams, D = hidden, X = target layers x D, R = Markov rank, V = vocab.

What it computes, for many anchors of a packed row in one pass (`DeepseekV41Model.draft`):
- `main_TX`: for each target layer, the mean over the mHC streams of that layer's INPUT (after
  its Engram write), concatenated. Stage 0 projects it once: `main_TD = main_norm(main_proj(.))`;
  every stage's attention keys/values are its own `kv_norm(wkv(main_TD))` RoPE'd at the main
  positions, then the block's own.
- An anchor a (a row of the pack, its token t_a known): the block is t_a followed by B - 1 noise
  tokens at positions pos(a) .. pos(a) + B - 1, embedded by the backbone's embedding and lifted
  to the streams. Each block query sees the main rows max(sample start, a - W) .. a - 1 (W the
  sliding window: never a row of another sample) and its whole block, in both directions.
- Each stage is a V4.1 block without Engram or compressed branch (single-pass mHC from the
  one-hot pre, window attention as above, its own MoE of `dspark_n_routed_experts` top
  `dspark_num_experts_per_tok`); after the last: collapse, `norm`, the backbone's LM head in
  float32, plus the Markov bias of the block token before each slot (`markov_head`: embed ->
  head, rank R); the confidence head reads [collapsed state, Markov embedding] in float32.
- `logits[k, i]` drafts the token at row anchors[k] + 1 + i. The Markov inputs (`block_ids`)
  default to teacher forcing: the data tokens anchors[k] .. anchors[k] + B - 1 (past the sample's
  end, the noise token: those slots have no data token and are never targets).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4 import kernels
from primus_v4.models.deepseek_v4.block import _mixer
from primus_v4.models.deepseek_v4.hyper_connection import lift_streams
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.moe import MoE, RoutingInputs
from primus_v4.models.deepseek_v4.norm import RMSNorm
from primus_v4.models.deepseek_v4.rope import RotaryEmbedding
from primus_v4.models.deepseek_v41 import fake_quant
from primus_v4.models.deepseek_v41.attention import Attention
from primus_v4.models.deepseek_v41.config import LAYER_KINDS, DeepseekV41Config


@dataclass
class DraftOutput:
    """`logits` [K, B, V] float32 (Markov bias included): logits[k, i] drafts the token at row
    anchors[k] + 1 + i; `confidence` [K, B] float32, the confidence head's raw score."""

    logits: torch.Tensor
    confidence: torch.Tensor


def _as_long(x: object, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long, device=device)


@dataclass(frozen=True, kw_only=True)
class DraftPlan:
    """Where the block rows of K anchors sit and what each may see (built once per call).

    block_ids_N / block_pos_N: the block tokens and their RoPE positions; markov_ids_N: the
    Markov head's input of each slot; lo_NR / hi_NR: key-buffer ranges of each block row (the T
    main rows first, then the N block rows); layout: each block a segment (routing groups)."""

    anchors_K: torch.Tensor
    block_ids_N: torch.Tensor
    block_pos_N: torch.Tensor
    markov_ids_N: torch.Tensor
    lo_NR: torch.Tensor
    hi_NR: torch.Tensor
    layout: RowLayout

    @classmethod
    def build(
        cls,
        cfg: DeepseekV41Config,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        layout: RowLayout,
        anchors: object,
        block_ids: object | None = None,
        pad_T: torch.Tensor | None = None,
    ) -> DraftPlan:
        t, b, dev = ids_T.shape[0], cfg.dspark_block_size, ids_T.device
        anchors_K = _as_long(anchors, dev).flatten()
        k = anchors_K.numel()
        if k == 0:
            raise ValueError("draft: no anchors given")
        if int(anchors_K.min()) < 0 or int(anchors_K.max()) >= t:
            raise ValueError(f"draft: anchors must be rows of the pack in [0, {t})")
        start_K = layout.seq_start_T.to(dev)[anchors_K]
        first = anchors_K <= start_K
        if bool(first.any()):
            raise ValueError(
                f"draft: anchor row {int(anchors_K[first][0])} is its sample's first token; an "
                "anchor needs an earlier token of its own sample (the drafter reads the backbone "
                "there)"
            )
        if pad_T is not None and bool(pad_T.to(dev).bool()[anchors_K].any()):
            raise ValueError("draft: an anchor is a padding row")
        cu = layout.cu_seqlens.to(dev)
        end_K = cu[torch.searchsorted(cu, anchors_K + layout.global_start, right=True)]
        end_K = end_K - layout.global_start  # one past the last row of the anchor's sample
        slot_B = torch.arange(b, device=dev)
        noise = cfg.dspark_noise_token_id
        block_KB = torch.full((k, b), noise, dtype=ids_T.dtype, device=dev)
        block_KB[:, 0] = ids_T[anchors_K]
        if block_ids is None:  # teacher forcing: the data tokens of the slots, inside the sample
            rows_KB = anchors_K[:, None] + slot_B
            inside_KB = rows_KB < end_K[:, None]
            markov_KB = torch.where(inside_KB, ids_T[rows_KB.clamp(max=t - 1)], noise)
        else:
            markov_KB = _as_long(block_ids, dev).to(ids_T.dtype)
            if markov_KB.shape != (k, b):
                raise ValueError(
                    f"draft: block_ids must be [anchors, block] = [{k}, {b}], got "
                    f"{list(markov_KB.shape)}"
                )
        pos_KB = pos_T.to(dev)[anchors_K][:, None] + slot_B
        lo_main_K = torch.maximum(start_K, anchors_K - cfg.attn_sliding_window)
        block_lo_K = t + torch.arange(k, device=dev) * b
        lo_NR = torch.stack((lo_main_K, block_lo_K), 1).repeat_interleave(b, dim=0)
        hi_NR = torch.stack((anchors_K, block_lo_K + b), 1).repeat_interleave(b, dim=0)
        blocks = RowLayout.from_cu_seqlens(torch.arange(0, k * b + 1, b), local_rows=k * b)
        return cls(
            anchors_K=anchors_K,
            block_ids_N=block_KB.flatten(),
            block_pos_N=pos_KB.flatten(),
            markov_ids_N=markov_KB.flatten(),
            lo_NR=lo_NR,
            hi_NR=hi_NR,
            layout=blocks,
        )


class DSparkAttention(Attention):
    """A stage's attention: V4.1's window-only layer (base RoPE theta, no YaRN), its keys the
    main rows' `kv_norm(wkv(main))` and the block's own; no compressed branch."""

    def __init__(self, cfg: DeepseekV41Config, *, stage: int) -> None:
        nn.Module.__init__(self)
        self.kind, self.layer_idx, self.ratio = LAYER_KINDS[0], cfg.num_layers + stage, 0
        self.window = cfg.attn_sliding_window
        self._projections(cfg)
        self.rope = RotaryEmbedding(cfg, compressed=False)
        self.kv_source = False
        self.compressor = self.index_keys = self.indexer = None
        self.make_candidates = None
        self.use_candidates = False
        self.block_size = cfg.candidate_block_size
        self.fake_quant = cfg.activation_fake_quant
        self._attend = kernels.resolve("sparse_attention")
        self.recompute: frozenset[str] = frozenset()

    def forward(  # type: ignore[override]
        self, x_ND: torch.Tensor, main_TD: torch.Tensor, *, main_pos_T: torch.Tensor,
        plan: DraftPlan,
    ) -> torch.Tensor:  # fmt: skip
        q_NHD = self._q_up(self.q_norm(self.wq_a(x_ND)), plan.block_pos_N)
        main_kv = self.rope(self.kv_norm(self.wkv(main_TD)), main_pos_T)
        block_kv = self.rope(self.kv_norm(self.wkv(x_ND)), plan.block_pos_N)
        if self.fake_quant:
            main_kv, block_kv = fake_quant.fp8_window(main_kv), fake_quant.fp8_window(block_kv)
        o_GNI = self._core(q_NHD, torch.cat((main_kv, block_kv)), self.attn_sink, plan.lo_NR,
                           plan.hi_NR, None, plan.block_pos_N)  # fmt: skip
        return self._project(o_GNI)[1]


class MarkovHead(nn.Module):
    """The previous draft token -> a rank-R embedding -> a bias over the vocabulary."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """[collapsed state, Markov embedding] -> one raw score per slot (float32)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False)


def stage_config(cfg: DeepseekV41Config) -> DeepseekV41Config:
    """The config a stage's MoE is built from: the drafter's expert count and top-k."""
    out = copy.copy(cfg)
    out.num_moe_experts = cfg.dspark_n_routed_experts
    out.moe_router_topk = cfg.dspark_num_experts_per_tok
    return out


class DSparkStage(nn.Module):
    """One draft stage (`mtp.<stage>`): a V4.1 block on the draft rows; stage 0 also owns the
    main projection, the last one the final norm, the Markov and the confidence heads."""

    def __init__(self, cfg: DeepseekV41Config, *, stage: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layernorm_epsilon
        self.stage = stage
        self.attn_mix = _mixer(cfg)
        self.attn_norm = RMSNorm(d, eps)
        self.attn = DSparkAttention(cfg, stage=stage)
        self.ffn_mix = _mixer(cfg)
        self.ffn_norm = RMSNorm(d, eps)
        self.moe = MoE(stage_config(cfg), layer_idx=cfg.num_layers + stage)
        if stage == 0:
            self.main_proj = nn.Linear(d * len(cfg.dspark_target_layer_ids), d, bias=False)
            self.main_norm = RMSNorm(d, eps)
        if stage == cfg.dspark_stages - 1:
            self.norm = RMSNorm(d, eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + cfg.dspark_markov_rank)

    def forward(
        self, x_NSD: torch.Tensor, pre_NS: torch.Tensor, *, main_TD: torch.Tensor,
        main_pos_T: torch.Tensor, plan: DraftPlan,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(streams, this stage's FFN pre, MoE balance loss): single-pass mHC as Block's."""
        attn_pre, post, comb = self.attn_mix.coefficients(x_NSD)
        h_ND = self.attn(self.attn_norm(self.attn_mix.collapse(x_NSD, pre_NS)), main_TD,
                         main_pos_T=main_pos_T, plan=plan)  # fmt: skip
        x_NSD = self.attn_mix.write_back(x_NSD, h_ND, post, comb)
        ffn_pre, post, comb = self.ffn_mix.coefficients(x_NSD)
        routing = RoutingInputs.build(plan.block_ids_N, plan.layout, None)
        h_ND, aux = self.moe(self.ffn_norm(self.ffn_mix.collapse(x_NSD, attn_pre)), routing)
        return self.ffn_mix.write_back(x_NSD, h_ND, post, comb), ffn_pre, aux


class DSparkDrafter(nn.Module):
    """The draft stages; they own no embedding or head (the backbone's are passed in)."""

    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.stages = nn.ModuleList(DSparkStage(cfg, stage=s) for s in range(cfg.dspark_stages))

    def states(
        self, main_TX: torch.Tensor, main_pos_T: torch.Tensor, plan: DraftPlan, *,
        embedding_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(collapsed final state [N, D], Markov embedding [N, R], summed MoE balance loss) of
        the block rows; the heads are `head`'s."""
        first, last = self.stages[0], self.stages[-1]
        main_TD = first.main_norm(first.main_proj(main_TX))
        x_NSD = lift_streams(F.embedding(plan.block_ids_N, embedding_weight), self.cfg.hc_mult)
        pre_NS = torch.zeros(x_NSD.shape[:2], dtype=torch.float32, device=x_NSD.device)
        pre_NS[:, 0] = 1.0  # the one-hot pre of the first sub-block
        aux = x_NSD.new_zeros((), dtype=torch.float32)
        for stage in self.stages:
            x_NSD, pre_NS, stage_aux = stage(x_NSD, pre_NS, main_TD=main_TD,
                                             main_pos_T=main_pos_T, plan=plan)  # fmt: skip
            aux = aux + stage_aux
        return last.ffn_mix.collapse(x_NSD, pre_NS), last.markov_head.embed(plan.markov_ids_N), aux

    def head(
        self, h_ND: torch.Tensor, markov_NR: torch.Tensor, head_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits [N, V] float32 with the Markov bias, confidence [N] float32) of rows
        (any subset: the objective takes them a chunk at a time)."""
        last = self.stages[-1]
        logits_NV = F.linear(last.norm(h_ND).float(), head_weight.float())
        logits_NV = logits_NV + F.linear(markov_NR.float(), last.markov_head.head.weight.float())
        both = torch.cat((h_ND.float(), markov_NR.float()), -1)
        return logits_NV, F.linear(both, last.confidence_head.proj.weight.float()).squeeze(-1)

    @torch.no_grad()
    def greedy_chain(self, h_BD: torch.Tensor, first: int, head_weight: torch.Tensor) -> list[int]:
        """One block's drafts at temperature 0, as a server makes them: slot i's Markov input is
        the previous slot's own draft (the anchor token for slot 0)."""
        last = self.stages[-1]
        base_BV = F.linear(last.norm(h_BD).float(), head_weight.float())
        chain = [first]
        for i in range(h_BD.shape[0]):
            embed_R = last.markov_head.embed.weight[chain[-1]].float()
            bias_V = F.linear(embed_R, last.markov_head.head.weight.float())
            chain.append(int((base_BV[i] + bias_V).argmax()))
        return chain[1:]

    def forward(
        self, main_TX: torch.Tensor, main_pos_T: torch.Tensor, plan: DraftPlan, *,
        embedding: nn.Embedding, lm_head: nn.Linear,
    ) -> DraftOutput:  # fmt: skip
        h_ND, markov_NR, _ = self.states(main_TX, main_pos_T, plan,
                                         embedding_weight=embedding.weight)  # fmt: skip
        logits_NV, conf_N = self.head(h_ND, markov_NR, lm_head.weight)
        k = plan.anchors_K.numel()
        return DraftOutput(logits=logits_NV.view(k, -1, logits_NV.shape[-1]),
                           confidence=conf_N.view(k, -1))  # fmt: skip
