"""Per-rank memory plan of a run before it is launched (`primus-v4 inspect memory`).

Static terms come from the model built on the meta device and cut like the trainer cuts it
(pipeline stage, experts / ep) and from the optimizer's layout (training.zero): weights in the
model dtype; fp32 gradient buckets (full size, plus this rank's reduced shard when replicas > 1;
fp64 ones plus an fp32 copy of the shard with `optim.grad_reduce_dtype: float64`);
fp32 masters (none for float32 parameters: they are their own masters) and two fp32 moments for
this rank's 1/n chunk, split device / host by `optim.offload_fraction`.

Activations are the tensors autograd saves for backward, per token, per layer kind and role,
MEASURED on CPU (`measure_saved_bytes`: the tiny preset in float32, one sample filling the row,
saved-tensor hooks attributing every saved storage once to the innermost module running) at one
sequence length and scaled as bytes/token = constant x unit(cfg) x dtype_bytes / 4, where
unit is the role's width (attention: heads x head dim, MoE: top-k x expert ffn, mHC: streams x
hidden, ...). That scaling assumes each role's saved tensors grow with its width, which holds for
projections and elementwise math; terms that grow with other dimensions (sparse top-k, window)
are where a Flash-sized plan is least certain. Pipeline stages hold the activations of
min(micro-batches, pp - stage) micro-batches (1F1B); full recompute keeps each layer's input
streams plus one layer's activations. The LM head + CE (models/deepseek_v4/linear_ce.py) is counted
from its code: per CE call it saves d/dh [T, D] and an fp32 d/dW [V, D]; a chunk's fp32 logits
[C, V] and one [V, D] fp32 product are transient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from primus_v4.data.packed_corpus import layout, to_thd_batch
from primus_v4.data.thd import to_packed_seq_params
from primus_v4.models.deepseek_v4 import DeepseekV4Model
from primus_v4.parallel.data_parallel import BUCKET_BYTES
from primus_v4.parallel.pipeline_layout import plan_stages
from primus_v4.training.trainer import build_model
from primus_v4.training.zero import pick_offloaded

GIB = 2**30
DEVICES_GB = {"MI300X": 192.0, "MI308X": 192.0, "MI355X": 288.0}

# (kind, role) -> saved bytes per token per unit of the role's width, float32. Measured with
# `python benchmarks/bench_memory_plan.py --measure` (`fit_constants`: tiny preset, vocab 512,
# one sample filling a 4096-token row, recompute off). Roles split a layer's storages by the
# module that saved them first; only a layer's sum is physical.
SAVED_BYTES: dict[tuple[str, str], float] = {
    ("csa", "attention"): 18.406,
    ("csa", "block"): 13.281,
    ("csa", "compressor"): 24.867,
    ("csa", "moe"): 44.813,
    ("csa", "norm"): 24.266,
    ("csa", "router"): 35.5,
    ("csa", "shared"): 24.0,
    ("dense", "attention"): 18.156,
    ("dense", "block"): 13.281,
    ("dense", "moe"): 44.625,
    ("dense", "norm"): 24.25,
    ("dense", "router"): 36.5,
    ("dense", "shared"): 24.0,
    ("hca", "attention"): 18.289,
    ("hca", "block"): 13.281,
    ("hca", "compressor"): 16.511,
    ("hca", "moe"): 44.688,
    ("hca", "norm"): 24.282,
    ("hca", "router"): 35.5,
    ("hca", "shared"): 24.0,
    ("model", "model"): 6.3281,
    ("model", "norm"): 8.0625,
    ("mtp", "attention"): 18.156,
    ("mtp", "block"): 13.281,
    ("mtp", "moe"): 44.813,
    ("mtp", "mtp"): 6.2656,
    ("mtp", "norm"): 44.438,
    ("mtp", "router"): 36.5,
    ("mtp", "shared"): 24.0,
}


def _unit(cfg: Any, role: str) -> int:
    units = {
        "attention": cfg.num_attention_heads * cfg.kv_channels,
        "compressor": cfg.kv_channels,
        "indexer": (cfg.index_n_heads or 1) * (cfg.index_head_dim or 1),
        "moe": (cfg.moe_router_topk or 1) * (cfg.moe_ffn_hidden_size or 1),
        "shared": cfg.moe_shared_expert_intermediate_size or 1,
        "router": cfg.num_moe_experts or 1,
        "norm": cfg.hidden_size,
    }
    return units.get(role, cfg.hc_mult * cfg.hidden_size)  # mHC, block, MTP projections


_ROLE_OF_CLASS = {
    "Attention": "attention",
    "Compressor": "compressor",
    "Indexer": "indexer",
    "MoE": "moe",
    "SharedExpert": "shared",
    "Router": "router",
    "HyperMixer": "mhc",
    "RMSNorm": "norm",
    "Block": "block",
    "MTPDepth": "mtp",
}


def measure_saved_bytes(cfg: Any, seq: int) -> dict[tuple[str, str], float]:
    """Saved-for-backward bytes of one forward of `cfg` (float32, CPU) on one sample of `seq`
    tokens, by (layer kind, role); kind `model` holds what is outside the decoder layers,
    except the CE's [V, D] gradient (counted from the code)."""
    torch.manual_seed(0)
    model = DeepseekV4Model(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[tuple[str, str]] = [("model", "model")]
    kinds = {id(b): cfg.layer_kind(i) for i, b in enumerate(model.layers)}
    kinds.update({id(m.block): "mtp" for m in model.mtp})
    hooks = []
    for module in model.modules():
        role = _ROLE_OF_CLASS.get(type(module).__name__)
        if role is None:
            continue

        def pre(mod, *_, role=role):
            kind = kinds.get(id(mod), stack[-1][0]) if role in ("block", "mtp") else stack[-1][0]
            if role == "mtp":
                kind = "mtp"
            stack.append((kind, role))

        def post(*_):
            stack.pop()

        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    seen: set[int] = set()
    out: dict[tuple[str, str], float] = {}
    vd = cfg.vocab_size * cfg.hidden_size

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen and t.numel() != vd:
            seen.add(ptr)
            key = stack[-1]
            out[key] = out.get(key, 0.0) + t.untyped_storage().nbytes()
        return t

    batch = _one_sample(seq)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch.input_ids_S[None], batch.position_ids_S[None],
              packed_seq_params=to_packed_seq_params(batch), labels=batch.labels_S[None],
              loss_mask=batch.loss_mask_S[None],
              padding_mask=batch.padding_mask_S[None])  # fmt: skip
    for h in hooks:
        h.remove()
    return out


