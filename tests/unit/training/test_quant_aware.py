"""Quantization-aware training in the release's formats (`train.quant_aware: release`): the
rounding training uses equals the FP8 export's quantizer bit for bit on every weight kind (FP8
128 x 128 of DeepSeek-V4 and V4-Flash-0731, FP8 32 x 32 and FP4 per 32 of V4.1; all-zero blocks,
blocks at the FP8 limit, subnormal scales); the straight-through backward equals the plain
backward evaluated at the quantized weights; a run keeps its weights in full precision; refusals
in one line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from pretrained_runs import write_pretrained
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.config import load_config, resolve_run
from primus_v4.config.schema import LORA_ENGRAM_TARGETS, LORA_TARGETS
from primus_v4.errors import ConfigError
from primus_v4.models import spec_of
from primus_v4.models.common.lora import LoRALinear
from primus_v4.training.trainer import Trainer

V41 = Path(__file__).resolve().parents[3] / "tests/fixtures/dsv41_dspark_golden/checkpoint"


def _plant_edges(zero: torch.Tensor, at_limit: torch.Tensor, tiny: torch.Tensor) -> None:
    """The edge cases in the first block of three weights: all zero; one value at the FP8
    limit (448 x a power of two) beside small ones; values so small that their ue8m0 scale is
    subnormal in float32."""
    with torch.no_grad():
        zero[:32, :32] = 0.0
        at_limit[:32, :32] = at_limit[:32, :32].sign() * 1e-3
        at_limit[0, 0] = 448.0 * 2.0**-3
        tiny[:32, :32] = torch.randn(32, 32) * 1e-41  # float32 subnormals


def _rounded(model: torch.nn.Module, cfg) -> dict[str, torch.Tensor]:
    quant = spec_of(model).release.release_rounding(model, cfg)
    with quant.applied():
        return {w.name: w.param.detach().clone() for w in quant.weights}


def _export_decoded(model: torch.nn.Module, out: Path, names: list[str]) -> dict:
    save_pretrained(model, out, dtype="fp8", progress=False)
    back = load_pretrained(out, dtype=torch.float32, progress=False).state_dict()
    return {n: back[n] for n in names}


def test_v4_rounding_is_the_fp8_export_bit_for_bit(tmp_path: Path) -> None:
    model = load_pretrained(write_pretrained(tmp_path / "v4"), dtype=torch.float32,
                            progress=False)  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # every block moved off the release's grid
    attn = model.layers[0].attn
    _plant_edges(attn.wkv.weight, attn.wq_b.weight, attn.wo_b.weight)  # 128 x 128 blocks
    rounded = _rounded(model, model.cfg)
    assert {"layers.0.moe.w_gate_up", "layers.0.moe.w_down", "mtp.0.e_proj.weight"} <= set(rounded)
    exported = _export_decoded(model, tmp_path / "out", list(rounded))
    for name, value in rounded.items():
        assert torch.equal(value, exported[name]), name
    assert not rounded["layers.0.attn.wkv.weight"][:32, :32].any()
    assert rounded["layers.0.attn.wq_b.weight"][0, 0] == 448.0 * 2.0**-3


def test_0731_rounding_is_the_fp8_export_bit_for_bit(tmp_path: Path) -> None:
    """DeepSeek-V4-Flash-0731 (V4's weights and blocks, its drafter carried): the same."""
    from release_0731 import write_release_0731

    release, _ = write_release_0731(tmp_path / "r0731")
    model = load_pretrained(release, dtype=torch.float32, progress=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    rounded = _rounded(model, model.cfg)
    assert "layers.0.moe.w_gate_up" in rounded and "layers.0.attn.wq_b.weight" in rounded
    exported = _export_decoded(model, tmp_path / "out", list(rounded))
    for name, value in rounded.items():
        assert torch.equal(value, exported[name]), name


def test_v41_rounding_is_the_fp8_export_bit_for_bit(tmp_path: Path) -> None:
    model = load_pretrained(V41, dtype=torch.float32, progress=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    attn = model.layers[0].attn
    _plant_edges(attn.wq_a.weight, attn.wkv.weight, attn.wo_b.weight)  # 32 x 32 blocks
    experts = model.layers[1].moe.w_down  # FP4 per 32 inputs
    with torch.no_grad():
        experts[0, :, :32] = 0.0
        experts[0, :, 32:64] = torch.randn_like(experts[0, :, 32:64]) * 1e-41
    rounded = _rounded(model, model.cfg)
    assert "layers.1.moe.w_down" in rounded and "layers.0.attn.wq_a.weight" in rounded
    exported = _export_decoded(model, tmp_path / "out", list(rounded))
    for name, value in rounded.items():
        assert torch.equal(value, exported[name]), name


def test_the_straight_through_backward_is_the_backward_at_the_quantized_weights() -> None:
    model = load_pretrained(V41, dtype=torch.float32, progress=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # off the release's grid
    quant = spec_of(model).release.release_rounding(model, model.cfg)
    ids = torch.randint(1, 500, (1, 40))
    labels = torch.roll(ids, -1, 1)
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    from megatron.core.packed_seq_params import PackedSeqParams

    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=25,
                          max_seqlen_kv=25)  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    with quant.applied():
        model(ids, packed_seq_params=psp, labels=labels).loss_sum.backward()
        at_quantized = {w.name: w.param.detach().clone() for w in quant.weights}
    with torch.no_grad():
        for name, value in at_quantized.items():
            reference.get_parameter(name).copy_(value)
    reference(ids, packed_seq_params=psp, labels=labels).loss_sum.backward()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"{name}: the weight is full precision again"
        want = reference.get_parameter(name).grad
        assert (p.grad is None) == (want is None), name
        if want is not None:
            assert torch.equal(p.grad, want), name
    assert any(not torch.equal(at_quantized[n], before[n]) for n in at_quantized)


def _run(tmp: Path, *extra: str) -> Trainer:
    items = [
        "model.preset=null", f"model.pretrained={V41}", f"data.seq_length={SEQ}",
        f"output.dir={tmp / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        "train.steps=2", "train.warmup_steps=1", "train.global_batch_size=1", *extra,
    ]  # fmt: skip
    return Trainer(resolve_run(load_config(overrides=items), world=1),
                   corpus=FakeCorpus(RAGGED_PACKS))  # fmt: skip


def test_a_quant_aware_run_trains_full_precision_weights_against_their_rounding(
    tmp_path: Path,
) -> None:
    plain = _run(tmp_path / "plain").train().rows
    trainer = _run(tmp_path / "qat", "train.quant_aware=release")
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rows = trainer.train().rows
    # the release's weights are their own rounding: step 1 is plain SFT's; step 2 is not
    assert rows[0].loss == plain[0].loss and rows[1].loss != plain[1].loss
    rounded = _rounded(trainer.model, trainer.run.model)
    trained = {n: trainer.model.get_parameter(n) for n in rounded}
    moved = [n for n, p in trained.items() if not torch.equal(p, start[n])]
    assert len(moved) > 0.9 * len(rounded)  # (an unused Engram wkv, say, gets no gradient)
    on_grid = [n for n in moved if torch.equal(rounded[n], trained[n])]
    assert not on_grid, f"trained weights left on the release's grid: {on_grid}"


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (
            ("model.lora.rank=4", "model.lora.allow_random_base=true"),
            1,
            "with model.lora.rank=4 needs model.lora.base=release",
        ),
        (
            (
                "model.lora.rank=4",
                "model.lora.allow_random_base=true",
                "model.lora.base=release",
                "model.lora.dropout=0.1",
            ),
            1,
            "with model.lora.dropout=0.1: the merged weight",
        ),
    ],
)
def test_what_quant_aware_cannot_train_is_refused(tmp_path: Path, extra, world, message) -> None:
    items = ["train.quant_aware=release", f"output.dir={tmp_path}", *extra]
    with pytest.raises(ConfigError, match=message):
        resolve_run(load_config(overrides=items), world=world)


LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.base=release",
        f"model.lora.targets=[{', '.join(LORA_TARGETS + LORA_ENGRAM_TARGETS)}]")  # fmt: skip


