"""`primus-v4 export --format peft` of a LoRA run: the adapters alone, in PEFT's format on
transformers' module names. From a tiny random release (real vocabulary) two LoRA runs train two
steps: one adapts every target with per-expert routed adapters; one has routed adapters shared by
the experts on the up half of the fused gate_up only, and moves the routers' bias (so the routers
travel as modules_to_save). Each export loads with `PeftModel.from_pretrained` onto transformers'
DeepseekV4ForCausalLM, holds the keys and shapes PEFT itself makes from the written config,
computes our trained model's logits, and merges into exactly our merged weights. Refused: a run
without LoRA, and --dtype fp8."""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path

import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from pretrained_runs import run_command, train_items, write_pretrained
from safetensors.torch import load_file
from test_export_lora import _rel
from torch.distributed.checkpoint import FileSystemReader

from primus_v4.cli import main
from primus_v4.commands import export, train
from primus_v4.config import load_config
from primus_v4.config.schema import LORA_TARGETS
from primus_v4.errors import ExitCode
from primus_v4.export.lora import is_adapter
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora, merged_weights
from primus_v4.models.deepseek_v4.release.load import load_pretrained
from primus_v4.training.checkpoint.store import step_dir

LORA = [
    "model.lora.rank=4",
    "model.lora.allow_random_base=true",
    "model.lora.alpha=8",
    "train.lr=0.05",
]
SHARED = ["wkv", "wo_a", "shared_experts.w3", "experts.w3"]
RUNS = {
    "per_expert": [f"model.lora.targets=[{', '.join(LORA_TARGETS)}]"],
    "shared": [f"model.lora.targets=[{', '.join(SHARED)}]", "model.lora.expert_adapters=shared",
               "model.router_bias_update_rate=0.5"],  # large: the moved bias reroutes tokens
}  # fmt: skip
REL = 1e-5  # float32 logits: W x + s B (A x) (ours) vs (W + s B A) x (PEFT), summation order only
WEIGHT_TOL = 1e-6  # float32 W + s B A, PEFT's products and sums vs ours


def _export(run: Path, out: Path, *args: str) -> dict:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        argv = ("--run", str(run), "--out", str(out), "--format", "peft", "--no-progress", *args)
        assert run_command(export, [], argv) == 0
    return json.loads(stdout.getvalue())


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pretrained(tmp_path_factory.mktemp("peft_release") / "release")


@pytest.fixture(scope="module", params=list(RUNS))
def exported(request, release: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp(f"peft_{request.param}")
    items = [*train_items(tmp, release, steps=2), *LORA, *RUNS[request.param]]
    assert run_command(train, items) == 0
    summary = _export(tmp / "run", tmp / "peft")
    return {"run": tmp / "run", "out": tmp / "peft", "summary": summary, "kind": request.param}


def _trained(release: Path, run: Path) -> torch.nn.Module:
    """Our model of `release` with the run's step-2 adapters and buffers (router bias) loaded."""
    cfg = load_config(run / "config.yaml")
    lora = cfg.model.lora
    model = load_pretrained(release, progress=False)
    spec = LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets),
                    expert_adapters=lora.expert_adapters)  # fmt: skip
    apply_lora(model, spec, seed=cfg.train.seed)
    checkpoint = step_dir(run / "ckpt", 2)
    meta = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    state = {n: t.clone() for n, t in model.state_dict().items() if f"model.{n}" in meta}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's no_dist notice
        dcp.load({"model": state}, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state, strict=False)
    return model.eval()


def _hf(release: Path) -> transformers.PreTrainedModel:
    return transformers.DeepseekV4ForCausalLM.from_pretrained(
        release, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _with_adapters(release: Path, out: Path) -> peft.PeftModel:
    base = _hf(release)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, out).eval()
    # the export's rank patterns name a targeted module too: PEFT has nothing to warn about
    assert not [str(w.message) for w in caught if "_pattern" in str(w.message)]
    return model