def _one_sample(seq: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 500, size=seq)
    targets = np.ones(seq, dtype=bool)
    return to_thd_batch(layout(tokens, targets, np.array([seq]), seq_length=seq, pad_id=0))


def fit_constants(cfg: Any, seq: int = 4096) -> dict[tuple[str, str], float]:
    """(kind, role) -> saved bytes per token per unit, measured at `seq` tokens. Every tensor a
    layer saves is [T, ...] (checked: no [T, S] score is kept for backward), so bytes grow
    linearly with the rank's rows T; the longest row amortizes per-layer constants best."""
    measured = measure_saved_bytes(cfg, seq)
    return {k: float(f"{v / seq / _unit(cfg, k[1]):.5g}") for k, v in sorted(measured.items())}


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


def _static_rows(plan: MemoryPlan, run: Any, params: list[tuple[str, int, bool]]) -> None:
    """Weights, fp32 gradient buckets, masters and moments of one stage's parameters."""
    sizes, cfg, d = run.sizes, run.cfg, _dtype_bytes(run)
    dp_cp = sizes.world // (sizes.pp * sizes.cp) * sizes.cp
    expert_dp = sizes.world // (sizes.ep * sizes.pp)
    weights = sum(numel for _, numel, _ in params) * d
    chunks, padded, shards = [], 0, 0
    for _, numel, expert in params:
        n = expert_dp if expert else dp_cp
        c = math.ceil(numel / n)
        chunks.append(c)
        padded += n * c
        shards += c if n > 1 else 0
    host = pick_offloaded(chunks, cfg.optim.offload_fraction)
    on_host = sum(chunks[i] for i in host)
    on_dev = sum(chunks) - on_host
    plan.add(f"weights ({cfg.model.dtype})", weights)
    if cfg.optim.grad_reduce_dtype == "float64":  # float64 buckets and shard, an fp32 copy
        plan.add("fp64 gradient buckets (+ reduced shard, fp32 copy)",
                 8 * (padded + shards) + 4 * sum(chunks))  # fmt: skip
    else:
        plan.add("fp32 gradient buckets (+ reduced shard)", 4 * (padded + shards))
    if d != 4:
        plan.add("fp32 master chunks", 4 * on_dev, 4 * on_host)
    elif on_host:
        plan.add("fp32 master chunks (host copies)", 0, 4 * on_host)
    plan.add("fp32 Adam moments (2 per chunk)", 8 * on_dev, 8 * on_host)
    biggest = max(numel for _, numel, _ in params)
    # A parameter's own-dtype gradient lives until its hook adds it to the bucket.
    plan.add("one parameter's own-dtype gradient", biggest * d, phase="backward")
    # The step: AdamW's denominator temporary of the largest chunk; the all-gather after it holds
    # one bucket's send and receive buffers (a bucket closes past BUCKET_BYTES of fp32 grads).
    bucket = min(weights, BUCKET_BYTES * d / 4 + biggest * d)
    n = max(dp_cp, expert_dp)
    gather = bucket * (1 + 1 / n) if n > 1 else 0.0
    plan.add("AdamW temporary + weight all-gather buffers", 4 * max(chunks) + gather, phase="step")


