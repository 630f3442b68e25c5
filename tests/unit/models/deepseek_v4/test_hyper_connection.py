"""mHC: Sinkhorn gives a doubly-stochastic mix, everything is row-wise (no token mixing).

Legend: T = rows, K = streams, D = hidden.
"""

from __future__ import annotations

import torch

from primus_v4.models.deepseek_v4.hyper_connection import (
    HyperHead,
    HyperMixer,
    _sinkhorn,
    lift_streams,
    sinkhorn,
)


def test_sinkhorn_is_doubly_stochastic():
    torch.manual_seed(0)
    comb = sinkhorn(torch.randn(5, 4, 4), iters=20, eps=1e-6)
    assert (comb > 0).all()
    # Columns are normalized last (exact up to eps); rows converge to ~1e-6 in 20 iterations
    # for unit-scale logits.
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4), rtol=0, atol=1e-4)


def test_mixer_and_head_are_row_wise():
    torch.manual_seed(0)
    mixer = HyperMixer(hidden=8, k=4, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    head = HyperHead(hidden=8, k=4, eps=1e-6, norm_eps=1e-6)
    for m in (mixer, head):
        m.init_weights(0.5)
    x = torch.randn(6, 4, 8)
    perm = torch.randperm(6)

    def run(x_TKD):
        pre, post, comb = mixer.coefficients(x_TKD)
        out = mixer.write_back(x_TKD, mixer.collapse(x_TKD, pre) * 2, post, comb)
        return head(out)

    # Row permutation commutes with the whole mHC path: no information crosses rows.
    torch.testing.assert_close(run(x)[perm], run(x[perm]), rtol=0, atol=1e-6)  # fp32 einsum


def test_write_back_sums_over_combs_first_index():
    """y_j = post_j * f + sum_i comb[i, j] x_i (the release's direction; comb is not symmetric)."""
    mixer = HyperMixer(hidden=3, k=2, sinkhorn_iters=1, eps=0.0, norm_eps=1e-6)
    x = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # stream 0 = e0, stream 1 = e1
    comb = torch.tensor([[[0.9, 0.1], [0.3, 0.7]]])
    y = mixer.write_back(x, torch.zeros(1, 3), torch.zeros(1, 2), comb)
    torch.testing.assert_close(y[0, 0], torch.tensor([0.9, 0.3, 0.0]))
    torch.testing.assert_close(y[0, 1], torch.tensor([0.1, 0.7, 0.0]))


def test_lift_copies_embedding_to_every_stream():
    x = torch.randn(3, 5)
    lifted = lift_streams(x, 4)
    assert lifted.shape == (3, 4, 5)
    assert all(torch.equal(lifted[:, k], x) for k in range(4))


def test_mixer_coefficients_match_the_normalize_then_project_definition():
    torch.manual_seed(0)
    mixer = HyperMixer(hidden=8, k=4, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    mixer.init_weights(0.5)
    x = torch.randn(5, 4, 8) * 3
    flat = x.reshape(5, -1)
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    mix = normed @ mixer.proj.weight.t() + mixer.bias  # scales are 1 after init
    pre, post, comb = mixer.coefficients(x)
    # fp32: the row scale is applied after instead of before the GEMM.
    torch.testing.assert_close(pre, torch.sigmoid(mix[:, :4]) + 1e-6, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post, 2 * torch.sigmoid(mix[:, 4:8]), rtol=1e-5, atol=1e-6)
    ref = sinkhorn(mix[:, 8:].reshape(5, 4, 4), iters=20, eps=1e-6)
    torch.testing.assert_close(comb, ref, rtol=1e-5, atol=1e-6)


def test_recomputed_sinkhorn_has_the_plain_gradient():
    logits = torch.randn(3, 4, 4, requires_grad=True)
    probe = torch.randn(3, 4, 4)
    (g_ckpt,) = torch.autograd.grad((sinkhorn(logits, iters=20, eps=1e-6) * probe).sum(), logits)
    (g_ref,) = torch.autograd.grad((_sinkhorn(logits, 20, 1e-6) * probe).sum(), logits)
    torch.testing.assert_close(g_ckpt, g_ref, rtol=0, atol=0)  # same ops replayed
