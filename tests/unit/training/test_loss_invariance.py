"""The step loss does not depend on how tokens are split into micro-batches or rows:
gradient accumulation over packs == one backward of the summed token-normalized loss, and the
packed (THD) layout == the unpacked (BSHD) layout on the same samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_fakes import FakeCorpus, tiny_run

from primus_v4.training.loss import count_tokens
from primus_v4.training.trainer import Trainer


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone()
        for n, p in trainer.model.named_parameters()
        if p.grad is not None
    }


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=name)


def test_accumulation_equals_one_backward_of_the_summed_loss(tmp_path: Path) -> None:
    run = tiny_run(tmp_path, "train.global_batch_size=4", "data.seq_length=128")
    packs = [[60, 40, 20], [120], [33, 70], [50, 50, 20]]
    trainer = Trainer(run, corpus=FakeCorpus(packs, seq_length=128))
    rows = trainer.source.rows(0)
    assert len(rows) == 4 and run.num_micro_batches == 4

    step = trainer.forward_backward(rows)  # 4 micro-batches, 4 backward calls
    accumulated = _grads(trainer)
    reported = step.reported()

    # Reference: the same 4 packs in one graph, one backward of the global token-mean loss.
    trainer.model.zero_grad(set_to_none=True)
    outs = [trainer.model(**trainer.model_inputs(r)) for r in rows]
    counts = count_tokens(rows, mtp_depths=1)
    main = sum(o.loss_sum for o in outs) / counts.supervised
    mtp = sum(o.mtp_loss_sums[0] for o in outs) / counts.mtp[0]
    # The balance loss is a mean over the step's samples (each pack's is a mean over its own).
    assert counts.samples == 9 and [r.num_samples for r in rows] == [3, 1, 2, 3]
    aux = sum(o.aux_loss * r.num_samples for o, r in zip(outs, rows, strict=True)) / 9
    assert float(aux.detach()) > 0
    (main + 0.1 * mtp + aux).backward()
    main, mtp, aux = main.detach(), mtp.detach(), aux.detach()

    # Same math, only the float32 summation order of 4 gradient buffers differs.
    _assert_close(accumulated, _grads(trainer), 1e-6)
    assert reported["loss"] == pytest.approx(float(main), rel=1e-6)
    assert reported["mtp_loss"] == pytest.approx(float(mtp), rel=1e-6)
    assert reported["aux_loss"] == pytest.approx(float(aux), rel=1e-6)
    assert counts.supervised == sum(int(o.num_tokens) for o in outs)
    assert counts.mtp[0] == sum(int(o.mtp_num_tokens[0]) for o in outs)


def test_packed_and_unpacked_layouts_give_the_same_loss_and_gradients(tmp_path: Path) -> None:
    packs = [[200, 40], [33, 150, 60]]  # one sample long enough for an HCA (ratio 128) key
    corpus = FakeCorpus(packs)
    # The MoE balance loss is a mean over the step's samples, so it too is layout-free; a large
    # coefficient makes its gradients as visible as the CE's.
    aux = "model.overrides.moe_aux_loss_coeff=0.5"
    thd = Trainer(tiny_run(tmp_path, "train.global_batch_size=2", aux), corpus=corpus)
    bshd_gbs = corpus.pack_sample_range(len(packs) - 1)[1]  # every sample of those 2 packs
    bshd = Trainer(
        tiny_run(tmp_path, "data.layout=bshd", f"train.global_batch_size={bshd_gbs}", aux),
        corpus=corpus,
    )
    assert sum(r.num_supervised for r in thd.source.rows(0)) == sum(
        r.num_supervised for r in bshd.source.rows(0)
    )
    loss_thd = thd.forward_backward(thd.source.rows(0)).reported()
    loss_bshd = bshd.forward_backward(bshd.source.rows(0)).reported()
    # float32 attention/MoE over different row layouts: reductions differ only in order.
    assert loss_thd["loss"] == pytest.approx(loss_bshd["loss"], rel=1e-5)
    assert loss_thd["mtp_loss"] == pytest.approx(loss_bshd["mtp_loss"], rel=1e-5)
    assert loss_thd["aux_loss"] > 0.1  # 0.5 x (a balance loss near 1) x MoE layers
    assert loss_thd["aux_loss"] == pytest.approx(loss_bshd["aux_loss"], rel=1e-5)
    _assert_close(_grads(thd), _grads(bshd), 1e-5)