@pytest.mark.parametrize("lora", [(), LORA], ids=["full", "lora"])
def test_the_fp8_export_of_a_quant_aware_run_is_the_model_that_trained(
    tmp_path: Path, lora: tuple[str, ...]
) -> None:
    """The export's weights are the rounding the run's next forward uses: its logits equal the
    run's own (quantized) forward, and its held-out loss the run's final eval loss. LoRA: the
    merged FP8 / FP4 export, Q(W + s B A) on every adapted weight kind (FP8 linears and wo_a,
    FP4 routed experts, bf16 compressor / Engram projections)."""
    from primus_v4.export.run import export_adapters, export_checkpoint, find_source

    held_out = FakeCorpus([[120, 100], [200], [90, 90, 60]], seed=7)
    run = resolve_run(load_config(overrides=[
        "model.preset=null", f"model.pretrained={V41}", f"data.seq_length={SEQ}",
        f"output.dir={tmp_path / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        "train.steps=2", "train.warmup_steps=1", "train.global_batch_size=1",
        "train.quant_aware=release", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=2", "train.eval_interval=2", *lora,
    ]), world=1)  # fmt: skip
    trainer = Trainer(run, corpus=FakeCorpus(RAGGED_PACKS), eval_corpus=held_out)
    final = trainer.train().rows[-1]
    export_checkpoint(find_source(tmp_path / "ckpt"), tmp_path / "out", dtype="fp8")
    exported = load_pretrained(tmp_path / "out", dtype=torch.float32, progress=False)
    loss_sum, supervised, worst = 0.0, 0, 0.0
    for i in range(len(held_out)):
        inputs = trainer.model_inputs(held_out.thd_batch(i))
        inputs.pop("comm")
        with torch.no_grad(), trainer.quantized():
            want = trainer.model(**{**inputs, "labels": None}).logits
        with torch.no_grad():
            got = exported(**{**inputs, "labels": None}).logits
            loss_sum += float(exported(**inputs).loss_sum)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        supervised += held_out.thd_batch(i).num_supervised
    print(
        f"export vs run: worst logit {worst:.2e} of the largest; held-out loss "
        f"{loss_sum / supervised!r} vs the run's final eval loss {final.eval_loss!r}"
    )
    assert worst <= 1e-6, worst
    assert loss_sum / supervised == pytest.approx(final.eval_loss, rel=1e-6, abs=0)
    if lora:  # the PEFT export says what the adapters trained against
        export_adapters(find_source(tmp_path / "ckpt"), tmp_path / "peft")
        card = (tmp_path / "peft" / "README.md").read_text()
        assert "Q(W + (lora_alpha / r) B A)" in card and "--dtype fp8" in card


