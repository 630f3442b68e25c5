"""Router bias update: b_e += rate * sign(mean_load - load_e) on the step's loads; off at 0;
hash layers untouched; a recompute in backward (activation checkpointing) does not count twice.
"""

from __future__ import annotations

import torch

from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.models.deepseek_v4.router_bias import RouterBiasUpdate, routed_routers


def _model(**kw) -> DeepseekV4Model:
    cfg = DeepseekV4Config.preset("tiny", vocab_size=128, **kw)
    return DeepseekV4Model(cfg, seed=0).train()


def _forward(model: DeepseekV4Model, seed: int, *, backward: bool = False) -> None:
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(seed))
    loss = model(ids, labels=torch.roll(ids, -1, 1)).loss
    if backward:  # a recompute (activation checkpointing) runs the forward again in here
        loss.backward()


def test_update_follows_the_formula_over_the_whole_step() -> None:
    model = _model()
    update = RouterBiasUpdate([model], rate=1e-3)
    routers = routed_routers([model])
    assert routers and all(not r.hashed for r in routers)
    before = [r.bias.clone() for r in routers]
    for seed in (1, 2):  # two micro-batches: loads add up
        _forward(model, seed)
    loads = [r.load.clone() for r in routers]
    assert all(int(load.sum()) == 2 * 40 * model.cfg.moe_router_topk for load in loads)
    update.step()
    for r, b0, load in zip(routers, before, loads, strict=True):
        want = b0 + 1e-3 * torch.sign(load.mean() - load)
        assert torch.equal(r.bias, want)
        assert r.bias.dtype == torch.float32 and not bool(r.load.any())  # next step starts at 0


def test_rate_zero_is_off_and_hash_layers_have_no_bias() -> None:
    model = _model()
    update = RouterBiasUpdate([model], rate=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("router.bias")}
    _forward(model, 1)
    update.step()
    after = model.state_dict()
    assert before and all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(r.track_load for r in routed_routers([model]))
    assert "layers.0.moe.router.bias" not in after  # tiny: layer 0 is hash-routed


def test_skipped_step_drops_its_loads() -> None:
    model = _model()
    update = RouterBiasUpdate([model], rate=0.5)
    _forward(model, 1)
    bias = [r.bias.clone() for r in update.routers]
    update.step(apply=False)
    for r, b in zip(update.routers, bias, strict=True):
        assert torch.equal(r.bias, b) and not bool(r.load.any())


def test_activation_checkpointing_counts_each_row_once() -> None:
    plain = _model()
    ckpt = DeepseekV4Model(plain.cfg, activation_checkpointing=True, seed=0).train()
    assert ckpt.checkpoint
    for m in (plain, ckpt):
        RouterBiasUpdate([m], rate=1e-3)
        _forward(m, 3, backward=True)
    for a, b in zip(routed_routers([plain]), routed_routers([ckpt]), strict=True):
        assert torch.equal(a.load, b.load)


def test_bias_stays_float32_when_the_model_is_cast() -> None:
    model = _model().to(torch.bfloat16)
    assert all(r.bias.dtype == torch.float32 for r in routed_routers([model]))
