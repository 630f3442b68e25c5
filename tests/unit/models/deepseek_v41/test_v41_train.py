"""The tiny V4.1 preset under the trainer: bf16 weights with float32 masters, recompute, the loss
falls; recompute (full or selective) gives the gradients of the plain backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dsv41_model import next_token_labels, pack
from train_fakes import RAGGED_PACKS, FakeCorpus, tiny_run

from primus_v4.models import model_spec
from primus_v4.training.trainer import Trainer

PRESET = "model.preset=tiny_v41"


def test_the_tiny_v41_preset_trains_in_bf16_with_recompute(tmp_path: Path) -> None:
    run = tiny_run(tmp_path, PRESET, "model.dtype=bfloat16", "model.recompute=full",
                   "train.steps=6", "train.lr=3e-3", "train.warmup_steps=0")  # fmt: skip
    trainer = Trainer(run, corpus=FakeCorpus(RAGGED_PACKS[:1]))  # one pack: memorized
    assert type(trainer.model).__name__ == "DeepseekV41Model"
    assert {p.dtype for p in trainer.model.layers[0].moe.parameters()} == {torch.bfloat16}
    assert all(s.master.dtype == torch.float32 for s in trainer.optimizer.slots)
    losses = [r.loss for r in trainer.train().rows]
    print("tiny_v41, bf16 + full recompute, 6 steps:", [round(x, 3) for x in losses])
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize(
    "granularity,modules",
    [("full", None), ("selective", ["layernorm", "mla_up_proj", "core_attn", "moe"])],
)
def test_recompute_gives_the_plain_gradients(granularity: str, modules) -> None:
    spec = model_spec("deepseek_v41")
    base = spec.config_class.preset("tiny_v41", vocab_size=512)
    extra = {"recompute_method": "uniform", "recompute_num_layers": 1} if modules is None else {}
    cfg = spec.config_class.preset(
        "tiny_v41", vocab_size=512, recompute_granularity=granularity,
        recompute_modules=modules, **extra,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (40, 90, 7)]
    ids, pos, psp = pack(docs)
    grads = []
    for c in (base, cfg):
        model = spec.build(c)
        model.init_weights(5)
        model(ids, pos, packed_seq_params=psp, labels=next_token_labels(docs)).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1])
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n