def test_config_names_the_targets_and_the_summary_counts(exported, release: Path) -> None:
    out, run = exported["out"], exported["run"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == str(release)
    assert not (out / "README.md").exists()  # trained unquantized: nothing to warn of
    if exported["kind"] == "per_expert":  # o_groups 2; gate and up on one fused weight
        assert config["target_modules"] == [
            "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_proj",
            "mlp.shared_experts.up_proj", "self_attn.compressor.gate_proj",
            "self_attn.compressor.kv_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
            "self_attn.q_a_proj", "self_attn.q_b_proj",
        ]  # fmt: skip
        params = ["self_attn.o_a_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert config["target_parameters"] == params
        anchor = "mlp.shared_experts.down_proj"  # a targeted module: rank r, then the wider
        assert config["rank_pattern"] == {
            anchor: 4,
            f"{params[0]}|{anchor}": 8,
            f"{params[1]}|{anchor}": 8,
        }
        assert config["alpha_pattern"] == {
            anchor: 8.0,
            f"{params[0]}|{anchor}": 16.0,
            f"{params[1]}|{anchor}": 16.0,
        }
    else:
        assert config["target_modules"] == ["mlp.shared_experts.up_proj", "self_attn.kv_proj"]
        params = ["self_attn.o_a_proj.weight", "mlp.experts.gate_up_proj"]
        assert config["target_parameters"] == params
        anchor = "mlp.shared_experts.up_proj"  # up alone: rank r on gate_up
        assert config["rank_pattern"] == {anchor: 4, f"{params[0]}|{anchor}": 8}
    routers = ["mlp.gate"] if exported["kind"] == "shared" else None
    assert config["modules_to_save"] == routers
    assert (out / "tokenizer.json").is_file()
    meta = FileSystemReader(step_dir(run / "ckpt", 2)).read_metadata().state_dict_metadata
    mtp = [k for k in meta if k.startswith("model.mtp.") and is_adapter(k)]
    written = load_file(out / "adapter_model.safetensors")
    summary = exported["summary"]
    # every file of the export gets a new file's mode (safetensors' own is a private temp's)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~_umask()}, modes
    assert mtp and summary["mtp_adapter_tensors_left_out"] == len(mtp)
    assert summary["tensors"] == len(written) and summary["format"] == "peft"


def test_keys_and_shapes_are_the_ones_peft_makes(exported, release: Path) -> None:
    """PEFT's own model from the written config names and shapes every tensor as written; after
    from_pretrained it holds the written values."""
    out = exported["out"]
    written = load_file(out / "adapter_model.safetensors")
    config = peft.LoraConfig.from_pretrained(out)
    fresh = peft.get_peft_model(_hf(release), config)
    made = peft.get_peft_model_state_dict(fresh)
    assert {k: tuple(v.shape) for k, v in made.items()} == {
        k: tuple(v.shape) for k, v in written.items()
    }
    loaded = peft.get_peft_model_state_dict(_with_adapters(release, out))
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[k], written[k]) for k in written)
    nested = exported["kind"] == "per_expert"  # gate_up_proj inside down_proj's wrapper
    assert any(k.endswith("experts.base_layer.lora_B.weight") for k in written) == nested


@torch.no_grad()
def test_peft_on_transformers_computes_our_logits(exported, release: Path) -> None:
    ids = torch.randint(1, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    want = _trained(release, exported["run"])(ids).logits
    got = _with_adapters(release, exported["out"])(input_ids=ids).logits
    base = _hf(release)(input_ids=ids).logits
    assert _rel(base, want) > 1e-2  # the trained adapters matter to these logits
    err = _rel(got, want)
    print(f"\nPEFT on transformers vs ours ({exported['kind']}): {err:.2e} of max |logit|")
    assert err <= REL


@torch.no_grad()
def test_peft_merges_into_our_merged_weights(exported, release: Path, tmp_path: Path) -> None:
    """Every adapted weight, merged by PEFT and saved by transformers, read back by our loader:
    W + s B A of our model, per weight (experts no token reached included)."""
    merged = _with_adapters(release, exported["out"]).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    got = load_pretrained(tmp_path / "merged", progress=False).state_dict()
    model = _trained(release, exported["run"])
    state = {n: t for n, t in model.state_dict().items() if not n.startswith("mtp.")}
    want = {n: w for n, w in merged_weights(model).items() if n in state}  # no MTP in HF's
    assert want and want.keys() <= got.keys()
    for name, w in want.items():
        delta = w - state[name].float()
        assert float(delta.abs().max()) > 0, name  # trained: the check below can fail
        assert float((got[name] - w).abs().max()) <= WEIGHT_TOL * float(w.abs().max()), name
    base = {n: t for n, t in state.items() if not is_adapter(n) and n not in want}
    assert all(torch.equal(got[n], t) for n, t in base.items())  # the run's router bias too
    release_bias = load_pretrained(release, progress=False).state_dict()["layers.1.moe.router.bias"]
    moved = not torch.equal(got["layers.1.moe.router.bias"], release_bias)
    assert moved == (exported["kind"] == "shared")


def test_bfloat16_adapters_are_the_rounded_ones(exported, tmp_path: Path) -> None:
    summary = _export(exported["run"], tmp_path / "bf16", "--dtype", "bfloat16")
    got = load_file(tmp_path / "bf16" / "adapter_model.safetensors")
    want = load_file(exported["out"] / "adapter_model.safetensors")
    assert summary["dtype"] == "bfloat16" and got.keys() == want.keys()
    for k, t in want.items():  # adapters cast; routers (modules_to_save) as the model holds them
        assert torch.equal(got[k], t.to(torch.bfloat16) if ".lora_" in k else t), k


def test_refused_fp8_and_a_run_without_lora(
    exported, release: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["export", "--run", str(exported["run"]), "--format", "peft", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "fp8"), "--dtype", "fp8"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype fp8" in err and "--format peft" in err
    if exported["kind"] == "shared":  # once: a plain run of the same release
        plain = tmp_path / "plain"
        assert run_command(train, train_items(plain, release, steps=1)) == 0
        capsys.readouterr()  # the run's own report
        argv = ["export", "--run", str(plain / "run"), "--format", "peft", "--no-progress"]
        assert main([*argv, "--out", str(tmp_path / "none")]) == ExitCode.CONFIG
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "model.lora.rank is 0" in err
    assert not any(tmp_path.glob("fp8*")) and not any(tmp_path.glob("none*"))
