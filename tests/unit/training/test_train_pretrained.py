"""`primus-v4 train` with `model.pretrained` and `primus-v4 export` of the run, end to end.

A tiny random checkpoint in the release layout (the real 129280-token vocabulary, so the real
tokenizer's ids fit) starts a run: its step-1 loss (measured before the first update) equals
the cross-entropy HF transformers' DeepseekV4ForCausalLM computes from the same checkpoint for
each sample of the step's pack run alone, over the same supervised tokens. The run's DCP
checkpoint exports to a directory HF loads with from_pretrained, holding the trained weights.
Resuming the run's own checkpoint takes precedence over model.pretrained.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from release_checkpoint import random_release_tensors, release_config, write_checkpoint

from primus_v4.commands import export, train
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import ConfigError
from primus_v4.pretrained import load_pretrained
from primus_v4.training.metrics import read_metrics

transformers = pytest.importorskip("transformers", minversion="5.23")

REL_TOL = 1e-5  # float32; packed vs alone and our vs HF summation order (~3e-6 on logits)
VOCAB = 129280


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {**release_config("a"), "vocab_size": VOCAB}
    return write_checkpoint(tmp_path_factory.mktemp("pretrained") / "release", config,
                            random_release_tensors(config, seed=3))  # fmt: skip


def _items(tmp: Path, pretrained: Path, steps: int) -> list[str]:
    return [
        "model.preset=null",
        f"model.pretrained={pretrained}",
        "data.path=synthetic:rows=24",
        "data.seq_length=256",
        f"data.cache_dir={tmp / 'cache'}",
        f"data.lock_dir={tmp / 'locks'}",
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.global_batch_size=1",
        f"output.dir={tmp / 'run'}",
        "output.progress_bar=false",
        "output.plot=false",
        f"checkpoint.dir={tmp / 'run' / 'ckpt'}",
    ]


def _run(module, items: list[str], extra: tuple[str, ...] = ()) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args([*extra, *(a for i in items for a in ("--set", i))]))


@pytest.fixture(scope="module")
def trained(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("train")
    assert _run(train, _items(tmp, checkpoint, steps=1)) == 0
    return tmp


def _hf(path: Path):
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info  # HF has no MTP
    return model.eval()


@torch.no_grad()
def test_step1_loss_equals_hf_cross_entropy_of_each_sample_alone(
    checkpoint: Path, trained: Path
) -> None:
    from primus_v4.training.batches import BatchSource
    from primus_v4.training.trainer import build_corpus

    run = resolve_run(load_config(trained / "run" / "config.yaml"), world=1)
    cfg = run.cfg
    source = BatchSource(build_corpus(run), layout=cfg.data.layout, seed=cfg.train.seed,
                         global_batch_size=cfg.train.global_batch_size,
                         shuffle=cfg.train.shuffle)  # fmt: skip
    hf = _hf(checkpoint)
    ce_sum, tokens, samples = 0.0, 0, 0
    for row in source.rows(0, dp_rank=0, dp_size=1):
        cu = row.cu_seqlens_N1.tolist()
        for a, b in itertools.pairwise(cu):
            mask = row.loss_mask_S[a:b] > 0
            if not mask.any():
                continue
            logits = hf(input_ids=row.input_ids_S[a:b][None]).logits[0].double()
            ce = F.cross_entropy(logits[mask], row.labels_S[a:b][mask], reduction="sum")
            ce_sum, tokens, samples = ce_sum + float(ce), tokens + int(mask.sum()), samples + 1
    assert samples >= 2  # a real pack: several samples, each run alone by HF
    first = read_metrics(trained / "run" / "metrics.jsonl")[0]
    assert first["supervised_tokens"] == tokens
    assert abs(first["loss"] - ce_sum / tokens) <= REL_TOL * ce_sum / tokens, (first, ce_sum)


@torch.no_grad()
def test_export_of_the_run_loads_in_hf_with_the_trained_weights(trained: Path) -> None:
    import torch.distributed.checkpoint as dcp

    out = trained / "export_bf16"
    assert _run(export, [], ("--run", str(trained / "run"), "--out", str(out),
                             "--no-progress")) == 0  # fmt: skip
    written = json.loads((out / "config.json").read_text())
    assert written["vocab_size"] == VOCAB and "quantization_config" not in written
    assert (out / "tokenizer.json").is_file()  # the run's tokenizer travels with it
    hf = _hf(out)
    step = trained / "run" / "ckpt" / "step_00000001"
    ours = {"embedding.weight": torch.empty(VOCAB, 64), "lm_head.weight": torch.empty(VOCAB, 64)}
    dcp.load({"model": ours}, checkpoint_id=step, no_dist=True)
    # bf16 export of the trained float32 weights: HF holds them rounded to bf16
    hf_sd = hf.state_dict()
    for ours_name, hf_name in (("embedding.weight", "model.embed_tokens.weight"),
                               ("lm_head.weight", "lm_head.weight")):  # fmt: skip
        assert torch.equal(hf_sd[hf_name], ours[ours_name].to(torch.bfloat16).float())


def test_fp8_export_of_the_run_reloads(trained: Path) -> None:

    out = trained / "export_fp8"
    assert _run(export, [], ("--run", str(trained / "run" / "ckpt"), "--out", str(out),
                             "--dtype", "fp8", "--no-progress")) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"
    model = load_pretrained(out, dtype=torch.float32, progress=False)
    logits = model(torch.tensor([[5, 900, 77, 12000]])).logits
    assert torch.isfinite(logits).all()


def test_resume_takes_precedence_over_pretrained(
    checkpoint: Path, trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # config.json only: reading any weight from here would fail, so a resume must read none
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((checkpoint / "config.json").read_text())
    items = _items(trained, weightless, steps=2)
    with caplog.at_level(logging.INFO, logger="primus_v4"):
        assert _run(train, items) == 0
    assert "takes precedence over model.pretrained" in caplog.text
    rows = read_metrics(trained / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]


def test_pretrained_and_preset_conflict(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.preset: 'tiny' conflicts with model.pretrained"):
        load_config(overrides=[f"model.pretrained={checkpoint}"])


def test_tokenizer_comes_from_the_checkpoint_unless_data_tokenizer(
    checkpoint: Path, tmp_path: Path
) -> None:
    from primus_v4.config.resolve import tokenizer_of

    with_tok = tmp_path / "with_tok"
    with_tok.mkdir()
    (with_tok / "config.json").write_text((checkpoint / "config.json").read_text())
    base = ["model.preset=null"]
    cfg = load_config(overrides=[*base, f"model.pretrained={checkpoint}"])
    assert tokenizer_of(cfg) is None  # no tokenizer.json there: the default DeepSeek-V4 one
    (with_tok / "tokenizer.json").write_text("{}")
    cfg = load_config(overrides=[*base, f"model.pretrained={with_tok}"])
    assert tokenizer_of(cfg) == str(with_tok)
    cfg = load_config(overrides=[*base, f"model.pretrained={with_tok}", "data.tokenizer=/x"])
    assert tokenizer_of(cfg) == "/x"
