"""`inspect memory`: the static terms follow the optimizer layout exactly, the activation terms
what the code saves; the CLI prints a plan."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.memory.plan import plan_memory, saved_parts
from primus_v4.memory.saved_bytes import SavedBytes
from primus_v4.models.common.activations import kept
from primus_v4.models.common.recompute import selected
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.training.trainer import build_model

LORA = ("model.lora.rank=8", "model.lora.allow_random_base=true")


def _rows(*settings: str, world: int = 1) -> dict[str, tuple[float, float]]:
    run = resolve_run(load_config(overrides=["data.seq_length=1024", *settings]), world=world)
    (plan,) = plan_memory(run)
    return {name.split(" (")[0]: (d, h) for name, d, h, _ in plan.rows}


def test_static_terms_follow_the_sharded_optimizer() -> None:
    run = resolve_run(load_config(), world=1)
    model = build_model(run)  # meta
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # the indexer
    assert frozen > 0
    one = _rows()
    assert one["weights"] == (4 * (total + frozen), 0)  # float32, frozen weights included
    assert one["fp32 Adam moments"] == (8 * total, 0)
    assert "fp32 master chunks" not in one  # float32 parameters are their own masters
    two = _rows("train.global_batch_size=2", world=2)
    # dp=2: each rank holds ceil(N / 2) of every parameter's moments.
    assert two["fp32 Adam moments"][0] == pytest.approx(4 * total, rel=1e-4)
    bf16 = _rows("model.dtype=bfloat16", "optim.offload_fraction=0.5")
    dev, host = bf16["fp32 master chunks"]
    assert bf16["weights"][0] == 2 * (total + frozen) and dev + host == 4 * total
    assert host == pytest.approx(2 * total, rel=0.2)  # whole tensors, largest first, up to half


def test_bf16_gradient_buckets_halve_the_static_term() -> None:
    run = resolve_run(load_config(), world=1)
    total = sum(p.numel() for p in build_model(run).parameters() if p.requires_grad)
    lean = _rows("model.dtype=bfloat16", "optim.grad_accum_dtype=bfloat16")
    assert lean["bf16 gradient buckets"] == (2 * total, 0)
    assert "fp32 gradient buckets" not in lean
    # Without replicas the float32 gradient AdamW steps on exists in the step phase only.
    assert lean["fp32 copies of unreplicated bf16 buckets"] == (4 * total, 0)


def test_a_lora_plan_keeps_the_base_weights_and_drops_its_optimizer_state() -> None:
    run = resolve_run(load_config(overrides=[*LORA]), world=1)
    model = build_model(run)
    total = sum(p.numel() for p in model.parameters())
    lora = _rows(*LORA)
    full = _rows()
    assert lora["weights"][0] > full["weights"][0] == 4 * total  # base + adapters
    adapters = (lora["weights"][0] - full["weights"][0]) / 4
    assert lora["fp32 Adam moments"] == (8 * adapters, 0)  # two moments of the adapters only
    assert lora["fp32 gradient buckets"][0] == 4 * adapters


def test_cli_prints_the_plan(capsys) -> None:
    assert main(["inspect", "memory", "--set", "data.seq_length=512", "--device-memory",
                 "MI355X"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "memory plan per rank: world 1 = pp 1 x cp 1 x dp 1" in out
    assert "device MI355X (288 GiB)" in out and "3 saved activations" not in out
    assert "1 csa layers: saved activations x 1 micro-batch" in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("modules", [None, ["layernorm", "mla_up_proj", "core_attn"], ["moe"]],
                         ids=["none", "selective", "moe"])  # fmt: skip
def test_the_plan_counts_what_each_layer_saves(dtype, modules) -> None:
    """Per layer kind, the plan's saved bytes (counted from the code) against a saved-tensor
    measurement of the tiny model (one sample filling a 256-row pack, so every window and pool
    is as large as the row allows)."""
    rec = {} if modules is None else {"recompute_granularity": "selective",
                                      "recompute_modules": modules}  # fmt: skip
    cfg = DeepseekV4Config.preset("tiny", vocab_size=512, **rec)
    torch.manual_seed(0)
    model = DeepseekV4Model(cfg).to(dtype)
    seq, ids = 256, torch.randint(1, 512, (1, 256))
    cu = torch.tensor([0, seq], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=seq, max_seqlen_kv=seq)  # fmt: skip
    with SavedBytes(model, cfg) as saved:
        model(ids, packed_seq_params=psp, labels=ids, loss_mask=torch.ones(1, seq))
    measured = saved.by_kind()
    b = 2 if dtype == torch.bfloat16 else 4
    for kind, layer in (("dense", 0), ("csa", 1), ("hca", 2), ("mtp", None)):
        planned = kept(saved_parts(cfg, layer, rows=seq, seq=seq, b=b), selected(cfg))
        # The plan rounds a few small float32 per-row tensors (mHC coefficients, router
        # scores): 5% of a tiny layer, under 1% of a Flash one (bench_activation_width.py).
        assert planned == pytest.approx(measured[kind], rel=0.05), kind


def test_a_base_kept_as_released_saves_only_the_experts_input() -> None:
    """LoRA on the base kept as released (bf16): the routed experts run inside a checkpoint, so
    the plan keeps only their dispatched input ([rows x top-k, D]); against the saved-tensor
    measurement of that model, per layer kind, and below the plain LoRA model's."""
    from primus_v4.config.schema import LORA_DEFAULT_TARGETS
    from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora
    from primus_v4.models.deepseek_v4.release.kept_base import keep_release_base

    cfg = DeepseekV4Config.preset("tiny", vocab_size=512)
    seq, ids = 256, torch.randint(1, 512, (1, 256))
    cu = torch.tensor([0, seq], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=seq, max_seqlen_kv=seq)  # fmt: skip
    measured = {}
    for keep in (False, True):
        torch.manual_seed(0)
        model = DeepseekV4Model(cfg).to(torch.bfloat16)
        if keep:
            keep_release_base(model, cfg, dtype=torch.bfloat16)
        apply_lora(model, LoraSpec(rank=8, alpha=16.0, targets=LORA_DEFAULT_TARGETS), seed=0)
        with SavedBytes(model, cfg) as saved:
            model(ids, packed_seq_params=psp, labels=ids, loss_mask=torch.ones(1, seq))
        measured[keep] = saved.by_kind()
    plan = {}
    for rebuilt in (False, True):
        run = resolve_run(load_config(overrides=[f"data.seq_length={seq}", "model.dtype=bfloat16",
                                                 "model.overrides.vocab_size=512",
                                                 *LORA, "model.lora.base="
                                                 + ("release" if rebuilt else "bfloat16")]),
                          world=1)  # fmt: skip
        (p,) = plan_memory(run)
        plan[rebuilt] = {name.split(":")[0]: d for name, d, _, _ in p.rows if "layers:" in name}
    for kind in ("dense", "csa", "hca"):
        row = f"1 {kind} layers"
        assert plan[True][row] < plan[False][row]
        assert measured[True][kind] < measured[False][kind]
        assert plan[True][row] == pytest.approx(measured[True][kind], rel=0.05), kind


