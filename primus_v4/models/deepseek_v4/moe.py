"""Mixture of experts: sqrt-softplus router (or a fixed token-id hash), shared expert, grouped
clamped-SwiGLU experts behind a swappable dispatcher, and the per-sample balance loss.

Legend: T = rows on this rank, R = routed (non-padding) rows, K = top-k, E = experts,
M = R * K routed copies sorted by expert, D = hidden, F = expert ffn, N = segments in the pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from primus_v4.kernels.grouped_experts import OP_NAME as GROUPED_EXPERTS
from primus_v4.kernels.grouped_experts import clamped_swiglu
from primus_v4.kernels.registry import resolve
from primus_v4.models.common.kept_base import ReleaseWeight
from primus_v4.models.common.lora import base_value
from primus_v4.models.common.recompute import checkpointed, selected
from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.stream_sums import EXACT, float32_linear, weighted_sum


@dataclass(frozen=True, kw_only=True)
class RoutingInputs:
    """What every MoE layer of one forward needs besides the hidden rows (built once per pack).

    token_ids_T:   input ids of this rank's rows (hash-routed layers look them up).
    routed_rows_R: indices of the non-padding rows; padding is never routed nor counted.
    segment_R:     global segment index (into cu_seqlens) of each routed row.
    num_segments:  N, segments in the whole pack.
    layout:        the pack's RowLayout (its comm reduces balance statistics under CP).
    image_R:       True on routed rows of an image span (DeepSeek-V4.1: they select experts
                   with the router's `bias_vl`); None without images.
    """

    token_ids_T: torch.Tensor
    routed_rows_R: torch.Tensor
    segment_R: torch.Tensor
    num_segments: int
    layout: RowLayout
    image_R: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        token_ids_T: torch.Tensor,
        layout: RowLayout,
        padding_mask_T: torch.Tensor | None,
        image_T: torch.Tensor | None = None,
    ) -> RoutingInputs:
        t = token_ids_T.shape[0]
        device = token_ids_T.device
        cu = layout.cu_seqlens.to(device)
        rows_global = torch.arange(t, device=device) + layout.global_start
        segment_T = torch.searchsorted(cu, rows_global, right=True) - 1
        if padding_mask_T is None:
            routed = torch.arange(t, device=device)
        else:
            routed = torch.nonzero(~padding_mask_T.to(device).bool(), as_tuple=False).flatten()
        return cls(
            token_ids_T=token_ids_T,
            routed_rows_R=routed,
            segment_R=segment_T[routed],
            num_segments=cu.numel() - 1,
            layout=layout,
            image_R=None if image_T is None else image_T.to(device).bool()[routed],
        )


class Dispatcher(Protocol):
    """Moves routed copies to the experts that own them and back.

    The single-process `LocalDispatcher` sorts by expert; an expert-parallel all-to-all
    dispatcher implements the same two calls (send rows to the owning ranks, sort by local
    expert; then the inverse), and the MoE math does not change.
    """

    def dispatch(
        self, x_RD: torch.Tensor, expert_RK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, list[list[int]], Any]:
        """Returns rows [M, D] as consecutive blocks, each sorted by local expert; rows per
        local expert of each block; and a handle. A block is the rows of one source (one pack):
        the experts run each block as its own grouped GEMM (`MoE._routed`)."""
        ...

    def combine(self, y_MD: torch.Tensor, weight_RK: torch.Tensor, handle: Any) -> torch.Tensor:
        """Inverse of dispatch, weighting each copy and summing its K experts: [R, D] float32
        (`combine_experts`; the MoE rounds once after adding the shared expert)."""
        ...


class LocalDispatcher:
    """All experts live on this rank: a stable sort by expert id is the whole dispatch."""

    def dispatch(
        self, x_RD: torch.Tensor, expert_RK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, list[list[int]], Any]:
        k = expert_RK.shape[1]
        flat_M = expert_RK.reshape(-1)
        order_M = torch.argsort(flat_M, stable=True)
        counts = torch.bincount(flat_M, minlength=num_experts).tolist()
        x_MD = x_RD.index_select(0, order_M // k)
        return x_MD, [counts], order_M

    def combine(self, y_MD: torch.Tensor, weight_RK: torch.Tensor, handle: Any) -> torch.Tensor:
        order_M = handle
        r, k = weight_RK.shape
        inverse_M = torch.argsort(order_M)
        y_RKD = y_MD.index_select(0, inverse_M).view(r, k, y_MD.shape[-1])
        return combine_experts(y_RKD, weight_RK)


def combine_experts(y_RKD: torch.Tensor, weight_RK: torch.Tensor) -> torch.Tensor:
    """sum_k weight_k y_k, float32 [R, D] for bf16 expert outputs (the release accumulates them
    in float32: routing weights rounded to bf16 would move each expert's share by up to 2^-9)."""
    if y_RKD.dtype in EXACT:  # the expression float32 runs always used
        return torch.einsum("rkd,rk->rd", y_RKD, weight_RK.to(y_RKD.dtype))
    return weighted_sum(weight_RK, y_RKD, out_dtype=torch.float32)


def hash_table(vocab: int, num_experts: int, topk: int, seed: int) -> torch.Tensor:
    """Token id -> `topk` distinct experts, uniformly at random from a fixed CPU seed (the
    random-init table; a released checkpoint's `tid2eid` replaces it)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.rand(vocab, num_experts, generator=gen, device="cpu")
    return noise.topk(topk, dim=1).indices.to(torch.int64)


class Router(nn.Module):
    """sqrt(softplus) affinities s; experts by top-k of s + bias (noaux_tc) or by the token-id
    table; weights s at the chosen experts, renormalized to sum 1, x routed scaling factor.

    Buffers (persistent: loaded from and saved to checkpoints, never trained by autograd):
    `bias` [E] float32 on routed layers (the release's `gate.bias`; it only shifts WHICH experts
    win, never their weights; updated after optimizer steps only by `training/router_bias.py`),
    `tid2eid` [vocab, K] int64 on hash layers (the release's `gate.tid2eid`). `init_weights`
    draws them for a random-init run; a loaded checkpoint's values are kept as they are.
    `load` [E] float32 (not persistent) counts the routed rows per expert since the last
    `reset_load()` while `track_load` is on (training/router_bias.py turns it on), the statistic
    of the bias-update rule. Both float buffers stay float32 when the model is cast (`_apply`):
    a bf16 bias could not hold updates of 1e-3.
    """

    track_load = False

    def __init__(self, cfg: DeepseekV4Config, *, layer_idx: int, hashed: bool) -> None:
        super().__init__()
        self.num_experts = cfg.num_moe_experts
        self.topk = cfg.moe_router_topk
        self.route_scale = cfg.moe_router_topk_scaling_factor or 1.0
        # float32 gate: routing decisions flip on small logit differences.
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        self.hashed = hashed
        self.vocab_size, self.hash_seed = cfg.vocab_size, cfg.hash_seed + layer_idx
        dev = self.weight.device
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.int64, device=dev)
            )
        else:
            self.register_buffer(
                "bias", torch.zeros(self.num_experts, dtype=torch.float32, device=dev)
            )
        self.register_buffer(
            "load", torch.zeros(self.num_experts, dtype=torch.float32, device=dev), persistent=False
        )
        if not self.weight.is_meta:
            self.init_weights(cfg.init_method_std)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Random-init values: gate N(0, std), bias 0, hash table drawn from (hash_seed + layer):
        one table per hash layer so the first layers do not all send a token to the same experts.
        """
        nn.init.normal_(self.weight, std=std)
        self.init_routing_buffers()

    @torch.no_grad()
    def init_routing_buffers(self) -> None:
        if self.hashed:
            table = hash_table(self.vocab_size, self.num_experts, self.topk, self.hash_seed)
            self.tid2eid.copy_(table)  # drawn on CPU: the same table on every device
        else:
            self.bias.zero_()
        self.load.zero_()

    @torch.no_grad()
    def reset_load(self) -> None:
        self.load.zero_()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """After `to_empty`: `load` zeroed, and a V4.1 router's `bias_vl` (not checkpoint
        state: a release load fills it) zeroed until then."""
        self.reset_load()
        bias_vl = getattr(self, "bias_vl", None)
        if bias_vl is not None:
            bias_vl.zero_()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in ("bias", "bias_vl", "load"):
            buf = self._buffers.get(name)
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def forward(
        self, x_TD: torch.Tensor, routing: RoutingInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (expert_RK, weight_RK, affinity_RE) for the routed rows."""
        # Scores for every row keep the gate in the graph even when nothing is routed, so an
        # all-padding pack yields zero (not missing) gradients.
        scores_TE = torch.sqrt(F.softplus(float32_linear(x_TD, self.weight)))
        scores_RE = scores_TE.index_select(0, routing.routed_rows_R)
        if self.hashed:
            ids_R = routing.token_ids_T.index_select(0, routing.routed_rows_R)
            expert_RK = self.tid2eid.index_select(0, ids_R.long()).long()
        else:
            bias = self.bias.float()
            bias_vl = getattr(self, "bias_vl", None)
            if routing.image_R is not None and bias_vl is not None:  # image rows: bias_vl
                bias = torch.where(routing.image_R[:, None], bias_vl.float(), bias)
            biased_RE = scores_RE.detach() + bias
            expert_RK = biased_RE.topk(self.topk, dim=-1).indices
        self._count(expert_RK)
        picked_RK = scores_RE.gather(1, expert_RK)
        weight_RK = picked_RK / (picked_RK.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        return expert_RK, weight_RK, scores_RE

    @torch.no_grad()
    def _count(self, expert_RK: torch.Tensor) -> None:
        """Add this forward's rows per expert to `load` (training only). A recompute inside
        backward (activation checkpointing) is skipped, so each routed row counts once."""
        if not (self.track_load and self.training) or torch._C._current_graph_task_id() != -1:
            return
        ones = torch.ones(expert_RK.numel(), dtype=self.load.dtype, device=expert_RK.device)
        self.load.index_add_(0, expert_RK.reshape(-1).to(self.load.device), ones)


def balance_loss(
    expert_RK: torch.Tensor,
    scores_RE: torch.Tensor,
    routing: RoutingInputs,
) -> torch.Tensor:
    """Sequence-wise balance loss (DeepSeek-V3 form), one term per sample, averaged over samples.

    For sample s with T_s routed rows: f_i = E / (K T_s) * #rows choosing expert i,
    P_i = mean over its rows of the normalized affinity s_i / sum_j s_j; L_s = sum_i f_i P_i.
    Statistics are summed per segment, so a sample split over CP ranks is one sample once the
    comm reduces them; padding rows were never routed and count nowhere.
    """
    e = scores_RE.shape[1]
    k = expert_RK.shape[1]
    n = routing.num_segments
    seg_R = routing.segment_R
    probs_RE = scores_RE / (scores_RE.sum(-1, keepdim=True) + 1e-20)
    chosen_RE = torch.zeros_like(probs_RE).scatter_(1, expert_RK, 1.0)
    count_NE = probs_RE.new_zeros(n, e).index_add(0, seg_R, chosen_RE)
    prob_NE = probs_RE.new_zeros(n, e).index_add(0, seg_R, probs_RE)
    rows_N = probs_RE.new_zeros(n).index_add(0, seg_R, torch.ones_like(seg_R, dtype=probs_RE.dtype))
    count_NE, prob_NE, rows_N = _reduce_over_sequence_ranks(
        routing.layout, count_NE, prob_NE, rows_N
    )
    present_N = rows_N > 0
    denom_N = rows_N.clamp(min=1.0)
    f_NE = count_NE * (e / k) / denom_N[:, None]
    p_NE = prob_NE / denom_N[:, None]
    per_sample_N = (f_NE * p_NE).sum(-1)
    num_present = present_N.sum().clamp(min=1)
    # With no routed rows at all this is 0 * (graph-connected) = exactly zero, never NaN.
    return (per_sample_N * present_N).sum() / num_present


def _reduce_over_sequence_ranks(
    layout: RowLayout, *stats: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Sum per-segment statistics over context-parallel ranks (identity on one rank)."""
    comm = layout.comm
    if comm.size == 1:
        return stats
    reduce = getattr(comm, "all_reduce_sum", None)
    if reduce is None:
        raise NotImplementedError(
            f"{type(comm).__name__} has no all_reduce_sum: the per-sample balance loss needs "
            "per-segment statistics summed over CP ranks (autograd-aware all-reduce)"
        )
    return tuple(reduce(s) for s in stats)


class SharedExpert(nn.Module):
    """Dense clamped-SwiGLU expert applied to every row."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        f = cfg.moe_shared_expert_intermediate_size or cfg.moe_ffn_hidden_size
        self.limit = cfg.swiglu_limit
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * f, bias=False)
        self.down = nn.Linear(f, cfg.hidden_size, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down(clamped_swiglu(self.gate_up(x_TD), self.limit))


class MoE(nn.Module):
    """Routed experts (via a Dispatcher and the grouped-experts kernel seam) + one shared expert."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        *,
        layer_idx: int,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__()
        e, d, f = cfg.num_moe_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
        self.num_experts = e
        self.limit = cfg.swiglu_limit
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.hashed = layer_idx < cfg.num_hash_layers
        self.router = Router(cfg, layer_idx=layer_idx, hashed=self.hashed)
        # Stored [E, out, in] like nn.Linear and the release's per-expert w1 / w3 [F, D] and
        # w2 [D, F]: a checkpoint loads into (and exports from) contiguous rows with no transpose;
        # the grouped GEMM multiplies by the transposed views (a BLAS flag, no copy).
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))
        self.shared = SharedExpert(cfg) if cfg.moe_shared_expert_intermediate_size else None
        self.dispatcher: Dispatcher = dispatcher or LocalDispatcher()
        self.grouped_experts = resolve(GROUPED_EXPERTS)
        self.recompute_shared = "shared_experts" in selected(cfg)
        self.expert_lora: nn.Module | None = None  # LoRA of the routed experts (lora.py)
        # The base kept as released (models/common/kept_base.py): these replace w_gate_up / w_down.
        self.w_gate_up_release: ReleaseWeight | None = None
        self.w_down_release: ReleaseWeight | None = None

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.w_gate_up, std=std)
        nn.init.normal_(self.w_down, std=std)

    def forward(
        self, x_TD: torch.Tensor, routing: RoutingInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_TD, aux_loss): padding rows get only the shared expert's output."""
        expert_RK, weight_RK, scores_RE = self.router(x_TD, routing)
        x_RD = x_TD.index_select(0, routing.routed_rows_R)
        x_MD, blocks, handle = self.dispatcher.dispatch(x_RD, expert_RK, self.num_experts)
        lora = self.expert_lora
        if lora is not None and lora.release_rounding is not None:
            # quantization-aware LoRA: the merged experts as released, made inside a checkpoint
            # (the backward makes them again) and run with no adapter of their own
            def served(x: torch.Tensor) -> torch.Tensor:
                w = lora.served(base_value(self, "w_gate_up"), base_value(self, "w_down"))
                return self._routed(x, blocks, w["w_gate_up"], w["w_down"], adapters=False)

            y_MD = checkpointed(served, x_MD)
        elif self.w_gate_up_release is None:
            y_MD = self._routed(x_MD, blocks, self.w_gate_up, self.w_down)
        else:  # decoded inside a checkpoint: the backward decodes (and recomputes) again
            gate_up, down = self.w_gate_up_release, self.w_down_release

            def experts(x: torch.Tensor) -> torch.Tensor:
                return self._routed(x, blocks, gate_up(), down())

            y_MD = checkpointed(experts, x_MD)
        y_RD = self.dispatcher.combine(y_MD, weight_RK, handle)
        # Routed and shared outputs summed in float32 and rounded once (as the release's MoE).
        # index_put, not index_add: index_add's backward keeps the float32 [R, D] source alive.
        y_TD = y_RD.new_zeros(x_TD.shape).index_put((routing.routed_rows_R,), y_RD, accumulate=True)
        if self.shared is not None:
            shared = self.shared
            y_TD = y_TD + (checkpointed(shared, x_TD) if self.recompute_shared
                           else shared(x_TD)).float()  # fmt: skip
        y_TD = y_TD.to(x_TD.dtype)
        if self.hashed or not self.aux_coeff:
            # Hash routing is fixed: a balance loss could only push the gate, not the routing.
            aux = scores_RE.sum() * 0.0
        else:
            aux = balance_loss(expert_RK, scores_RE, routing) * self.aux_coeff
        return y_TD, aux

    def _routed(
        self,
        x_MD: torch.Tensor,
        blocks: list[list[int]],
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        *,
        adapters: bool = True,
    ) -> torch.Tensor:
        """The grouped experts over each block of rows (`Dispatcher.dispatch`) on its own
        (`adapters`: with the LoRA adapters beside the weights, when the experts have them).

        Under EP the blocks are the source ranks' packs. One GEMM over all of them would sum an
        expert's weight gradient over every pack's rows in one K loop, while one process sums
        each pack's gradient on its own and adds them (one micro-batch each), as the replicas of
        every other parameter are added: float32 rounds the two orders differently, and AdamW
        turns that rounding, where a gradient is near its eps, into weight differences after
        the first step. A GEMM per block sums an expert's gradient over packs as one process
        does (the same bits when each rank runs one pack a step), for one kernel call per
        source rank instead of one."""
        with_lora = adapters and self.expert_lora is not None
        lora = {"lora": self.expert_lora.kernel_args()} if with_lora else {}
        sizes = [sum(b) for b in blocks]
        parts = x_MD.split(sizes) if len(blocks) > 1 else (x_MD,)
        # Empty blocks are skipped; with no rows at all one call keeps the weights in the graph.
        kept = [i for i, n in enumerate(sizes) if n] or [0]
        ys = [self.grouped_experts(parts[i], blocks[i], w_gate_up, w_down, limit=self.limit,
                                   **lora) for i in kept]  # fmt: skip
        return ys[0] if len(ys) == 1 else torch.cat(ys)
