"""Per-rank memory plan of a run before it is launched (`primus-v4 inspect memory`).

Static terms come from the model built on the meta device and cut like the trainer cuts it
(pipeline stage, experts / ep) and from the optimizer's layout (training.optim.zero): weights in the
model dtype; fp32 gradient buckets (full size, plus this rank's reduced shard when replicas > 1;
fp64 ones plus an fp32 copy of the shard with `optim.grad_reduce_dtype: float64`);
fp32 masters (none for float32 parameters: they are their own masters) and two fp32 moments for
this rank's 1/n chunk, split device / host by `optim.offload_fraction`.

Activations are the tensors autograd saves for backward, counted from the model code per layer
part (`models/common/activations.py` and the family's own terms: each saved tensor's shape and
dtype, the recompute choice's parts removed) and checked against measurements at Flash width in bf16
(`benchmarks/bench_activation_width.py`). Pipeline stages hold the activations of
min(micro-batches, pp - stage) micro-batches (1F1B); full recompute keeps each layer's input
streams; the backward of one layer holds that layer's whole set again (its recompute). The LM
head + CE (kernels/linear_ce.py) is counted from its code: per CE call it saves
d/dh [T, D] and an fp32 d/dW [V, D]; a chunk's fp32 logits [C, V] and one [V, D] fp32 product
are transient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from primus_v4.config.resolve import vision_held
from primus_v4.kernels.saved_sets import planned_attention_backend
from primus_v4.models import spec_of
from primus_v4.models.common.activations import (
    head_bytes,
    kept,
    layer_flops,
    layer_parts,
    mtp_extra,
    recompute_flops,
    step_flops,
)
from primus_v4.models.common.recompute import selected
from primus_v4.parallel.data_parallel import BUCKET_BYTES
from primus_v4.parallel.pipeline_layout import plan_stages
from primus_v4.training.build import assemble
from primus_v4.training.optim.zero import pick_offloaded

GIB = 2**30


@dataclass(kw_only=True)
class MemoryPlan:
    """Bytes per rank: `rows` (name, device bytes, host bytes, phase) and totals.

    phase: `static` (held all step), `backward` (activations and the forward/backward
    transients) or `step` (the optimizer step's buffers); the two transient phases never
    overlap, so the peak is static + the larger of them.
    """

    stage: int
    rows: list[tuple[str, float, float, str]] = field(default_factory=list)
    device_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    attention: str = ""
    """Whose saved set the sparse attention rows count, and why (the same for every stage)."""

    def add(self, name: str, device: float, host: float = 0.0, *, phase: str = "static") -> None:
        self.rows.append((name, float(device), float(host), phase))

    def _peak(self, column: int) -> float:
        by_phase = {"static": 0.0, "backward": 0.0, "step": 0.0}
        for row in self.rows:
            by_phase[row[3]] += row[column]
        return by_phase["static"] + max(by_phase["backward"], by_phase["step"])

    @property
    def device_total(self) -> float:
        return self._peak(1)

    @property
    def host_total(self) -> float:
        return self._peak(2)

    def table(self) -> str:
        lines = [f"pipeline stage {self.stage}: {'':40} {'device GiB':>11} {'host GiB':>10}"]
        for name, d, h, phase in self.rows:
            tag = "" if phase == "static" else f" [{phase}]"
            lines.append(f"  {name + tag:<54} {d / GIB:>11.3f} {h / GIB:>10.3f}")
        dev, host = self.device_total / GIB, self.host_total / GIB
        lines.append(f"  {'peak (static + larger transient phase)':<54} {dev:>11.3f} {host:>10.3f}")
        if self.device_bytes:
            share = 100 * self.device_total / self.device_bytes
            lines.append(
                f"  device memory {self.device_bytes / GIB:.0f} GiB: plan uses {share:.1f}%"
            )
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def _dtype_bytes(run: Any) -> int:
    return 2 if run.cfg.model.dtype == "bfloat16" else 4


def _stage_of(name: str, specs: list[Any], has_mtp: bool) -> set[int]:
    """Stages holding parameter `name` (the MTP embedding copy sits on the first and last)."""
    last = len(specs) - 1
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return {s.index for s in specs if layer in s.decoder_layers}
    if name.startswith("embedding."):
        return {0, last} if has_mtp else {0}
    return {last}


class _Param(NamedTuple):
    name: str
    numel: int  # on this rank (an expert shard: its experts)
    expert: bool  # sharded over EP: its state is sharded over expert-DP
    tied: bool  # the pipeline-tied embedding (its bucket stays float32)
    trainable: bool  # frozen ones (the indexer; a LoRA run's base) are weights only
    owned: bool = False  # held by one rank only (sharded Engram rows): no replicas to shard over


@dataclass
class _Kept:
    """A stage's base weights kept as released (`model.lora.base: release`)."""

    stored: int = 0  # code and scale bytes
    decoded: dict[str, int] = field(default_factory=dict)  # layer -> decoded expert bytes
    biggest: int = 0  # the largest other decoded weight, in bytes

    def rows(self, plan: MemoryPlan) -> None:
        if not self.stored:
            return
        plan.add("base weights as released (FP8 / FP4 + ue8m0 scales)", self.stored)
        # A layer's experts decode together inside their checkpoint (forward and the
        # backward's recompute), next to at most one other decoded weight.
        in_use = max(self.decoded.values(), default=0) + self.biggest
        plan.add("decoded base weights in use (one layer's experts + one linear)", in_use,
                 phase="backward")  # fmt: skip


def _count_kept(model: Any, kept: list[_Kept], specs: list[Any], has_mtp: bool, *, ep: int,
                b: int) -> None:  # fmt: skip
    for name, module in model.named_modules():
        if not hasattr(module, "stored_parts"):  # release_base.ReleaseWeight
            continue
        expert = name.endswith(("w_gate_up_release", "w_down_release"))
        share = ep if expert else 1
        for s in _stage_of(f"{name}.q", specs, has_mtp):
            kept[s].stored += module.nbytes() // share
            decoded = math.prod(module.shape) // share * b
            if expert:
                layer = name.rsplit(".", 2)[0]
                kept[s].decoded[layer] = kept[s].decoded.get(layer, 0) + decoded
            else:
                kept[s].biggest = max(kept[s].biggest, decoded)


@dataclass
class _QuantBytes:
    """A stage's extra memory under `train.quant_aware: release` (models/common/quant_aware.py),
    in bytes: `rounded` the release rounding of the weights it swaps in, held beside the
    full-precision ones for the step; under LoRA, `served` the served weights of the adapted
    linears and wo_a, which their matmuls save for the backward, and `unit` the values of the
    largest weight merged at once (a layer's routed experts, inside their checkpoint, or one
    linear); `scratch` the values of the largest weight rounded at once (on its device, by the
    kernel seam's `release_round`)."""

    rounded: int = 0
    served: int = 0
    unit: int = 0
    scratch: int = 0

    def rows(self, plan: MemoryPlan, b: int) -> None:
        if self.rounded:
            plan.add("quant_aware: weights as released, beside full precision", self.rounded,
                     phase="backward")  # fmt: skip
        if self.served:
            plan.add("quant_aware LoRA: served weights saved for backward", self.served,
                     phase="backward")  # fmt: skip
        if self.unit:  # fp32 merge + its rounding, the served copy and its gradient (+ fp32)
            plan.add("quant_aware LoRA: one weight merged, rounded, its grad", self.unit *
                     (12 + 2 * b), phase="backward")  # fmt: skip
        if self.scratch:  # the torch reference's float32 temporaries (the Triton kernel: 1)
            plan.add("quant_aware: rounding one weight, <= 8 fp32 temporaries", 32 * self.scratch,
                     phase="backward")  # fmt: skip


def _count_quant(model: Any, run: Any, specs: list[Any], has_mtp: bool,
                 quant: list[_QuantBytes]) -> None:  # fmt: skip
    """Fill `quant` (per stage) from the release rounding the trainer would build."""
    rounding = spec_of(run.model).release.release_rounding(model, run.model)
    b = _dtype_bytes(run)
    for w in rounding.weights:
        numel = w.param.numel() // (run.sizes.ep if _is_expert_shard(w.name, run.cfg.model.lora)
                                    else 1)  # fmt: skip
        for s in _stage_of(w.name, specs, has_mtp):
            quant[s].rounded += numel * w.param.element_size()
            quant[s].scratch = max(quant[s].scratch, numel)
    experts: dict[tuple[int, str], int] = {}
    for m in rounding.merged:
        owner = m.name.rpartition(".")[0]
        parent = model.get_submodule(owner) if owner else model
        if hasattr(m.module, "in_features"):  # an adapted linear
            sizes = [m.module.in_features * m.module.out_features]
        else:  # wo_a, or the routed experts (this rank's 1 / ep of them)
            ep = run.sizes.ep if m.name.endswith(".expert_lora") else 1
            sizes = [math.prod(getattr(parent, f"{a}_release").shape) // ep for a in m.rounding]
        for s in _stage_of(m.name, specs, has_mtp):
            if m.name.endswith(".expert_lora"):
                experts[s, owner] = experts.get((s, owner), 0) + sum(sizes)
            else:
                quant[s].served += sum(sizes) * b
            quant[s].unit = max(quant[s].unit, *sizes)
            quant[s].scratch = max(quant[s].scratch, *sizes)
    for (s, _), n in experts.items():
        quant[s].unit = max(quant[s].unit, n)


@dataclass
class _EngramBytes:
    """A stage's frozen Engram tables at their placement (`model.engram`), per rank."""

    stored: float = 0.0  # FP8 codes + e8m0 scales this rank holds
    ranks: int = 1  # ranks the rows are spread over (sharded)

    def rows(self, plan: MemoryPlan, engram: Any) -> None:
        if not self.stored:
            return
        if engram.placement == "host":
            plan.add("Engram tables, FP8 + e8m0, in host memory", 0, self.stored)
            return
        where = f"sharded over {self.ranks} ranks" if self.ranks > 1 else "replicated"
        plan.add(f"Engram tables, FP8 + e8m0 ({where})", self.stored)


def _engram_param(name: str, p: Any, run: Any, specs: list[Any],
                  per_stage: list[list[_Param]], engram: list[_EngramBytes]) -> None:  # fmt: skip
    """An Engram table where `model.engram` puts it: frozen, its release encoding (1 byte per
    value + one e8m0 byte per 32) replicated, sharded over the stage's ranks or on the host;
    trainable (sharded or replicated), a parameter whose optimizer state covers the rows held."""
    cfg, sizes = run.cfg.model.engram, run.sizes
    ranks = sizes.world // sizes.pp if cfg.placement == "sharded" else 1
    for s in _stage_of(name, specs, False):
        if cfg.trainable:
            numel = math.ceil(p.numel() / ranks)
            per_stage[s].append(_Param(name, numel, False, False, True, owned=ranks > 1))
        else:
            engram[s].stored += math.ceil(p.numel() / ranks) * 33 / 32
            engram[s].ranks = ranks


def _is_expert_shard(name: str, lora: Any) -> bool:
    """Expert weights, and per-expert LoRA adapters, are cut [E, ...] -> [E / ep, ...]."""
    last = name.rsplit(".", 1)[-1]
    if last in ("w_gate_up", "w_down"):
        return True
    return ".expert_lora." in name and lora.expert_adapters == "per_expert"


def _static_rows(plan: MemoryPlan, run: Any, everything: list[_Param]) -> None:
    """Weights of all of one stage's parameters; gradient buckets, masters and moments of its
    trainable ones."""
    sizes, cfg, d = run.sizes, run.cfg, _dtype_bytes(run)
    dp_cp = sizes.world // (sizes.pp * sizes.cp) * sizes.cp
    expert_dp = sizes.world // (sizes.ep * sizes.pp)
    weights = sum(p.numel for p in everything) * d
    params = [p for p in everything if p.trainable]
    lean = cfg.optim.grad_accum_dtype == "bfloat16"
    chunks, padded, shards = [], 0, 0
    lean_padded = lean_shards = lean_alone = 0  # bf16 buckets; their fp32 shards / copies
    for _, numel, expert, tied, _, owned in params:
        n = 1 if owned else expert_dp if expert else dp_cp
        c = math.ceil(numel / n)
        chunks.append(c)
        if lean and not tied:  # the tied embedding's bucket stays float32
            lean_padded += n * c
            lean_shards += c if n > 1 else 0
            lean_alone += c if n == 1 else 0
            continue
        padded += n * c
        shards += c if n > 1 else 0
    host = pick_offloaded(chunks, cfg.optim.offload_fraction)
    on_host = sum(chunks[i] for i in host)
    on_dev = sum(chunks) - on_host
    plan.add(f"weights ({cfg.model.dtype})", weights)
    if cfg.optim.grad_reduce_dtype == "float64":  # float64 buckets and shard, an fp32 copy
        plan.add("fp64 gradient buckets (+ reduced shard, fp32 copy)",
                 8 * (padded + shards) + 4 * sum(chunks))  # fmt: skip
    elif padded:
        plan.add("fp32 gradient buckets (+ reduced shard)", 4 * (padded + shards))
    if lean:
        plan.add("bf16 gradient buckets", 2 * lean_padded)
        if lean_shards:  # reduce-scattered as backward finishes each bucket
            plan.add("fp32 reduced shards of bf16 buckets", 4 * lean_shards, phase="backward")
            plan.add("fp32 copy of one bf16 bucket being reduced",
                     min(4 * lean_padded, 2 * BUCKET_BYTES), phase="backward")  # fmt: skip
        # Without replicas the float32 gradient AdamW steps on exists only for the step.
        plan.add("fp32 copies of unreplicated bf16 buckets (the step) + reduced shards",
                 4 * (lean_alone + lean_shards), phase="step")  # fmt: skip
    if d != 4:
        plan.add("fp32 master chunks", 4 * on_dev, 4 * on_host)
    elif on_host:
        plan.add("fp32 master chunks (host copies)", 0, 4 * on_host)
    plan.add("fp32 Adam moments (2 per chunk)", 8 * on_dev, 8 * on_host)
    biggest = max(p[1] for p in params)
    # A parameter's own-dtype gradient lives until its hook adds it to the bucket.
    plan.add("one parameter's own-dtype gradient", biggest * d, phase="backward")
    # The step: AdamW's denominator temporary of the largest chunk; the all-gather after it holds
    # one bucket's send and receive buffers (a bucket closes past BUCKET_BYTES of fp32 grads).
    bucket = min(weights, BUCKET_BYTES * d / 4 + biggest * d)
    n = max(dp_cp, expert_dp)
    gather = bucket * (1 + 1 / n) if n > 1 else 0.0
    plan.add("AdamW temporary + weight all-gather buffers", 4 * max(chunks) + gather, phase="step")


def saved_parts(cfg: Any, layer: int | None, *, rows: int, seq: int, b: int,
                attention_backend: str = "torch") -> dict[str, float]:  # fmt: skip
    """Saved bytes by part of decoder layer `layer`, or of an MTP depth (None)."""
    kw = {"rows": rows, "seq": seq, "b": b, "attention_backend": attention_backend}
    if layer is None:
        parts = layer_parts(cfg, cfg_kind(cfg, None), **kw)
        for name, v in mtp_extra(cfg, rows=rows, b=b).items():
            parts[name] = parts.get(name, 0.0) + v
        return parts
    return spec_of(cfg).memory.layer_parts(cfg, layer, **kw)


def layer_role(cfg: Any, layer: int) -> str:
    """How the plan groups layer `layer`: its family's role for it (`MemoryTerms.layer_role`)."""
    return spec_of(cfg).memory.layer_role(cfg, layer)


def cfg_kind(cfg: Any, layer: int | None) -> str:
    kinds = spec_of(cfg).layer_kinds
    return cfg.layer_kind(layer) if layer is not None else kinds[cfg.mtp_compress_ratio]


def in_flight(micro_batches: int, pp: int, stage: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once (GPipe: all of them)."""
    if pp == 1:
        return 1
    return min(micro_batches, pp - stage) if micro_batches >= pp else micro_batches


def activation_rows(plan: MemoryPlan, cfg: Any, spec: Any, *, seq: int, cp: int, b: int,
                    held: int, supervised_fraction: float = 1.0,
                    attention_backend: str = "torch", head_trains: bool = True,
                    experts_rebuilt: bool = False) -> None:  # fmt: skip
    """The backward-phase rows of one stage: saved activations of its layers for `held`
    micro-batches in flight, one layer's backward working set, the head and CE (a frozen head,
    as in a LoRA run, makes no fp32 dW). `experts_rebuilt`: the routed experts run inside a
    checkpoint (a LoRA base kept as released), saving only their dispatched input."""
    t = seq // cp
    full_recompute = getattr(cfg, "recompute_granularity", None) == "full"
    chosen = selected(cfg)
    layers: list[int | None] = [*spec.decoder_layers, *([None] * len(spec.mtp_depths))]
    full: list[float] = []
    kept_: list[float] = []
    by_kind: dict[str, list[float]] = {}
    for layer in layers:
        parts = saved_parts(cfg, layer, rows=t, seq=seq, b=b, attention_backend=attention_backend)
        full.append(sum(parts.values()))
        kept_.append(kept(parts, chosen))
        if experts_rebuilt and "moe" not in chosen:  # only x [rows x top-k, D] stays
            routed_in = t * cfg.moe_router_topk * cfg.hidden_size * b
            kept_[-1] -= max(parts.get("experts", 0.0) - routed_in, 0.0)
        each = t * cfg.hc_mult * cfg.hidden_size * b if full_recompute else kept_[-1]
        kind = "mtp" if layer is None else layer_role(cfg, layer)
        by_kind.setdefault(kind, []).append(each)
    what = "input streams (full recompute)" if full_recompute else "saved activations"
    if chosen:
        what += f" (recompute {','.join(sorted(chosen))})"
    for kind in sorted(by_kind):
        n = len(by_kind[kind])
        plan.add(f"{n} {kind} layers: {what} x {held} micro-batch", sum(by_kind[kind]) * held,
                 phase="backward")  # fmt: skip
    if full:
        # The layer in backward: its recomputed parts again (a full recompute: its whole set),
        # plus the attention backward's gradients (the output's, its group and RoPE copies, dq
        # and the kernel's row chunks: about 5 x [T, H x hd], bench_activation_width.py).
        again = (
            max(full) if full_recompute else max(f - k for f, k in zip(full, kept_, strict=True))
        )
        grads = 5 * t * cfg.num_attention_heads * cfg.kv_channels * b
        label = " + its recompute" if again else ""
        plan.add(f"backward working set (one layer{label})", again + grads, phase="backward")
    family_rows = spec_of(cfg).memory.stage_rows
    for name, value in family_rows(cfg, list(spec.decoder_layers), seq=seq, t=t, held=held):
        plan.add(name, value, phase="backward")
    if spec.has_loss:
        calls = 1 + len(spec.mtp_depths)
        v, dim = cfg.vocab_size, cfg.hidden_size
        dw = v * dim * 4 if head_trains else 0
        saved = head_bytes(cfg, rows=t, b=b) + calls * (t * dim * b + dw)
        what = "d/dh [T, D] + fp32 dW [V, D]" if head_trains else "d/dh [T, D] (head frozen)"
        plan.add(f"head, CE: {calls} calls save {what} + streams", held * saved,
                 phase="backward")  # fmt: skip
        rows = max(1, round(t * supervised_fraction))
        chunk = min(cfg.ce_chunk_size, rows)
        # ChunkedLinearCE's loop still holds the previous chunk's [C, V] while the next is made.
        two = 2 if rows > chunk else 1
        product = " + dW product" if dw else ""
        plan.add(f"CE transient: {two} x fp32 logits [{chunk}, V]{product}",
                 two * chunk * v * 4 + dw, phase="backward")  # fmt: skip
    plan.notes.append(recompute_note(cfg, layers, seq=seq))


def recompute_note(cfg: Any, layers: list[int | None], *, seq: int) -> str:
    """Extra forward FLOPs the stage's recompute costs, relative to its step without it."""
    full_recompute = getattr(cfg, "recompute_granularity", None) == "full"
    chosen = selected(cfg)
    extra = base = 0.0
    for layer in layers:
        flops = layer_flops(cfg, cfg_kind(cfg, layer), seq=seq)
        base += step_flops(flops)
        extra += sum(flops.values()) if full_recompute else recompute_flops(flops, chosen)
    if not extra:
        return "recompute: none"
    return (
        f"recompute: +{100 * extra / base:.1f}% of the layers' step FLOPs (forward "
        f"{extra / max(len(layers), 1) / 1e9:.3f} GFLOP per token per layer again)"
    )


def _image_rows(plan: MemoryPlan, run: Any) -> None:
    """A release with a vision tower: its frozen parts on every rank, in the model's dtype
    (loaded when the packs hold images; counted always, the worst case), the encoding of the
    largest image through a frozen tower, and what the trained parts save for backward (a row
    all image tokens, the worst case). The trained parts' weights, gradients and optimizer state
    are the model's own parameters, counted above."""
    train, b = vision_held(run.cfg)[0], _dtype_bytes(run)  # LoRA targets on it: held too
    terms = spec_of(run.model).memory.image_encoder(run.cfg.model.pretrained, b=b, train=train)
    if terms is None:
        return
    if terms.frozen_params:
        what = "frozen" if train == "frozen" else "frozen tower"
        plan.add(f"image encoder ({what})", terms.frozen_params * b)
    if terms.transient:
        plan.add("encoding the largest image (no gradient)", terms.transient, phase="backward")
    if terms.saved_per_token:
        tokens = run.cfg.data.seq_length // run.sizes.cp
        plan.add(f"image encoder activations x {tokens} tokens",
                 terms.saved_per_token * tokens + terms.saved_scores, phase="backward")  # fmt: skip
    plan.notes.append(f"image encoder: {terms.frozen_params / 1e6:.1f}M frozen parameters held in "
                      f"{run.cfg.model.dtype} ({vision_held(run.cfg)[1]}), loaded when the packs "
                      "hold images and counted even for a corpus without; activations of a row "
                      "all image tokens (the worst case)")  # fmt: skip


def plan_memory(
    run: Any,
    *,
    device_gb: float | None = None,
    supervised_fraction: float = 1.0,
    attention_backend: str | None = None,
) -> list[MemoryPlan]:
    """One `MemoryPlan` per pipeline stage for the resolved `run` (its world size and layout).
    `supervised_fraction` of a pack's rows reach the LM head (1.0: the worst case). The sparse
    attention's saved set is `attention_backend`'s (None: the one `planned_attention_backend`
    names: an accelerator's when `device_gb` is given, this machine's otherwise)."""
    cfg, sizes = run.model, run.sizes
    why = "as asked"
    if attention_backend is None:
        attention_backend, why = planned_attention_backend(
            for_accelerator=device_gb is not None, heads=cfg.num_attention_heads,
            head_dim=cfg.kv_channels, b=_dtype_bytes(run),
        )  # fmt: skip
    # on meta: FP8 / FP4 bytes in place of a kept base's parameters, adapters on a frozen base
    model = assemble(cfg, run.cfg.model, seed=0).model
    specs = plan_stages(pp=sizes.pp, num_layers=cfg.num_layers,
                        mtp_num_layers=cfg.mtp_num_layers or 0,
                        layout=run.cfg.parallel.pp_layout)  # fmt: skip
    has_mtp = bool(cfg.mtp_num_layers)
    lora = run.cfg.model.lora
    kept = [_Kept() for _ in specs]
    if lora.keeps_release:
        _count_kept(model, kept, specs, has_mtp, ep=sizes.ep, b=_dtype_bytes(run))
    quant = [_QuantBytes() for _ in specs]
    if run.cfg.train.quant_aware != "none":
        _count_quant(model, run, specs, has_mtp, quant)
    per_stage: list[list[_Param]] = [[] for _ in specs]
    engram = [_EngramBytes() for _ in specs]
    for name, p in model.named_parameters():
        if name.endswith(".engram.table"):
            _engram_param(name, p, run, specs, per_stage, engram)
            continue
        expert = sizes.ep > 1 and _is_expert_shard(name, run.cfg.model.lora)
        numel = p.numel() // (sizes.ep if expert else 1)
        stages = _stage_of(name, specs, has_mtp)
        for s in stages:
            per_stage[s].append(_Param(name, numel, expert, len(stages) > 1, p.requires_grad))
    dp = sizes.world // (sizes.pp * sizes.cp)
    micro = run.cfg.train.global_batch_size // dp
    plans = []
    for spec, params in zip(specs, per_stage, strict=True):
        plan = MemoryPlan(stage=spec.index,
                          device_bytes=device_gb * GIB if device_gb else None)  # fmt: skip
        _static_rows(plan, run, params)
        engram[spec.index].rows(plan, run.cfg.model.engram)
        kept[spec.index].rows(plan)
        quant[spec.index].rows(plan, _dtype_bytes(run))
        activation_rows(plan, cfg, spec, seq=run.cfg.data.seq_length, cp=sizes.cp,
                        b=_dtype_bytes(run), held=in_flight(micro, sizes.pp, spec.index),
                        supervised_fraction=supervised_fraction,
                        attention_backend=attention_backend,
                        head_trains=not lora.rank,
                        experts_rebuilt=lora.keeps_release)  # fmt: skip
        _image_rows(plan, run)
        plan.attention = f"sparse attention saved as {attention_backend}'s: {why}"
        plans.append(plan)
    return plans
