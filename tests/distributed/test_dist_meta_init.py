"""Meta-device build: a PP=2 x EP=2 rank (4 gloo processes) that builds the model on the meta
device, cuts its stage and expert shard there and materializes only those holds exactly the
parameters (expert rows) and buffers of the whole model built in one process with the same seed,
and never allocates the other stage's parameters.
"""

from __future__ import annotations

import torch
from harness import run_ranks
from train_fakes import TEST_VOCAB

from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.models.deepseek_v4.infra.parallelize import parallelize
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel

SEED = 7


def _cfg() -> DeepseekV4Config:
    return DeepseekV4Config.preset("tiny", vocab_size=TEST_VOCAB, init_method_std=0.05)


def _materialize(rank: int, world: int) -> dict:
    ctx = init_parallel(ParallelDims(world=world, pp=2, ep=2), backend="gloo")
    try:
        torch.manual_seed(1000 + rank)  # ranks' global RNG differ; init must not depend on it
        with torch.device("meta"):
            full = DeepseekV4Model(_cfg())
        done = parallelize(
            full, ctx, pp_layout=None, packed=True, device=torch.device("cpu"), seed=SEED
        )
        model = done.model
        params = {
            name: (p.detach().clone(), getattr(p, "expert_parallel", False))
            for name, p in model.named_parameters()
        }
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        return {"pp": ctx.pp.rank, "ep": ctx.ep.rank, "params": params, "buffers": buffers}
    finally:
        destroy_parallel()


def test_pp2_ep2_rank_materializes_its_share_of_the_full_model() -> None:
    ranks = run_ranks(_materialize, 4, timeout_s=120)
    ref = DeepseekV4Model(_cfg(), seed=SEED)
    ref_params = dict(ref.named_parameters())
    ref_buffers = dict(ref.named_buffers())
    full_numel = sum(p.numel() for p in ref.parameters())
    experts = ref.cfg.num_moe_experts
    seen: set[str] = set()
    for r in ranks:
        numel = 0
        for name, (value, sharded) in r["params"].items():
            want = ref_params[name].detach()
            if sharded:
                local = experts // 2
                want = want[r["ep"] * local : (r["ep"] + 1) * local]
            # Bit-identical: each parameter (expert) draws from its own (seed, name) generator.
            assert torch.equal(value, want), (r["pp"], r["ep"], name)
            numel += value.numel()
            seen.add(name)
        for name, value in r["buffers"].items():
            assert torch.equal(value, ref_buffers[name]), (r["pp"], r["ep"], name)
        assert numel < full_numel, (r["pp"], r["ep"], numel, full_numel)
        if r["pp"] == 0:
            assert not any(n.startswith(("lm_head.", "mtp.", "head_hc.")) for n in r["params"])
        else:
            assert not any(n.startswith("layers.0.") for n in r["params"])
    assert seen == set(ref_params), set(ref_params) ^ seen
