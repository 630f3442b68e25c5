"""DeepSeek-V4.1 language model: embedding -> 4 mHC streams -> layers (Engram, window + shared
compressed attention, MoE) -> collapse by the last FFN's pre -> norm -> LM head.

Legend: T = rows of the pack, K = hc_mult streams, D = hidden, V = vocab, L = Engram layers,
C = Engram hash columns.

The public API is DeepSeek-V4's (`DeepseekV4Model.forward`): `model(input_ids[None],
position_ids[None], packed_seq_params=PackedSeqParams(qkv_format="thd", ...), labels=...)`
returns a `ModelOutput` with `.logits` [1, T, V] (or the loss sums with labels). Packing: the
layout built from cu_seqlens restarts every new part at each sample start: compression groups and
visibility (`PoolPlan`), shared caches, selections and candidates (per-sample pools), Engram
look-back (`EngramHash.row_ids`). Padding rows get no Engram write and are never routed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from primus_v4.data.images import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START
from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v4.hyper_connection import lift_streams
from primus_v4.models.deepseek_v4.layout import RowLayout, SeqComm
from primus_v4.models.deepseek_v4.model import DeepseekV4Model, ModelOutput, _row
from primus_v4.models.deepseek_v4.moe import Dispatcher, RoutingInputs
from primus_v4.models.deepseek_v4.norm import RMSNorm
from primus_v4.models.deepseek_v41.attention import SharedCache
from primus_v4.models.deepseek_v41.block import Block
from primus_v4.models.deepseek_v41.compressor import PoolPlan
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.dspark import DraftOutput, DraftPlan, DSparkDrafter
from primus_v4.models.deepseek_v41.dspark_objective import (
    IGNORE,
    DraftTerms,
    DraftWeights,
    draft_terms,
    sample_anchors,
    slot_targets,
)
from primus_v4.models.deepseek_v41.engram import EngramHash
from primus_v4.models.deepseek_v41.vision import (
    SPAN_VECTORS,
    Aligner,
    VisionTower,
    load_image_encoder,
    vision_sizes,
)


class EngramRows(nn.Module):
    """The token map (a buffer) and the hash constants: input ids -> table rows [T, L, C].

    The map comes from the tokenizer (`set_token_map`; a loaded release sets its own). Until one
    is set, token id mod `engram_compressed_vocab_size` stands in: a random-init model then
    hashes consistently, and a pretrained table must always be given its tokenizer's map."""

    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__()
        self.hash = EngramHash.from_config(cfg)
        for layer, rows, primes in zip(
            cfg.engram_layer_ids, cfg.engram_num_embeddings, self.hash.primes, strict=True
        ):
            need = sum(p for per_n in primes for p in per_n)
            if rows < need:
                raise ConfigError(
                    f"engram_num_embeddings: layer {layer}'s table has {rows} rows but its hash "
                    f"buckets need {need} (the sum of its primes)"
                )
        self.vocab, self.range = cfg.vocab_size, cfg.engram_compressed_vocab_size
        self._map: torch.Tensor | None = None
        self.register_buffer("token_map", self._default(), persistent=False)

    def _default(self) -> torch.Tensor:
        return torch.arange(self.vocab, dtype=torch.int64) % self.range

    @torch.no_grad()
    def set_token_map(self, token_map: torch.Tensor) -> None:
        m = token_map.to(torch.int64).flatten().cpu()
        if m.numel() != self.vocab or int(m.min()) < 0 or int(m.max()) >= self.range:
            raise ValueError(
                f"Engram token map must give each of the {self.vocab} token ids a compressed id "
                f"in [0, {self.range}); got {m.numel()} ids in [{int(m.min())}, {int(m.max())}]"
            )
        self._map = m.clone()
        self.token_map = m.to(self.token_map.device)

    @torch.no_grad()
    def init_buffers(self) -> None:
        with torch.device("cpu"):
            self.token_map.copy_(self._default() if self._map is None else self._map)

    def forward(self, ids_T: torch.Tensor, seq_start_T: torch.Tensor) -> torch.Tensor:
        return self.hash.row_ids(ids_T, self.token_map, seq_start_T)