def test_quant_aware_counts_the_rounded_weights_and_the_served_merges() -> None:
    """train.quant_aware=release: full fine-tuning holds each weight the release stores FP8 /
    FP4 (and, in a float32 run, bf16) rounded beside the full-precision one for the step; LoRA
    saves each adapted linear's and wo_a's served weight for the backward and merges one layer's
    experts at a time (fp32 merge + rounding, the served copy and its gradient)."""
    from primus_v4.models.common.lora import GroupedLoRA, LoRALinear
    from primus_v4.models.deepseek_v4.release.state_dict_adapter import name_table
    from primus_v4.training.build import assemble

    row = "quant_aware: weights as released, beside full precision"
    run = resolve_run(load_config(overrides=["data.seq_length=1024"]), world=1)
    table = name_table(run.model)

    def stored(n: str) -> set[str]:
        return {r.kind for r in table[n].release} if n in table else {"float32"}

    params = dict(build_model(run).named_parameters())
    quantized = sum(p.numel() for n, p in params.items() if stored(n) <= {"fp8", "fp4"})
    bf16 = sum(p.numel() for n, p in params.items() if stored(n) == {"bf16"})
    assert quantized and bf16
    assert _rows("train.quant_aware=release")[row] == (4 * (quantized + bf16), 0)
    assert _rows("train.quant_aware=release", "model.dtype=bfloat16")[row] == (2 * quantized, 0)
    experts = sum(p.numel() for n, p in params.items() if n.endswith(("w_gate_up", "w_down")))
    ep2 = _rows("train.quant_aware=release", "parallel.ep=2", "train.global_batch_size=2", world=2)
    assert ep2[row] == (4 * (quantized + bf16 - experts // 2), 0)  # half the experts each
    assert not any(name.startswith("quant_aware") for name in _rows())

    lora = (*LORA, "model.lora.base=release", "train.quant_aware=release")
    lora_run = resolve_run(load_config(overrides=list(lora)), world=1)
    model = assemble(lora_run.model, lora_run.cfg.model, seed=0).model  # on meta, adapted
    served = 0
    for m in model.modules():
        if isinstance(m, LoRALinear):
            served += m.in_features * m.out_features
        elif isinstance(m, GroupedLoRA):
            served += m.lora_A.shape[0] * m.lora_B.shape[1] * m.lora_A.shape[2]
    rows = _rows(*lora)
    assert rows["quant_aware LoRA: served weights saved for backward"] == (4 * served, 0)
    cfg = run.model  # one layer's routed experts: w_gate_up [E, 2F, D] + w_down [E, D, F]
    experts = 3 * cfg.num_moe_experts * cfg.moe_ffn_hidden_size * cfg.hidden_size
    assert rows["quant_aware LoRA: one weight merged, rounded, its grad"] == (20 * experts, 0)
