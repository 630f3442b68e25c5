"""Activation memory at DeepSeek-V4-Flash width, measured on CPU in bf16 (not a test).

Builds one dense, one CSA and one HCA layer and the MTP depth at Flash widths (hidden 4096,
64 heads x 512, q-LoRA 1024, 8 output groups x 1024, indexer 64 x 128, mHC 4, window 128,
experts of width 2048 top-6, shared expert 2048) with few routed experts and a small vocabulary
so it fits in RAM, runs one training step (forward + backward) on one packed row and prints:

- what each module saves for backward per token, largest first (saved-tensor hooks attribute
  every saved storage once to the innermost module running; parameters are not activations);
- per layer kind, the measured saved bytes next to the memory plan's (`memory_plan.layer_bytes`);
- the step's peak (malloc's in-use bytes sampled after every aten op of forward and backward,
  minus the same before the forward) next to the plan's backward phase for one micro-batch;
- per recompute choice, the bytes it saves and the extra forward FLOPs it costs (`--recompute`).

GEMM arithmetic: this CPU has no bf16 matrix units (a bf16 GEMM runs at ~0.3 GFLOP/s here), so
by default every mm / bmm returns zeros of its exact shape and dtype (`--gemm skip`): saved
tensors, their dtypes and every allocation are those of the real step, only the values are not
(routing ties pick the first experts: the routed rows per step, T x top-k, are the same).
`--gemm fp32` computes them in float32 and rounds to bf16 (real values; hours at full width).
Gradients are freed as their hooks fire, as the optimizer's bucket hooks do: the gradient
buffers and optimizer state are exact arithmetic in the plan (tests/unit/training/
test_memory_plan.py) and would not fit this machine's RAM next to the activations.

    python benchmarks/bench_activation_width.py                 # 4096 tokens, about 10 minutes
    python benchmarks/bench_activation_width.py --seq 8192
    python benchmarks/bench_activation_width.py --hidden-scale 0.25 --gemm fp32   # quick check
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from primus_v4.memory.saved_bytes import SavedBytes

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def in_use() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def _gemm_shape(func, args) -> tuple[list[int], torch.dtype]:
    a, b = (args[0], args[1]) if func in (aten.mm.default, aten.bmm.default) else args[1:3]
    shape = [*a.shape[:-1], b.shape[-1]]
    return shape, a.dtype


class StepMode(TorchDispatchMode):
    """Samples the in-use bytes after every aten op; GEMMs skipped or computed in float32."""

    def __init__(self, gemm: str) -> None:
        super().__init__()
        self.gemm, self.peak = gemm, 0
        self.phase = "forward"
        self.peaks = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS and self.gemm == "skip":
            shape, dtype = _gemm_shape(func, args)
            out = torch.zeros(shape, dtype=dtype, device=args[-1].device)
        elif func in GEMMS and self.gemm == "fp32" and args[-1].dtype == torch.bfloat16:
            up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            out = func(*up, **kwargs).to(torch.bfloat16)
        else:
            out = func(*args, **kwargs)
        now = in_use()
        self.peak = max(self.peak, now)
        self.peaks[self.phase] = max(self.peaks[self.phase], now)
        return out


def flash_width(*, experts: int, vocab: int, scale: float) -> object:
    """One layer of each kind + MTP at Flash widths (`scale` < 1 shrinks hidden and heads)."""
    from primus_v4.models.deepseek_v4 import DeepseekV4Config

    heads = max(8, int(64 * scale))
    return DeepseekV4Config.preset(
        "deepseek_v4_flash", num_layers=3, compress_ratios=[0, 4, 128], num_moe_experts=experts,
        vocab_size=vocab, num_hash_layers=1, hidden_size=int(4096 * scale),
        num_attention_heads=heads, index_n_heads=heads, q_lora_rank=int(1024 * scale),
        o_lora_rank=int(1024 * scale), moe_ffn_hidden_size=int(2048 * scale),
        moe_shared_expert_intermediate_size=int(2048 * scale), ce_chunk_size=4096, bf16=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip


def build(cfg, dtype: torch.dtype, seed: int = 0):
    from primus_v4.models.deepseek_v4 import DeepseekV4Model

    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
    model = model.to(dtype=dtype).to_empty(device="cpu")
    model.init_weights(seed)
    return model.train()


def pack(seq: int, vocab: int, samples: int):
    """One row of `samples` equal samples (the last one takes the remainder), all supervised."""
    import numpy as np

    from primus_v4.data.packed_corpus import layout, to_thd_batch

    rng = np.random.default_rng(0)
    lengths = np.full(samples, seq // samples)
    lengths[-1] += seq - lengths.sum()
    tokens = rng.integers(1, vocab, size=seq)
    return to_thd_batch(layout(tokens, np.ones(seq, dtype=bool), lengths, seq_length=seq,
                               pad_id=0))  # fmt: skip


def step(model, cfg, batch, *, gemm: str, backward: bool = True) -> tuple[SavedBytes, int, int]:
    """One forward + backward; (saved bytes, peak in-use bytes over the pre-forward base, base).
    Prints where the peak sits: in the forward or the backward, and what is in use at the
    forward's end (the saved tensors and the loss)."""
    from primus_v4.data.thd import to_packed_seq_params

    if not getattr(model, "grads_freed", False):
        model.grads_freed = True
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    base = in_use()
    mode = StepMode(gemm)
    with mode:
        with SavedBytes(model, cfg) as saved:
            out = model(batch.input_ids_S[None], batch.position_ids_S[None],
                        packed_seq_params=to_packed_seq_params(batch),
                        labels=batch.labels_S[None], loss_mask=batch.loss_mask_S[None],
                        padding_mask=batch.padding_mask_S[None])  # fmt: skip
        loss = out.loss_sum + out.mtp_loss_sums[0] + out.aux_loss
        end = in_use()
        mode.phase = "backward"
        if backward:
            loss.backward()
    gib = 2**30
    print(f"in use over the base: at the forward's end {(end - base) / gib:.3f} GiB, forward peak "
          f"{(mode.peaks['forward'] - base) / gib:.3f} GiB, backward peak "
          f"{(mode.peaks['backward'] - base) / gib:.3f} GiB; saved for backward "
          f"{sum(saved.bytes.values()) / gib:.3f} GiB")  # fmt: skip
    return saved, mode.peak - base, base


