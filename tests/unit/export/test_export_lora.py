"""`primus-v4 export` of a LoRA run: the adapters merged into the base (float32, then cast), in
the release layout. From a release (model.pretrained, a tiny random one at the real vocabulary)
the merged export loads in HF transformers' DeepseekV4ForCausalLM; every written weight is the
bf16 rounding of W + (alpha / r) B A of the trained model (or of W where nothing is adapted),
and HF's logits on the export equal our merged model's. A random-init run merges into its own
drawn base. (That merging is the LoRA model's math: tests/unit/models/test_lora.py.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from pretrained_runs import run_command, train_items, write_pretrained

from primus_v4.commands import export, train
from primus_v4.config import load_config
from primus_v4.export.lora import is_adapter
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora, merged_weights
from primus_v4.models.deepseek_v4.release.load import load_pretrained
from primus_v4.training.checkpoint.store import step_dir

LORA = [
    "model.lora.rank=8",
    "model.lora.allow_random_base=true",
    "model.lora.alpha=16",
    "train.lr=0.05",
]
REL = 1e-5  # float32 logits of the same bf16 weights: summation order only (ours vs HF)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _trained_lora(release: Path, run: Path) -> torch.nn.Module:
    """Our model of `release` with the run's final adapters loaded (float32)."""
    cfg = load_config(run / "config.yaml")
    model = load_pretrained(release, progress=False)
    lora = cfg.model.lora
    spec = LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets),
                    expert_adapters=lora.expert_adapters)  # fmt: skip
    apply_lora(model, spec, seed=cfg.train.seed)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": adapters}, checkpoint_id=step_dir(run / "ckpt", 2), no_dist=True)
    model.load_state_dict(adapters, strict=False)
    assert any(float(t.abs().max()) > 0 for n, t in adapters.items() if n.endswith("_B"))
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("lora_export")
    release = write_pretrained(tmp / "release")
    assert run_command(train, [*train_items(tmp, release, steps=2), *LORA]) == 0
    out = tmp / "merged"
    assert run_command(export, [], ("--run", str(tmp / "run"), "--out", str(out),
                                    "--no-progress")) == 0  # fmt: skip
    return release, tmp / "run", out


@torch.no_grad()
def test_merged_export_writes_the_merged_weights(exported) -> None:
    release, run, out = exported
    model = _trained_lora(release, run)
    merged = merged_weights(model)
    written = load_pretrained(out, progress=False).state_dict()
    base = {n: t for n, t in model.state_dict().items() if not is_adapter(n)}
    assert written.keys() == base.keys()
    assert merged and merged.keys() <= written.keys()
    for name, w in written.items():
        want = merged.get(name, base[name].float())
        if want.is_floating_point() and name in merged:
            assert torch.equal(w, want.to(torch.bfloat16).float()), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and (out / "tokenizer.json").is_file()


@torch.no_grad()
def test_hf_loads_the_merged_export_with_our_logits(exported) -> None:
    out = exported[2]
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(1, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = load_pretrained(out, progress=False).eval()
    got = hf.eval()(input_ids=ids).logits
    want = ours(ids).logits
    assert _rel(got, want) <= REL


@pytest.mark.parametrize("base", ["bfloat16", "release"])
def test_a_random_init_run_merges_into_its_drawn_base(tmp_path: Path, base: str) -> None:
    """(base release: the drawn base quantized to FP8 / FP4, as the run held it)"""
    from lora_runs import lora_trainer as _trainer

    trainer = _trainer(tmp_path, "run", "train.steps=2", "checkpoint.interval=2", "train.lr=0.05",
                       f"model.lora.base={base}")  # fmt: skip
    trainer.train()
    model = trainer.model  # the drawn base with the trained adapters
    out = tmp_path / "merged"
    assert run_command(export, [], ("--run", str(tmp_path / "run" / "ckpt"), "--out", str(out),
                                    "--no-progress")) == 0  # fmt: skip
    written = load_pretrained(out, progress=False).state_dict()
    merged = merged_weights(model)
    assert merged
    for name, w in merged.items():
        assert torch.equal(written[name], w.to(torch.bfloat16).float()), name
    state = model.state_dict()
    state.update({w.ours: w() for w in release_weights(model)})
    assert (len(state) > len(model.state_dict())) == (base == "release")
    untouched = [n for n in written if n not in merged and written[n].is_floating_point()]
    assert untouched
    for n in untouched:  # bf16 kinds rounded, float32 ones (mHC, sinks) as they are
        w, want = written[n], state[n].float()
        assert torch.equal(w, want) or torch.equal(w, want.to(torch.bfloat16).float()), n


@torch.no_grad()
def test_fp8_merged_export_quantizes_the_float32_merge(exported, tmp_path: Path) -> None:
    """--dtype fp8: each adapted FP8 / FP4 weight is quantized from W + s B A in float32 (not
    from its bf16 rounding), the release's bytes and scales."""
    from primus_v4.checkpoint_formats.fp8_fp4 import quantize_fp4, quantize_fp8
    from primus_v4.models.deepseek_v4.release import state_dict_adapter as adapter
    from primus_v4.models.deepseek_v4.release.load import open_release, read_config

    release, run, _ = exported
    out = tmp_path / "merged_fp8"
    assert run_command(export, [], ("--run", str(run), "--out", str(out), "--dtype", "fp8",
                                    "--no-progress")) == 0  # fmt: skip
    cfg = read_config(release)
    kinds = {n: r.kind for n, r in adapter.release_tensors(cfg).items()}
    merged = merged_weights(_trained_lora(release, run))
    checked = {"fp8": 0, "fp4": 0}
    with open_release(out) as reader:
        for name, part in adapter.to_release(cfg, merged):
            kind = kinds[name]
            if kind not in checked:
                continue
            q, s = (quantize_fp8 if kind == "fp8" else quantize_fp4)(part.contiguous())
            codes = torch.empty(q.shape, dtype=torch.uint8)
            scales = torch.empty(s.shape, dtype=torch.uint8)
            assert reader.read_stored_into(name, codes, scales) == kind
            assert torch.equal(codes, q.view(torch.uint8)), name
            assert torch.equal(scales, s.view(torch.uint8)), name
            checked[kind] += 1
    assert checked["fp8"] > 10 and checked["fp4"] > 10