@dataclass
class SpecResult:
    """One prompt's greedy speculative decoding: the generated tokens and, per round, how many
    of the drafter's block the backbone accepted."""

    tokens: list[int]
    accepted: list[int]

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per block."""
        return sum(self.accepted) / max(len(self.accepted), 1)

    @property
    def draft_share(self) -> float:
        """The share of the generated tokens the drafter proposed (and the backbone kept)."""
        return min(sum(self.accepted), len(self.tokens)) / max(len(self.tokens), 1)


def _one_sample(n: int, device: torch.device) -> object:
    from primus_v4.mcore import megatron_import

    with megatron_import():
        from megatron.core.packed_seq_params import PackedSeqParams
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                           max_seqlen_kv=n)  # fmt: skip


class DeepseekV41Model(DeepseekV4Model):
    """The whole V4.1 text backbone on one process (float32 on the current device by default).

    Shares DeepSeek-V4's head and loss (`_head`), init rule and output type; its own layers."""

    family = "deepseek_v41"

    def __init__(
        self,
        cfg: DeepseekV41Config,
        *,
        dispatcher: Dispatcher | None = None,
        activation_checkpointing: bool | None = None,
        seed: int | None = None,
        drafter: bool = False,
    ) -> None:
        """drafter: also build the release's DSpark draft stages (`self.dspark`, dspark.py;
        the config must have them); without it they stay in the release, as before."""
        nn.Module.__init__(self)
        self.cfg = cfg
        d = cfg.hidden_size
        if activation_checkpointing is None:
            activation_checkpointing = cfg.recompute_granularity == "full"
        self.checkpoint = activation_checkpointing
        self.embedding = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, layer_idx=i, dispatcher=dispatcher) for i in range(cfg.num_layers)
        )
        self.final_norm = RMSNorm(d, cfg.layernorm_epsilon)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList()  # no MTP depth: the release's draft stages are `dspark`
        if drafter and not cfg.dspark_stages:
            raise ConfigError("drafter=True but the config has no DSpark stages (dspark_stages 0)")
        drafter = drafter or cfg.dspark_train != "off"
        self.dspark = DSparkDrafter(cfg) if drafter else None
        self.engram_rows = EngramRows(cfg) if cfg.engram_layer_ids else None
        for block in self.layers:  # image positions select experts with bias_vl (vision.py)
            router = block.moe.router
            if not router.hashed:
                dev = router.bias.device
                zeros = torch.zeros(router.num_experts, dtype=torch.float32, device=dev)
                router.register_buffer("bias_vl", zeros, persistent=False)
        # the release's image encoder (vision.py): the parts a run trains (`vision_train`) are
        # parameters under the release's names (`vision.*`, `aligner.*`, `image_*`), loaded,
        # checkpointed and exported as any other; the frozen rest is attached by
        # `set_image_encoder`, outside the module tree (not a parameter, in no checkpoint)
        self.__dict__["image_encoder"] = None
        if cfg.vision_train != "frozen":
            sizes = vision_sizes(cfg)
            if cfg.vision_train == "all":
                self.vision = VisionTower(sizes)
            self.aligner = Aligner(sizes)
            for name in SPAN_VECTORS:
                self.register_parameter(name, nn.Parameter(torch.zeros(d)))
        if not self.embedding.weight.is_meta:
            self.init_weights(seed)
        if cfg.dspark_train == "joint":  # its gradients never scale the backbone's in a clip
            self.clip_apart = {"dspark.": "draft"}
        if cfg.dspark_train == "only":  # the backbone runs forward only; checkpoints skip it
            for name, p in self.named_parameters():
                p.requires_grad_(name.startswith("dspark."))
            self.checkpoint_prefixes = ("dspark.",)

    def set_image_encoder(self, encoder: nn.Module | None) -> None:
        """The image encoder's frozen parts (a `vision.ImageEncoder`, e.g.
        `load_image_encoder(release)`, or with `vision_train: aligner` its `VisionTower`): with
        the parts the model trains they fill a row's image spans. Frozen: its parameters do not
        train; a part the model holds itself is used in its place."""
        if encoder is not None:
            encoder.requires_grad_(False)
        self.__dict__["image_encoder"] = encoder

    def _image_part(self, name: str) -> nn.Module | torch.Tensor | None:
        """`vision`, `aligner` or a span vector: the model's own (trained) or the attached."""
        own = self._modules.get(name)
        own = self._parameters.get(name) if own is None else own
        if own is not None:
            return own
        attached = self.__dict__["image_encoder"]
        if attached is None:
            attached = self._load_image_encoder()
        if attached is None:
            return None
        if isinstance(attached, VisionTower):
            return attached if name == "vision" else None
        return getattr(attached, name)

    def _load_image_encoder(self) -> nn.Module | None:
        """A model loaded from a release with a vision tower (`load_pretrained`) reads the frozen
        parts of its image encoder on first use, in the model's dtype and on its device (a
        text-only use never reads them); None for any other model."""
        source = getattr(self, "release_source", None)
        if source is None or not self.cfg.vision_config or self.cfg.vision_train == "all":
            return None
        weight = self.embedding.weight
        encoder = load_image_encoder(source, dtype=weight.dtype,
                                     tower_only=self.cfg.vision_train == "aligner")  # fmt: skip
        self.set_image_encoder(encoder.to(weight.device))
        return encoder

    def encode_image(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """patches [h * w, 3, p, p] of one image (`primus_v4.image_patches`) and its ViT grid
        (h, w) -> [cells, hidden]: the aligner's output, one row per IMAGE position of its span.
        A frozen part runs without gradients."""
        tower, aligner = self._image_part("vision"), self._image_part("aligner")
        if tower is None or aligner is None:
            raise ConfigError(
                "the model has no image encoder to encode pictures with (load it from a release "
                "with a vision tower, or set_image_encoder)"
            )
        grid = (int(grid[0]), int(grid[1]))
        frozen = not any(p.requires_grad for p in tower.parameters())
        with torch.no_grad() if frozen else contextlib.nullcontext():
            x_NC = tower(patches.to(next(tower.parameters()).device), grid)
        frozen = not any(p.requires_grad for p in aligner.parameters())
        with torch.no_grad() if frozen else contextlib.nullcontext():
            return aligner(x_NC.to(next(aligner.parameters()).dtype), grid)

    def _merge_images(
        self, x_TD: torch.Tensor, types_T: torch.Tensor, images: list | None
    ) -> torch.Tensor:
        """The embeddings of a row with image spans: each IMAGE cell the next row of the
        images' embeddings (in span order), each span delimiter its learned vector."""
        images = list(images or [])
        cells_T = types_T == IMAGE
        cells = [self.encode_image(p, g) for p, g in images]
        n = sum(c.shape[0] for c in cells)
        if n != int(cells_T.sum()):
            raise ValueError(f"token_types mark {int(cells_T.sum())} image cells but the "
                             f"{len(images)} images make {n}")  # fmt: skip
        x_TD = x_TD.index_put((cells_T.nonzero().flatten(),), torch.cat(cells).to(x_TD.dtype))
        for kind, name in ((IMAGE_START, "image_start"), (IMAGE_NEW_LINE, "image_newline"),
                           (IMAGE_END, "image_end")):  # fmt: skip
            vec = self._image_part(name)
            if vec is None:
                raise ConfigError(f"token_types mark image positions but the model has no "
                                  f"{name} (set_image_encoder)")  # fmt: skip
            vec = vec.to(device=x_TD.device, dtype=x_TD.dtype)
            x_TD = torch.where((types_T == kind)[:, None], vec, x_TD)
        return x_TD

    @staticmethod
    def _check_image_row(
        image_T: torch.Tensor, mask_T: torch.Tensor | None, layout: RowLayout
    ) -> None:
        """Images run on one process or data parallel for now; and a target inside an image
        span (its ids are placeholders) is never supervised: position t predicts t + 1 of its
        sample, so a supervised t whose t + 1 is an image position is an error, not a silent
        drop (the supervised count is made before the forward)."""
        if layout.comm.size > 1:
            raise ConfigError("rows with images under context parallelism are not supported yet")
        if mask_T is None:
            return
        start_T = layout.seq_start_T.to(image_T.device)
        next_image_T = torch.zeros_like(image_T)
        next_image_T[:-1] = image_T[1:] & (start_T[1:] == start_T[:-1])
        wrong = int(((mask_T > 0) & next_image_T).sum())
        if wrong:
            raise ValueError(f"loss_mask supervises {wrong} position(s) whose target is inside "
                             "an image span (placeholder ids): mask them")  # fmt: skip

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """The Engram token map of the tokenizer ([vocab] int64 compressed ids)."""
        if self.engram_rows is not None:
            self.engram_rows.set_token_map(token_map)

    def engram_row_ids(
        self, ids_T: torch.Tensor, layout: RowLayout, image_T: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """[T, L, C] Engram table rows of every row (offsets included), or None without Engram.

        Under context parallelism the n-gram look-back reads the previous rank's last
        max_n - 1 token ids (a sample that began there keeps its history; rows before the
        sample's start still read the pad id). Image positions (`image_T`) are dead: their own
        n-grams are all pad, and the look-back of later rows stops after them, as at a sample's
        start."""
        if self.engram_rows is None:
            return None
        halo = self.cfg.engram_max_ngram_size - 1 if layout.comm.size > 1 else 0
        if image_T is not None:
            if halo:
                raise ConfigError("images with context parallelism are not supported yet")
            rows_T = torch.arange(ids_T.shape[0], device=ids_T.device)
            dead_T = torch.where(image_T.to(ids_T.device), rows_T, -1).cummax(0).values
            return self.engram_rows(ids_T, torch.maximum(layout.seq_start_T.to(rows_T.device),
                                                         dead_T + 1))  # fmt: skip
        if not halo:
            return self.engram_rows(ids_T, layout.seq_start_T)
        ids = torch.cat([layout.comm.left_rows(ids_T, halo), ids_T])
        start = layout.seq_start_T + halo
        start = torch.cat([start.new_zeros(halo), start])  # the halo's own rows are dropped
        return self.engram_rows(ids, start)[halo:]

    def forward(  # type: ignore[override]
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
        mtp_inputs: object | None = None,
        token_types: torch.Tensor | None = None,
        images: list | None = None,
    ) -> ModelOutput:
        """token_types [1, T] (-1 text, 0-3 an image span's start, cell, new line, end) and
        images [(patches, (h, w)), ...] in the order of the spans: the row's images
        (`image_patches`, the image encoder set by `set_image_encoder`)."""
        del mtp_inputs  # no MTP depth in the V4.1 backbone
        ids_T, layout, pos_T, pad_T = self._rows(
            input_ids, position_ids, packed_seq_params, padding_mask, layout, comm
        )
        types_T = None if token_types is None else _row(token_types, "token_types").to(ids_T.device)
        image_T = None if types_T is None else types_T >= 0
        if image_T is not None and not bool(image_T.any()):
            image_T = None
        labels_T = _row(labels, "labels")
        mask_T = None if labels_T is None else self._main_mask(labels_T, loss_mask, pad_T)
        if image_T is not None:
            self._check_image_row(image_T, mask_T, layout)
        trains_draft = labels_T is not None and self.cfg.dspark_train != "off"
        if trains_draft:
            self._require_drafter(packed_seq_params)
        captured: dict[int, torch.Tensor] = {}
        frozen = self.cfg.dspark_train == "only"
        with self._capturing(captured if trains_draft else None), torch.no_grad() if frozen \
                else contextlib.nullcontext():  # fmt: skip
            x_TD = self.embedding(ids_T)
            if image_T is not None:
                x_TD = self._merge_images(x_TD, types_T, images)
            x_TKD = lift_streams(x_TD, self.cfg.hc_mult)
            h_TD, aux = self._layers(x_TKD, ids_T, pos_T, layout, pad_T, image_T)
            normed_TD = self.final_norm(h_TD)
            out = ModelOutput()
            self._head(out, normed_TD, labels_T, mask_T, mtp=False)
        if labels_T is not None:
            out.mtp_loss = aux.new_zeros(())
        out.aux_loss = aux
        if trains_draft:
            assert mask_T is not None
            main_TX = torch.cat([captured[i] for i in self.cfg.dspark_target_layer_ids], -1)
            targets_T = torch.where(mask_T.bool(), labels_T, IGNORE)
            out.draft = self._draft_terms(
                ids_T, pos_T, layout, pad_T, targets_T, main_TX.detach(), normed_TD.detach()
            )
            out.draft.objective = out.draft.objective * self.cfg.dspark_loss_weight
        return out

    @contextlib.contextmanager
    def _capturing(self, captured: dict[int, torch.Tensor] | None) -> Iterator[None]:
        """The target layers hand `captured` their input (the drafter's main states)."""
        targets = self.cfg.dspark_target_layer_ids if captured is not None else ()
        for block in self.layers:
            block.capture = captured if block.layer_idx in targets else None
        try:
            yield
        finally:
            for block in self.layers:
                block.capture = None

    def _draft_terms(
        self,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        layout: RowLayout,
        pad_T: torch.Tensor | None,
        targets_T: torch.Tensor,
        main_TX: torch.Tensor,
        normed_TD: torch.Tensor,
        *,
        seed: int | None = None,
        rate: float | None = None,
        weights: DraftWeights | None = None,
        chunk: int | None = None,
    ) -> DraftTerms:
        """The draft objective of the pack's anchors from the backbone's detached states
        (dspark_objective.py); the run's `dspark_*` fields unless given. Connected to every
        trainable drafter weight even when the pack has no anchor."""
        cfg = self.cfg
        seed = cfg.dspark_anchor_seed if seed is None else seed
        rate = cfg.dspark_anchor_rate if rate is None else rate
        weights = weights or DraftWeights(kl=cfg.dspark_kl_weight, decay=cfg.dspark_decay,
                                          confidence=cfg.dspark_confidence_weight)  # fmt: skip
        chunk = chunk or cfg.ce_chunk_size
        anchors = sample_anchors(ids_T, targets_T, layout, pad_T, seed=seed, rate=rate)
        # every drafter weight in the graph: a pack without anchors still backpropagates
        anchor_free = sum(p.sum() for p in self.dspark.parameters() if p.requires_grad) * 0.0
        b = cfg.dspark_block_size
        if anchors.numel() == 0:
            return DraftTerms(objective=anchor_free.float(), accepted_B=[0] * b,
                              targets_B=[0] * b)  # fmt: skip
        plan = DraftPlan.build(cfg, ids_T, pos_T, layout, anchors, None, pad_T)
        h_ND, markov_NR, _ = self.dspark.states(
            main_TX, pos_T, plan, embedding_weight=self.embedding.weight.detach()
        )
        rows_N, target_N, valid_N = slot_targets(anchors, targets_T, layout, b)
        terms = draft_terms(self.dspark, h_ND, markov_NR, normed_TD[rows_N], target_N, valid_N,
                            head_weight=self.lm_head.weight, block=b, weights=weights,
                            chunk=chunk)  # fmt: skip
        terms.objective = terms.objective + anchor_free
        return terms

    def draft(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        packed_seq_params: object,
        anchors: object,
        block_ids: object | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> DraftOutput:
        """The DSpark drafts of many anchors of one packed row in one pass (dspark.py):
        `.logits` [K, B, V] (`logits[k, i]` drafts the token at row anchors[k] + 1 + i) and
        `.confidence` [K, B]. `anchors`: rows of the pack (each after its sample's first token,
        never padding); `block_ids` [K, B]: the Markov head's inputs (default: the data tokens
        anchors[k] .. anchors[k] + B - 1). The packing metadata is required: without
        cu_seqlens an anchor's window would reach into the sample before it."""
        self._require_drafter(packed_seq_params)
        ids_T, layout, pos_T, pad_T = self._rows(
            input_ids, position_ids, packed_seq_params, padding_mask, None, None
        )
        main_TX, _ = self.main_hidden(ids_T, pos_T, layout, pad_T)
        plan = DraftPlan.build(self.cfg, ids_T, pos_T, layout, anchors, block_ids, pad_T)
        return self.dspark(main_TX, pos_T, plan, embedding=self.embedding, lm_head=self.lm_head)

    def main_hidden(
        self,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        layout: RowLayout,
        pad_T: torch.Tensor | None,
        *,
        final: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([T, targets x D]: for each `dspark_target_layer_ids` layer, the mean over the mHC
        streams of its input, concatenated: what the drafter reads; with `final`, the backbone's
        final normed states [T, D], else None). Runs the layers up to the last target, or all."""
        targets = self.cfg.dspark_target_layer_ids
        captured: dict[int, torch.Tensor] = {}
        blocks = list(self.layers) if final else list(self.layers)[: max(targets) + 1]
        for block in blocks:
            block.capture = captured if block.layer_idx in targets else None
        try:
            x_TKD = lift_streams(self.embedding(ids_T), self.cfg.hc_mult)
            pre_TK = torch.zeros(x_TKD.shape[:2], dtype=torch.float32, device=ids_T.device)
            pre_TK[:, 0] = 1.0
            shared = self.shared_cache(layout, ids_T.device)
            x_TKD, pre_TK, _, _ = self.run_blocks(
                blocks, x_TKD, pre_TK, shared, ids_T, pos_T, layout, pad_T
            )
        finally:
            for block in blocks:
                block.capture = None
        main_TX = torch.cat([captured[i] for i in targets], dim=-1)
        if not final:
            return main_TX, None
        return main_TX, self.final_norm(self.layers[-1].ffn_mix.collapse(x_TKD, pre_TK))

    def draft_objective(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        packed_seq_params: object,
        labels: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        seed: int = 0,
        rate: float = 1 / 16,
        weights: DraftWeights | None = None,
        chunk: int = 4096,
    ) -> DraftTerms:
        """The drafter's training objective and acceptance measures on one packed row
        (dspark_objective.py): anchors sampled among the supervised rows, the backbone run
        without gradient (its states and its own next-token distribution are what the drafter
        learns from); gradients reach only the drafter."""
        self._require_drafter(packed_seq_params)
        ids_T, layout, pos_T, pad_T = self._rows(
            input_ids, position_ids, packed_seq_params, padding_mask, None, None
        )
        labels_T = _row(labels, "labels")
        with torch.no_grad():
            main_TX, normed_TD = self.main_hidden(ids_T, pos_T, layout, pad_T, final=True)
        terms = self._draft_terms(ids_T, pos_T, layout, pad_T, labels_T, main_TX, normed_TD,
                                  seed=seed, rate=rate, weights=weights or DraftWeights(),
                                  chunk=chunk)  # fmt: skip
        return terms

    @torch.no_grad()
    def speculative_decode(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> SpecResult:
        """Greedy speculative decoding of one prompt with the DSpark drafter, as a server runs
        it: the backbone generates greedily; each round the drafter proposes a block after the
        last token (its own argmax chain feeding the Markov head), the backbone verifies it in
        one pass, the longest matching prefix is kept and the backbone's next token added. The
        text is the backbone's own greedy continuation (speculation is lossless); the accepted
        lengths measure the drafter."""
        tokens = [int(t) for t in torch.as_tensor(prompt_ids).flatten()]
        if len(tokens) < 2:
            raise ValueError("speculative_decode: the prompt needs at least 2 tokens")
        b, start, accepted = self.cfg.dspark_block_size, len(tokens), []
        while len(tokens) - start < max_new_tokens:
            ids = torch.tensor(tokens, device=self.embedding.weight.device)
            psp = _one_sample(len(tokens), ids.device)
            a = len(tokens) - 1
            ids_T, layout, pos_T, _ = self._rows(ids[None], None, psp, None, None, None)
            main_TX, _ = self.main_hidden(ids_T, pos_T, layout, None)
            plan = DraftPlan.build(self.cfg, ids_T, pos_T, layout, [a])
            h_ND, _, _ = self.dspark.states(main_TX, pos_T, plan,
                                            embedding_weight=self.embedding.weight)  # fmt: skip
            drafts = self.dspark.greedy_chain(h_ND, tokens[a], self.lm_head.weight)
            check = torch.tensor(tokens + drafts, device=ids.device)
            verdict = self(check[None], packed_seq_params=_one_sample(len(check), ids.device))
            greedy = verdict.logits[0, a:].argmax(-1).tolist()  # the backbone after a, a+1, ...
            n = 0
            while n < b and drafts[n] == greedy[n]:
                n += 1
            accepted.append(n)
            tokens += [*drafts[:n], greedy[n]]
        generated = tokens[start : start + max_new_tokens]
        return SpecResult(tokens=generated, accepted=accepted)

    def _require_drafter(self, packed_seq_params: object) -> None:
        if self.dspark is None:
            raise ConfigError(
                "draft: this model was built without its DSpark drafter (build it with "
                "drafter=True, or load_pretrained(..., drafter=True))"
            )
        if getattr(packed_seq_params, "cu_seqlens_q", None) is None:
            raise ValueError(
                "draft: packed_seq_params with cu_seqlens_q is required (the sample boundaries: "
                "without them an anchor's window would attend across samples)"
            )

    def _layers(
        self,
        x_TKD: torch.Tensor,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        layout: RowLayout,
        pad_T: torch.Tensor | None,
        image_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers, then the collapse of the streams by the last FFN's pre."""
        pre_TK = torch.zeros(x_TKD.shape[:2], dtype=torch.float32, device=ids_T.device)
        pre_TK[:, 0] = 1.0
        shared = self.shared_cache(layout, ids_T.device)
        x_TKD, pre_TK, _, aux = self.run_blocks(
            self.layers, x_TKD, pre_TK, shared, ids_T, pos_T, layout, pad_T, image_T=image_T
        )
        return self.layers[-1].ffn_mix.collapse(x_TKD, pre_TK), aux

    def shared_cache(self, layout: RowLayout, device: torch.device) -> SharedCache:
        """An empty shared cache with the pool plans of every compressed ratio of the pack."""
        ratios = sorted({r for r in self.cfg.compress_ratios if r})
        return SharedCache(plans={r: PoolPlan.build(layout, r, device) for r in ratios})

    def run_blocks(
        self,
        blocks: Iterable[nn.Module],
        x_TKD: torch.Tensor,
        pre_TK: torch.Tensor,
        shared: SharedCache,
        ids_T: torch.Tensor,
        pos_T: torch.Tensor,
        layout: RowLayout,
        pad_T: torch.Tensor | None,
        *,
        image_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, SharedCache, torch.Tensor]:
        """`blocks` in order (all of them, or one pipeline stage's): (streams, last FFN pre,
        shared cache, summed balance loss). `image_T`: the image positions (routed with
        `bias_vl`, no Engram write)."""
        dev = ids_T.device
        routing = RoutingInputs.build(ids_T, layout, pad_T, image_T)
        blocks = list(blocks)
        rows_TLC = None
        if any(b.engram is not None for b in blocks):
            rows_TLC = self.engram_row_ids(ids_T, layout, image_T)
        keep_T = None if pad_T is None else ~pad_T.to(dev).bool()
        if image_T is not None:
            keep_T = ~image_T.to(dev) if keep_T is None else keep_T & ~image_T.to(dev)
        aux = x_TKD.new_zeros((), dtype=torch.float32)
        engram_ids = self.cfg.engram_layer_ids
        for block in blocks:
            rows = None
            if block.engram is not None:
                rows = rows_TLC[:, engram_ids.index(block.layer_idx)]
            kwargs = dict(positions_T=pos_T, layout=layout, routing=routing, shared=shared,
                          engram_rows_TC=rows, engram_mask_T=keep_T)  # fmt: skip
            if self.checkpoint and torch.is_grad_enabled():
                res = torch.utils.checkpoint.checkpoint(
                    block, x_TKD, pre_TK, use_reentrant=False, **kwargs
                )
            else:
                res = block(x_TKD, pre_TK, **kwargs)
            x_TKD, pre_TK, shared, layer_aux = res
            aux = aux + layer_aux
        return x_TKD, pre_TK, shared, aux
