"""EP=2 checkpoints: save at step 3, resume into a fresh model, run to 6 == uninterrupted 6 steps
(exact), and the checkpoint holds each expert weight once as its global [E, ...] tensor.

Expert shards have the same local name on both EP ranks; without the DTensor sharding in
training/checkpoint/store.py one rank's experts would overwrite the other's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from harness import run_ranks
from torch.optim.lr_scheduler import LambdaLR
from train_fakes import RAGGED_PACKS, TEST_VOCAB, FakeCorpus

from primus_v4.data.thd import to_packed_seq_params
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model
from primus_v4.models.deepseek_v4.infra.parallelize import apply_expert_parallel
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel
from primus_v4.training.checkpoint.store import CheckpointManager
from primus_v4.training.optim.lr_schedule import warmup_cosine
from primus_v4.training.optim.zero import ShardedAdamW

EXPERT = "layers.1.moe.w_down"  # a top-k routed layer's expert weight, [E, D, F] globally


def _cfg() -> DeepseekV4Config:
    return DeepseekV4Config.preset("tiny", vocab_size=TEST_VOCAB, init_method_std=0.05)


def _state(ctx, seed: int) -> dict:
    torch.manual_seed(seed)
    model = DeepseekV4Model(_cfg())
    apply_expert_parallel(model, ctx.ep)
    opt = ShardedAdamW(list(model.named_parameters()), ctx, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                       weight_decay=0.1, offload_fraction=0.5)  # fmt: skip
    sched = LambdaLR(opt, warmup_cosine(lr=1e-2, min_lr=1e-3, warmup_steps=1, total_steps=6))
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _train(ctx, state: dict, start: int, stop: int, manager) -> list[float]:
    corpus, losses = FakeCorpus(RAGGED_PACKS), []
    for step in range(start, stop):
        row = corpus.thd_batch((2 * step + ctx.rank) % len(corpus))  # DP: a pack per rank
        state["optimizer"].zero_grad()
        out = state["model"](
            row.input_ids_S[None], row.position_ids_S[None],
            packed_seq_params=to_packed_seq_params(row), labels=row.labels_S[None],
            loss_mask=row.loss_mask_S[None], padding_mask=row.padding_mask_S[None],
        )  # fmt: skip
        (out.loss + 0.1 * out.mtp_loss + out.aux_loss).backward()
        state["optimizer"].reduce_gradients()  # over DP; expert shards have no replica at ep 2
        state["optimizer"].step()
        state["scheduler"].step()
        losses.append(out.loss.item())
        if manager is not None:
            manager.maybe_save(step + 1, final=step + 1 == stop, **state)
    return losses


def _resume(rank: int, world: int, root: str) -> tuple[list[float], list[float], torch.Tensor]:
    ctx = init_parallel(ParallelDims(world=world, ep=world), backend="gloo")
    reference = _train(ctx, _state(ctx, 0), 0, 6, None)
    first = _train(ctx, _state(ctx, 0), 0, 3, CheckpointManager(root, interval=3))
    state = _state(ctx, 42)  # different weights: everything must come from the checkpoint
    manager = CheckpointManager(root, interval=3)
    assert manager.load_latest(**state) == 3
    resumed = first + _train(ctx, state, 3, 6, manager)
    shard = dict(state["model"].named_parameters())[EXPERT].detach().clone()
    destroy_parallel()
    return reference, resumed, shard


def test_ep2_save_resume_matches_uninterrupted(tmp_path: Path) -> None:
    ranks = run_ranks(_resume, 2, str(tmp_path), timeout_s=120)
    for reference, resumed, _ in ranks:
        assert resumed == reference  # exact: same ops, same order, restored state
    experts = _cfg().num_moe_experts
    full = {"model": {EXPERT: torch.zeros(experts, *ranks[0][2].shape[1:])}}
    dcp.load(full, checkpoint_id=tmp_path / "step_00000006", no_dist=True)
    assert torch.equal(full["model"][EXPERT], torch.cat([r[2] for r in ranks]))
