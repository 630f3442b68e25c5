"""Activation memory at DeepSeek-V4.1-Flash width, measured on CPU in bf16 (not a test).

The V4.1 twin of `bench_activation_width.py` (whose step sampler it uses): one layer of each
V4.1 role at the released widths (hidden 5120, 64 heads x 512, q-LoRA 1280, 8 output groups x
1024, indexer 32 x 128 top-512, mHC 4, window 128, experts of width 2304 top-6, shared expert
2304, Engram 4-grams x 8 heads x 256), with few routed experts, a small vocabulary and small
Engram tables (the rows a step gathers are the same count) so it fits in RAM:

    layer 0 window, 1 window + Engram, 2 ratio-2 kv source + Engram, 3 ratio-2 reuse,
    4 ratio-1 kv source + candidate source, 5 ratio-1 reuse, 6 ratio-1 reindex

It runs one training step on one packed row and prints, per role, the measured saved bytes next
to the memory plan's (`models/deepseek_v41/memory_terms.layer_parts_of`), then the step's
peak next to the plan's backward phase. GEMMs are skipped by default (zeros of the exact shape
and dtype, see the V4 benchmark).

Measured here (2 shared CPU cores, GEMMs skipped), plan / measured per role: 512 tokens,
1.000-1.001 (step peak 0.877: a fixed ~0.4 GiB of backward temporaries the plan does not
itemize); 1024 tokens, 1.000-1.001 (step peak 0.960, 4.867 of 5.071 GiB); 1024 tokens took 11
minutes.

    python benchmarks/bench_activation_width_v41.py                 # 1024 tokens, minutes
    python benchmarks/bench_activation_width_v41.py --seq 2048 --detail
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

ROLES_LAYERS = 7


def flash_v41_width(*, experts: int, vocab: int, scale: float) -> object:
    """One layer per V4.1 role at Flash widths (`scale` < 1 shrinks hidden and heads)."""
    from primus_v4.models.deepseek_v41.config import DeepseekV41Config

    heads = max(8, int(64 * scale))
    return DeepseekV41Config.preset(
        "deepseek_v41_flash", num_layers=ROLES_LAYERS, compress_ratios=[0, 0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6],
        candidate_source_layer_id=4, engram_layer_ids=[1, 2],
        engram_num_embeddings=[32 * 1013 + 64, 32 * 1013 + 64], engram_vocab_size=1000,
        num_moe_experts=experts, vocab_size=vocab, hidden_size=int(5120 * scale),
        num_attention_heads=heads, q_lora_rank=int(1280 * scale), o_lora_rank=int(1024 * scale),
        moe_ffn_hidden_size=int(2304 * scale),
        moe_shared_expert_intermediate_size=int(2304 * scale), ce_chunk_size=4096, bf16=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip


class Roles:
    """The config as `SavedBytes` reads it, with each layer named by its V4.1 role."""

    def __init__(self, cfg) -> None:
        from primus_v4.models.deepseek_v41.memory_terms import layer_role as v41_role

        self.num_layers = cfg.num_layers
        self.roles = [v41_role(cfg, i) for i in range(cfg.num_layers)]

    def layer_kind(self, layer: int) -> str:
        return self.roles[layer]


def build(cfg):
    from primus_v4.models.deepseek_v41.model import DeepseekV41Model

    with torch.device("meta"):
        model = DeepseekV41Model(cfg)
    model = model.to(dtype=torch.bfloat16).to_empty(device="cpu")
    model.init_weights(0)
    model.engram_rows.init_buffers()
    return model.train()


def step(model, cfg, batch, *, gemm: str):
    """One forward + backward: (saved bytes by (role, module), peak in-use over the base)."""
    from bench_activation_width import StepMode, in_use

    from primus_v4.data.thd import to_packed_seq_params
    from primus_v4.memory.saved_bytes import SavedBytes

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    base = in_use()
    mode = StepMode(gemm)
    with mode:
        with SavedBytes(model, Roles(cfg)) as saved:
            out = model(batch.input_ids_S[None], batch.position_ids_S[None],
                        packed_seq_params=to_packed_seq_params(batch),
                        labels=batch.labels_S[None], loss_mask=batch.loss_mask_S[None],
                        padding_mask=batch.padding_mask_S[None])  # fmt: skip
        mode.phase = "backward"
        (out.loss_sum + out.aux_loss).backward()
    return saved, mode.peak - base


def role_table(saved, cfg, seq: int) -> list[tuple[str, float, float]]:
    from primus_v4.models.deepseek_v41.memory_terms import layer_parts_of as layer_parts_v41

    measured: dict[str, float] = defaultdict(float)
    for (role, _), b in saved.bytes.items():
        measured[role] += b
    rows = []
    print(f"\nsaved for backward per V4.1 layer role, bf16, {seq} tokens (KiB per token)")
    print(f"{'layer':<6} {'role':<28} {'measured':>10} {'planned':>10} {'plan/measured':>14}")
    for layer in range(cfg.num_layers):
        role = Roles(cfg).layer_kind(layer)
        plan = sum(layer_parts_v41(cfg, layer, rows=seq, seq=seq, b=2).values())
        got = measured[role]
        rows.append((role, got, plan))
        print(f"{layer:<6} {role:<28} {got / seq / 1024:10.1f} {plan / seq / 1024:10.1f} "
              f"{plan / got:14.3f}")  # fmt: skip
    print(f"{'':<6} {'model (head, CE, embedding)':<28} {measured['model'] / seq / 1024:10.1f}")
    return rows


def peak_table(biggest: int, cfg, seq: int, peak: int) -> None:
    from primus_v4.memory.plan import MemoryPlan, activation_rows
    from primus_v4.parallel.pipeline_layout import plan_stages

    (spec,) = plan_stages(pp=1, num_layers=cfg.num_layers, mtp_num_layers=0)
    plan = MemoryPlan(stage=0)
    activation_rows(plan, cfg, spec, seq=seq, cp=1, b=2, held=1)
    plan.add("one parameter's own-dtype gradient", biggest * 2, phase="backward")
    print("\nthe plan's backward phase for this step:")
    for name, dev, _, _ in plan.rows:
        print(f"  {name:<70} {dev / 2**30:8.3f} GiB")
    planned = plan.device_total
    print(f"step peak over the weights: measured {peak / 2**30:.3f} GiB, planned "
          f"{planned / 2**30:.3f} GiB, plan/measured {planned / peak:.3f}")  # fmt: skip


def main() -> None:
    from bench_activation_width import pack

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=2, help="samples packed in the row")
    parser.add_argument("--experts", type=int, default=6, help="routed experts (>= top-6)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden-scale", type=float, default=1.0, help="< 1: a narrower check")
    parser.add_argument("--gemm", choices=("skip", "fp32"), default="skip")
    parser.add_argument("--detail", action="store_true", help="list every saved tensor")
    parser.add_argument("--save", type=Path, help="write the measurement to this JSON file")
    parser.add_argument("--measured", type=Path,
                        help="print the tables from a --save file instead of a step")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = flash_v41_width(experts=args.experts, vocab=args.vocab, scale=args.hidden_scale)
    if args.measured is not None:
        got = json.loads(args.measured.read_text())
        saved = SimpleNamespace(bytes={tuple(k.split("|")): v for k, v in got["bytes"].items()},
                                tensors={})  # fmt: skip
        args.seq, peak, biggest = got["seq"], got["peak"], got["biggest"]
    else:
        t0 = time.time()
        model = build(cfg)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"built {weights / 2**30:.2f} GiB of bf16 weights in {time.time() - t0:.0f} s")
        biggest = max(p.numel() for p in model.parameters() if p.requires_grad)
        batch = pack(args.seq, args.vocab, args.samples)
        t0 = time.time()
        saved, peak = step(model, cfg, batch, gemm=args.gemm)
        print(f"one step ({args.seq} tokens, {args.samples} samples, GEMMs {args.gemm}) in "
              f"{time.time() - t0:.0f} s")  # fmt: skip
        if args.save is not None:
            dump = {"seq": args.seq, "peak": peak, "biggest": biggest,
                    "bytes": {"|".join(k): v for k, v in saved.bytes.items()}}  # fmt: skip
            args.save.write_text(json.dumps(dump, indent=1))
    print(f"\nsaved for backward per module, largest first (bytes per token, {args.seq} tokens)")
    for (role, path), b in sorted(saved.bytes.items(), key=lambda kv: -kv[1]):
        print(f"  {role:<28} {path or '(top level)':<34} {b / args.seq:>10.0f}")
        if args.detail and saved.tensors:
            print("         " + ", ".join(saved.tensors[(role, path)]))
    role_table(saved, cfg, args.seq)
    peak_table(biggest, cfg, args.seq, peak)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