def layer_table(saved: SavedBytes, cfg, seq: int) -> dict[str, float]:
    from primus_v4.memory.plan import saved_parts

    measured: dict[str, float] = defaultdict(float)
    for (kind, _), b in saved.bytes.items():
        measured[kind] += b
    layers = {cfg.layer_kind(i): i for i in range(cfg.num_layers)} | {"mtp": None}
    print(f"\nsaved for backward per layer kind, bf16, {seq} tokens (KiB per token)")
    print(f"{'kind':<6} {'measured':>10} {'planned':>10} {'plan/measured':>14}")
    for kind, layer in layers.items():
        plan = sum(saved_parts(cfg, layer, rows=seq, seq=seq, b=2).values())
        got = measured[kind]
        print(f"{kind:<6} {got / seq / 1024:10.1f} {plan / seq / 1024:10.1f} {plan / got:14.3f}")
    print(f"{'model':<6} {measured['model'] / seq / 1024:10.1f}  (head, CE: in the step peak)")
    return measured


def module_table(saved: SavedBytes, seq: int, detail: bool) -> None:
    print(f"\nsaved for backward per module, largest first (bytes per token, {seq} tokens)")
    rows = sorted(saved.bytes.items(), key=lambda kv: -kv[1])
    for (kind, path), b in rows:
        print(f"  {kind:<6} {path or '(top level)':<34} {b / seq:>10.0f}")
        if detail:
            print("         " + ", ".join(saved.tensors[(kind, path)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2, help="samples packed in the row")
    parser.add_argument("--experts", type=int, default=6, help="routed experts (>= top-6)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden-scale", type=float, default=1.0, help="< 1: a narrower check")
    parser.add_argument("--gemm", choices=("skip", "fp32"), default="skip")
    parser.add_argument("--detail", action="store_true", help="list every saved tensor")
    parser.add_argument("--forward-only", action="store_true", help="saved bytes only, no peak")
    parser.add_argument("--recompute", action="store_true",
                        help="measure each recompute choice too (a forward each)")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = flash_width(experts=args.experts, vocab=args.vocab, scale=args.hidden_scale)
    t0 = time.time()
    model = build(cfg, torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = pack(args.seq, args.vocab, args.samples)
    print(f"built {weights / 2**30:.2f} GiB of bf16 weights in {time.time() - t0:.0f} s")
    t0 = time.time()
    saved, peak, _ = step(model, cfg, batch, gemm=args.gemm, backward=not args.forward_only)
    print(f"one step ({args.seq} tokens, {args.samples} samples, GEMMs {args.gemm}) in "
          f"{time.time() - t0:.0f} s")  # fmt: skip
    module_table(saved, args.seq, args.detail)
    layer_table(saved, cfg, args.seq)
    if not args.forward_only:
        peak_table(model, cfg, args.seq, peak)
    recompute_table(model, cfg, batch, args.seq, args.gemm if args.recompute else None)


CHOICES = [
    ("layernorm",), ("mla_up_proj",), ("core_attn",), ("shared_experts",), ("moe",),
    ("layernorm", "mla_up_proj", "core_attn"), ("layernorm", "mla_up_proj", "moe"),
    ("layernorm", "mla_up_proj", "core_attn", "moe"),
]  # fmt: skip


def _set_recompute(model, modules: frozenset[str]) -> None:
    """Switch the built model's selective recompute (what `recompute_modules` sets at build)."""
    from primus_v4.models.deepseek_v4.attention import Attention
    from primus_v4.models.deepseek_v4.block import Block
    from primus_v4.models.deepseek_v4.moe import MoE
    from primus_v4.models.deepseek_v4.mtp import MTPDepth

    for m in model.modules():
        if isinstance(m, Block | Attention):
            m.recompute = modules
        elif isinstance(m, MoE):
            m.recompute_shared = "shared_experts" in modules
        elif isinstance(m, MTPDepth):
            m.recompute_norms = "layernorm" in modules


def recompute_table(model, cfg, batch, seq: int, gemm: str | None) -> None:
    """Per choice and layer kind: saved bytes it drops (planned; measured with `--recompute`)
    and the forward FLOPs it repeats, against the layer's step FLOPs without recompute."""
    from primus_v4.memory.plan import cfg_kind, saved_parts
    from primus_v4.models.common.activations import kept, layer_flops, recompute_flops, step_flops

    layers = {cfg.layer_kind(i): i for i in range(cfg.num_layers)} | {"mtp": None}
    parts = {k: saved_parts(cfg, i, rows=seq, seq=seq, b=2) for k, i in layers.items()}
    flops = {k: layer_flops(cfg, cfg_kind(cfg, i), seq=seq) for k, i in layers.items()}
    measured_none = None
    if gemm is not None:
        measured_none = step(model, cfg, batch, gemm=gemm, backward=False)[0].by_kind()
    print(
        f"\nrecompute choices ({seq} tokens): KiB per token saved for backward less than no "
        "recompute, planned (measured); repeated forward FLOPs / the layer's step FLOPs"
    )
    print(f"{'modules':<42} " + " ".join(f"{k:>20}" for k in layers))
    for choice in CHOICES:
        chosen = frozenset(choice)
        got = None
        if measured_none is not None:
            _set_recompute(model, chosen)
            got = step(model, cfg, batch, gemm=gemm, backward=False)[0].by_kind()
            _set_recompute(model, frozenset())
        cells = []
        for kind in layers:
            drop = (sum(parts[kind].values()) - kept(parts[kind], chosen)) / seq / 1024
            cost = recompute_flops(flops[kind], chosen) / step_flops(flops[kind])
            mine = "" if got is None else f"({(measured_none[kind] - got[kind]) / seq / 1024:.0f})"
            cells.append(f"{drop:5.0f}{mine:>6} {100 * cost:5.1f}%")
        print(f"{','.join(choice):<42} " + " ".join(f"{c:>20}" for c in cells))


def peak_table(model, cfg, seq: int, peak: int) -> None:
    """The plan's backward phase of this one-stage, one-micro-batch step (the optimizer's
    buffers aside, as the step frees each gradient in its hook)."""
    from primus_v4.memory.plan import MemoryPlan, activation_rows
    from primus_v4.parallel.pipeline_layout import plan_stages

    (spec,) = plan_stages(pp=1, num_layers=cfg.num_layers, mtp_num_layers=cfg.mtp_num_layers)
    plan = MemoryPlan(stage=0)
    activation_rows(plan, cfg, spec, seq=seq, cp=1, b=2, held=1)
    biggest = max(p.numel() for p in model.parameters() if p.requires_grad)
    plan.add("one parameter's own-dtype gradient", biggest * 2, phase="backward")
    planned = plan.device_total
    print("\nthe plan's backward phase for this step:")
    for name, dev, _, _ in plan.rows:
        print(f"  {name:<70} {dev / 2**30:8.3f} GiB")
    print(f"step peak over the weights: measured {peak / 2**30:.2f} GiB, planned "
          f"{planned / 2**30:.2f} GiB, plan/measured {planned / peak:.3f}")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