def test_a_quant_aware_lora_run_trains_its_adapters_against_the_rounded_merge(
    tmp_path: Path,
) -> None:
    """Fresh adapters (B = 0) merge to the base, which is its own rounding: step 1 is plain
    LoRA's, bit for bit; step 2 is not. Every adapted weight is rounded, and the base stays as
    released."""
    plain = _run(tmp_path / "plain", *LORA).train().rows
    trainer = _run(tmp_path / "qat", *LORA, "train.quant_aware=release")
    rows = trainer.train().rows
    assert rows[0].loss == plain[0].loss and rows[1].loss != plain[1].loss
    merged = {m.name: sorted(m.rounding) for m in trainer.quant.merged}
    assert merged["layers.1.moe.expert_lora"] == ["w_down", "w_gate_up"]  # FP4
    assert merged["layers.0.attn.wo_a_lora"] == ["wo_a"]  # FP8, grouped
    assert merged["layers.0.attn.wq_a"] == ["weight"]  # FP8 32 x 32
    assert merged["layers.2.attn.compressor.wkv"] == ["weight"]  # bf16, the merge is float32
    assert merged["layers.1.engram.wkv"] == ["weight"]
    adapted = [n for n, m in trainer.model.named_modules() if isinstance(m, LoRALinear)]
    assert adapted and set(adapted) <= set(merged)
    assert all(not w.param.requires_grad for w in trainer.quant.weights)  # the base is frozen
    assert all(m.module.release_rounding is None for m in trainer.quant.merged)  # after the step


def test_the_lora_straight_through_backward_is_the_backward_at_the_rounded_merge() -> None:
    """d loss / d B and d A through Q(W + s B A) equal s G A^T and s B^T G with G the plain
    weight gradient of a linear whose weight is Q(W + s B A)."""
    from primus_v4.models.common.kept_base import ReleaseLinear, ReleaseWeight
    from primus_v4.models.common.lora import LoraSpec
    from primus_v4.models.deepseek_v4.release.kept_base import _quantize_into
    from primus_v4.models.deepseek_v4.release.state_dict_adapter import _copy, _t

    torch.manual_seed(3)
    w = torch.randn(256, 160)
    entry = _copy("attn.wq_b.weight", _t("attn.wq_b.weight", (256, 160), "fp8"))  # 128 x 128
    source = ReleaseWeight(entry, shape=(256, 160), dtype=torch.float32, device="cpu")
    _quantize_into(source, entry, w)
    linear = LoRALinear(ReleaseLinear(source), LoraSpec(rank=4, alpha=8.0, targets=("wq_b",)),
                        [(0, 256)])  # fmt: skip
    with torch.no_grad():
        linear.lora_A.normal_(0, 0.1)
        linear.lora_B.normal_(0, 0.1)

    def rounding(value: torch.Tensor) -> torch.Tensor:
        out = ReleaseWeight(entry, shape=tuple(value.shape), dtype=torch.float32, device="cpu")
        _quantize_into(out, entry, value)
        return out()

    x = torch.randn(7, 160)
    linear.release_rounding = {"weight": rounding}
    y = linear(x)
    y.square().sum().backward()
    served = rounding(linear.merged_weight().detach())
    assert not torch.equal(served, linear.merged_weight().detach())  # the rounding is real
    assert torch.equal(y, torch.nn.functional.linear(x, served))
    at = served.clone().requires_grad_(True)
    torch.nn.functional.linear(x, at).square().sum().backward()
    g, a, b, s = at.grad, linear.lora_A[0].detach(), linear.lora_B[0].detach(), linear.scale
    torch.testing.assert_close(linear.lora_B.grad[0], s * g @ a.T, rtol=1e-6, atol=0)
    torch.testing.assert_close(linear.lora_A.grad[0], s * b.T @ g, rtol=1e-6, atol=0)
