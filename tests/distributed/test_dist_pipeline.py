"""PP=2 (2 gloo processes) vs PP=1: same step loss, MTP and balance losses, and every parameter
gradient, for the tiny model with MTP (dense, CSA and HCA layers, MoE, mHC): 1F1B over 4 packs
on the even split and on a custom layout string whose first stage holds a routed MoE layer, and
the GPipe fallback (1 pack < 2 stages).

Both runs backpropagate the trainer's step objective (StepLoss: CE sums over the global token
counts of all micro-batches), so the only difference is where the layers run.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from train_fakes import RAGGED_PACKS, TEST_VOCAB, FakeCorpus

from primus_v4.data.thd import to_packed_seq_params
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model, ModelOutput
from primus_v4.models.deepseek_v4.infra.pipeline_stage import build_stage
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel
from primus_v4.parallel.pipeline_layout import parse_pp_layout, plan_stages
from primus_v4.parallel.pipeline_schedule import PipelineRunner
from primus_v4.training.loss import StepLoss, count_tokens

TOL = 1e-5  # float32: the stages run the same ops in the same order; only the CE/aux sums move


def _model() -> DeepseekV4Model:
    # A large balance-loss coefficient makes a wrongly weighted pack visible in the gradients.
    cfg = DeepseekV4Config.preset(
        "tiny", vocab_size=TEST_VOCAB, init_method_std=0.05, moe_aux_loss_coeff=0.5
    )
    torch.manual_seed(0)
    return DeepseekV4Model(cfg)


def _rows(packs: int):
    corpus = FakeCorpus(RAGGED_PACKS)
    return [corpus.thd_batch(i) for i in range(packs)]


def _inputs(row) -> dict:
    return {
        "input_ids": row.input_ids_S[None],
        "position_ids": row.position_ids_S[None],
        "packed_seq_params": to_packed_seq_params(row),
        "labels": row.labels_S[None],
        "loss_mask": row.loss_mask_S[None],
        "padding_mask": row.padding_mask_S[None],
    }


def _step_loss(rows, depths: int) -> StepLoss:
    return StepLoss(count_tokens(rows, mtp_depths=depths), mtp_scale=0.1)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(packs: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    model, rows = _model(), _rows(packs)
    step_loss = _step_loss(rows, 1)
    for row in rows:
        step_loss.objective(model(**_inputs(row)), samples=row.num_samples).backward()
    return step_loss.reported(), _grads(model)


def _pipeline(rank: int, world: int, layout: str | None, packs: int) -> tuple[dict, dict]:
    ctx = init_parallel(ParallelDims(world=world, pp=world), backend="gloo")
    full, rows = _model(), _rows(packs)
    spec = plan_stages(pp=world, num_layers=3, mtp_num_layers=1, layout=layout)[ctx.pp.rank]
    stage = build_stage(full, spec)
    runner = PipelineRunner(stage, ctx, device=torch.device("cpu"), output=ModelOutput.from_sums)
    step_loss = _step_loss(rows, 1)
    runner.run([_inputs(r) for r in rows], step_loss, samples=[r.num_samples for r in rows])
    reported = step_loss.reported()
    destroy_parallel()
    return reported, _grads(stage)


def test_layout_strings_parse() -> None:
    flash = parse_pp_layout("Et*14|t*14|t*15mL", pp=3, num_layers=43, mtp_num_layers=1)
    assert [len(s.decoder_layers) for s in flash] == [14, 14, 15] and flash[2].mtp_depths == (0,)
    assert flash[0].has_embedding and flash[2].has_loss and not flash[1].has_loss


@pytest.mark.parametrize(
    ("layout", "packs"),
    [(None, 4), ("Et*2|tmL", 4), ("Et*2|tmL", 1)],
    # Stage 0 of "Et*2|tmL" holds a routed MoE layer: its balance loss of packs with different
    # sample counts (3, 2, 3, 3) reaches the backward through the stage output.
    ids=["1f1b", "1f1b-balance-loss-on-stage-0", "gpipe"],
)
def test_pp2_matches_pp1(layout: str | None, packs: int) -> None:
    ref_losses, ref_grads = _reference(packs)
    ranks = run_ranks(_pipeline, 2, layout, packs, timeout_s=120)
    seen: set[str] = set()
    for reported, grads in ranks:
        assert reported == pytest.approx(ref_losses, rel=TOL)
        for name, g in grads.items():
            want = ref_grads[name]
            # Relative to the tensor's own scale (gradients here are 1e-5 .. 1e-1).
            err = (g - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            assert err <= TOL, f"{name}: relative max error {err:.3g}"
            seen.add(name)
    assert seen == set(ref_grads), f"gradients missing on every stage: {set(ref_grads) - seen}"