def layer_bytes(cfg: Any, kind: str, tokens: int, dtype_bytes: int) -> float:
    """Saved activations of one layer of `kind` for `tokens` rows on the rank."""
    per_token = sum(v * _unit(cfg, role) for (k, role), v in SAVED_BYTES.items() if k == kind)
    return per_token * tokens * dtype_bytes / 4


def _activation_rows(
    plan: MemoryPlan, run: Any, spec: Any, micro_batches: int, supervised_fraction: float
) -> None:
    cfg, sizes, d = run.model, run.sizes, _dtype_bytes(run)
    t = run.cfg.data.seq_length // sizes.cp
    pp, r = sizes.pp, spec.index
    in_flight = 1 if pp == 1 else (min(micro_batches, pp - r) if micro_batches >= pp
                                   else micro_batches)  # fmt: skip
    kinds = [cfg.layer_kind(i) for i in spec.decoder_layers] + ["mtp"] * len(spec.mtp_depths)
    full = {k: layer_bytes(cfg, k, t, d) for k in set(kinds)}
    recompute = getattr(cfg, "recompute_granularity", None) == "full"
    for kind in sorted(set(kinds)):
        n = kinds.count(kind)
        each = t * cfg.hc_mult * cfg.hidden_size * d if recompute else full[kind]
        what = "input streams (recompute)" if recompute else "saved activations"
        plan.add(f"{n} {kind} layers: {what} x {in_flight} micro-batch", n * each * in_flight,
                 phase="backward")  # fmt: skip
    if kinds:
        top = max(full.values())
        plan.add("backward working set (one layer)" + (" + its recompute" if recompute else ""),
                 top * (2 if recompute else 1), phase="backward")  # fmt: skip
    if spec.has_loss:
        model_level = layer_bytes(cfg, "model", t, d)
        calls = 1 + len(spec.mtp_depths)
        v, dim = cfg.vocab_size, cfg.hidden_size
        plan.add(f"head, CE: {calls} calls save fp32 dW [V, D] + streams", in_flight
                 * (calls * v * dim * 4 + model_level), phase="backward")  # fmt: skip
        rows = max(1, round(t * supervised_fraction))
        chunk = min(cfg.ce_chunk_size, rows)
        # ChunkedLinearCE's loop still holds the previous chunk's [C, V] while the next is made.
        held = 2 if rows > chunk else 1
        plan.add(f"CE transient: {held} x fp32 logits [{chunk}, V] + dW product",
                 held * chunk * v * 4 + v * dim * 4, phase="backward")  # fmt: skip


def plan_memory(
    run: Any, *, device_gb: float | None = None, supervised_fraction: float = 1.0
) -> list[MemoryPlan]:
    """One `MemoryPlan` per pipeline stage for the resolved `run` (its world size and layout).
    `supervised_fraction` of a pack's rows reach the LM head (1.0: the worst case)."""
    cfg, sizes = run.model, run.sizes
    model = build_model(run)
    specs = plan_stages(pp=sizes.pp, num_layers=cfg.num_layers,
                        mtp_num_layers=cfg.mtp_num_layers or 0,
                        layout=run.cfg.parallel.pp_layout)  # fmt: skip
    has_mtp = bool(cfg.mtp_num_layers)
    per_stage: list[list[tuple[str, int, bool]]] = [[] for _ in specs]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        expert = sizes.ep > 1 and name.rsplit(".", 1)[-1] in ("w_gate_up", "w_down")
        numel = p.numel() // (sizes.ep if expert else 1)
        for s in _stage_of(name, specs, has_mtp):
            per_stage[s].append((name, numel, expert))
    dp = sizes.world // (sizes.pp * sizes.cp)
    micro = run.cfg.train.global_batch_size // dp
    plans = []
    for spec, params in zip(specs, per_stage, strict=True):
        plan = MemoryPlan(stage=spec.index,
                          device_bytes=device_gb * GIB if device_gb else None)  # fmt: skip
        _static_rows(plan, run, params)
        _activation_rows(plan, run, spec, micro, supervised_fraction)
        plans.append(plan)
    return plans
