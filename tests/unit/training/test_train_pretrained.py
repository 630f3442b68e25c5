"""`primus-v4 train` with `model.pretrained` and `primus-v4 export` of the run, against HF
transformers' DeepseekV4ForCausalLM (the oracle; it is in the test extra).

A tiny random checkpoint in the release layout (pretrained_runs.py) starts a run: its step-1
loss (measured before the first update) equals the cross-entropy HF computes from the same
checkpoint for each sample of the step's pack run alone, over the same supervised tokens. The
run's DCP checkpoint exports to a directory HF loads with from_pretrained, holding the trained
weights. The rest of the pretrained run's rules: test_train_pretrained_run.py.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from pretrained_runs import VOCAB, run_command

from primus_v4.commands import export
from primus_v4.config import load_config, resolve_run
from primus_v4.training.metrics.writer import read_metrics

REL_TOL = 1e-5  # float32; packed vs alone and our vs HF summation order (~3e-6 on logits)


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
    args = ("--run", str(trained / "run"), "--out", str(out), "--no-progress")
    assert run_command(export, [], args) == 0
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
