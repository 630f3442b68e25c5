"""Selective recompute under CP2, PP2 and EP2 (gloo): every gradient is the same bits as the same
parallel run without recompute. The recomputed parts rerun the boundary exchanges, the
compressor gathers, the balance-loss all-reduce and the expert all-to-all inside backward, and a
pipeline stage recomputes while the other stage's micro-batches are in flight."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cp_layout import _pack
from test_cp_model import BASE, STRADDLE
from test_dist_pipeline import _inputs, _rows, _step_loss

from primus_v4.models.common.recompute_choice import MODULES
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model, ModelOutput
from primus_v4.models.deepseek_v4.infra.cp_batch import required_local_rows, shard_batch
from primus_v4.parallel.context_parallel import CpComm

SELECTIVE = {"recompute_granularity": "selective", "recompute_modules": list(MODULES)}


def _cp_grads(rank: int, cfg: DeepseekV4Config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DeepseekV4Model(cfg)
    assert (model.layers[0].recompute == set(MODULES)) == bool(cfg.recompute_modules)
    shard = shard_batch(_pack(*STRADDLE, seed=1), cp_rank=rank, cp_size=2, mtp_depths=1,
                        min_local_rows=required_local_rows(cfg))  # fmt: skip
    out = model(**shard.model_inputs(CpComm(dist.group.WORLD)))
    (out.loss_sum + out.mtp_loss_sums[0] + out.aux_loss).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _cp_same_bits(rank: int, world: int) -> list[str]:
    """Names whose gradient on this rank differs between no recompute and selective."""
    kw = dict(BASE, mtp_num_layers=1, mtp_compress_ratio=4)
    plain = _cp_grads(rank, DeepseekV4Config.preset("tiny", **kw))
    chosen = _cp_grads(rank, DeepseekV4Config.preset("tiny", **kw, **SELECTIVE))
    assert plain.keys() == chosen.keys() and plain
    return [k for k in plain if not torch.equal(plain[k], chosen[k])]


def test_cp2_selective_recompute_is_bit_identical() -> None:
    assert run_ranks(_cp_same_bits, 2, timeout_s=180) == [[], []]


def _pp_grads(rank: int, cfg: DeepseekV4Config, packs: int) -> dict[str, torch.Tensor]:
    from primus_v4.models.deepseek_v4.infra.pipeline_stage import build_stage
    from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel
    from primus_v4.parallel.pipeline_layout import plan_stages
    from primus_v4.parallel.pipeline_schedule import PipelineRunner

    ctx = init_parallel(ParallelDims(world=2, pp=2), backend="gloo")
    torch.manual_seed(0)
    spec = plan_stages(pp=2, num_layers=3, mtp_num_layers=1, layout=None)[ctx.pp.rank]
    full = DeepseekV4Model(cfg)
    assert (full.layers[0].recompute == set(MODULES)) == bool(cfg.recompute_modules)
    stage = build_stage(full, spec)
    runner = PipelineRunner(stage, ctx, device=torch.device("cpu"), output=ModelOutput.from_sums)
    rows = _rows(packs)
    runner.run([_inputs(r) for r in rows], _step_loss(rows, 1),
               samples=[r.num_samples for r in rows])  # fmt: skip
    destroy_parallel()
    return {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}


def _pp_same_bits(rank: int, world: int) -> list[str]:
    from test_dist_pipeline import TEST_VOCAB

    kw = dict(vocab_size=TEST_VOCAB, init_method_std=0.05, moe_aux_loss_coeff=0.5)
    plain = _pp_grads(rank, DeepseekV4Config.preset("tiny", **kw), packs=4)
    chosen = _pp_grads(rank, DeepseekV4Config.preset("tiny", **kw, **SELECTIVE), packs=4)
    assert plain.keys() == chosen.keys() and plain
    return [k for k in plain if not torch.equal(plain[k], chosen[k])]


def test_pp2_1f1b_selective_recompute_is_bit_identical() -> None:
    assert run_ranks(_pp_same_bits, 2, timeout_s=240) == [[], []]


def _ep_same_bits(rank: int, world: int) -> list[str]:
    """EP2: the MoE recomputed in backward (`moe`) replays its all-to-all dispatch and combine;
    every gradient equals the run without recompute."""
    from test_dist_expert_parallel import _moe, _pack

    from primus_v4.models.common.recompute import checkpointed
    from primus_v4.models.deepseek_v4.infra.parallelize import shard_moe
    from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel

    ctx = init_parallel(ParallelDims(world=world, ep=2), backend="gloo")
    differ = []
    for layer_idx in (0, 1):  # hash-routed, top-k routed
        plain, again = _moe(layer_idx), _moe(layer_idx)  # the same seeded weights
        shard_moe(plain, ctx.ep)
        shard_moe(again, ctx.ep)
        x_TD, routing, w_TD, _ = _pack(rank)
        grads = []
        for moe, wrap in ((plain, False), (again, True)):
            x = x_TD.clone().requires_grad_()
            y_TD, aux = checkpointed(moe, x, routing) if wrap else moe(x, routing)
            ((y_TD * w_TD).sum() + aux).backward()
            grads.append([x.grad, *(p.grad for p in moe.parameters())])
        for i, (a, b) in enumerate(zip(*grads, strict=True)):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                differ.append(f"layer {layer_idx} tensor {i}")
        assert grads[0][0] is not None and plain.dispatcher.sent_rows  # EP really dispatched
    destroy_parallel()
    return differ


def test_ep2_moe_recompute_is_bit_identical() -> None:
    assert run_ranks(_ep_same_bits, 2, timeout_s=120) == [[], []]
