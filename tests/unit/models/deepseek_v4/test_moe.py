"""MoE invariants: padding is never routed, hash layers follow the table, the balance loss is
per sample, an all-padding pack gives zero aux loss and finite zero grads, grouped == per-token.

Legend: T = rows, D = hidden, E = experts, K = top-k.
"""

from __future__ import annotations

import pytest
import torch

from primus_v4.kernels.grouped_experts import clamped_swiglu
from primus_v4.models.deepseek_v4 import DeepseekV4Config
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.moe import MoE, RoutingInputs, balance_loss


def _cfg(**kw) -> DeepseekV4Config:
    base = dict(vocab_size=64, num_hash_layers=1, moe_aux_loss_coeff=1.0)
    base.update(kw)
    return DeepseekV4Config.preset("tiny", **base)


def _moe(layer_idx: int = 1, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(_cfg(**kw), layer_idx=layer_idx)
    moe.init_weights(0.2)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    for p in moe.shared.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def _routing(ids_T, cu, pad_T=None) -> RoutingInputs:
    layout = RowLayout.from_cu_seqlens(torch.tensor(cu), local_rows=ids_T.shape[0])
    return RoutingInputs.build(ids_T, layout, pad_T)


class _SpyDispatcher:
    def __init__(self, inner) -> None:
        self.inner, self.rows = inner, None

    def dispatch(self, x_RD, expert_RK, num_experts):
        self.rows = x_RD.shape[0]
        return self.inner.dispatch(x_RD, expert_RK, num_experts)

    def combine(self, y_MD, weight_RK, handle):
        return self.inner.combine(y_MD, weight_RK, handle)


def test_padding_rows_are_never_routed():
    moe = _moe()
    spy = _SpyDispatcher(moe.dispatcher)
    moe.dispatcher = spy
    x_TD = torch.randn(10, 64)
    pad_T = torch.tensor([False] * 7 + [True] * 3)
    y_TD, _ = moe(x_TD, _routing(torch.arange(10), [0, 4, 7, 10], pad_T))
    assert spy.rows == 7
    # Pad rows receive only the shared expert; real rows are unaffected by the pad rows.
    shared = moe.shared(x_TD[7:])
    torch.testing.assert_close(y_TD[7:], shared, rtol=1e-6, atol=1e-6)  # GEMM blocking by row count
    y_real, _ = moe(x_TD[:7], _routing(torch.arange(7), [0, 4, 7]))
    torch.testing.assert_close(y_TD[:7], y_real, rtol=1e-5, atol=1e-5)  # fp32 GEMM blocking by rows


def test_hash_layer_routes_by_token_table():
    moe = _moe(layer_idx=0)
    assert moe.hashed
    ids_T = torch.tensor([3, 3, 17, 42, 5])
    x_TD = torch.randn(5, 64)
    expert_RK, weight_RK, scores_RE = moe.router(x_TD, _routing(ids_T, [0, 5]))
    torch.testing.assert_close(expert_RK, moe.router.tid2eid[ids_T].long(), rtol=0, atol=0)
    # Weights are the gate's own scores at the hashed experts, renormalized and scaled.
    picked = scores_RE.gather(1, expert_RK)
    torch.testing.assert_close(weight_RK, picked / picked.sum(-1, keepdim=True) * 1.5)
    # Same token, same experts whatever its hidden state; the table is reproducible from the seed.
    assert torch.equal(expert_RK[0], expert_RK[1])
    assert torch.equal(moe.router.tid2eid, _moe(layer_idx=0).router.tid2eid)


def test_learned_layer_routes_by_topk_scores():
    moe = _moe(layer_idx=1)
    x_TD = torch.randn(6, 64)
    expert_RK, _, scores_RE = moe.router(x_TD, _routing(torch.arange(6), [0, 6]))
    torch.testing.assert_close(expert_RK, scores_RE.topk(2, dim=-1).indices, rtol=0, atol=0)


def test_routed_layer_chooses_by_biased_scores_and_weights_by_raw_scores():
    """noaux_tc: top-k of s + gate.bias picks the experts, s at those experts (renormalized,
    x routed scaling factor) weights them; the bias never enters the weights."""
    moe = _moe(layer_idx=1)
    x_TD = torch.randn(6, 64)
    routing = _routing(torch.arange(6), [0, 6])
    with torch.no_grad():
        moe.router.bias.copy_(torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 4.0]))  # forces 0 and 7
    expert_RK, weight_RK, scores_RE = moe.router(x_TD, routing)
    assert sorted(expert_RK[0].tolist()) == [0, 7] and all(
        sorted(r.tolist()) == [0, 7] for r in expert_RK
    )
    picked = scores_RE.gather(1, expert_RK)
    torch.testing.assert_close(weight_RK, picked / picked.sum(-1, keepdim=True) * 1.5)
    assert moe.router.bias.dtype == torch.float32 and not moe.router.bias.requires_grad
    assert "router.bias" in moe.state_dict() and "router.load" not in moe.state_dict()


def test_hash_table_is_a_persistent_int64_buffer():
    moe = _moe(layer_idx=0)
    table = moe.state_dict()["router.tid2eid"]
    assert table.dtype == torch.int64 and table.shape == (64, 2)
    assert not hasattr(moe.router, "bias") or "router.bias" not in moe.state_dict()


def test_balance_loss_is_per_sample_and_ignores_padding():
    moe = _moe()
    torch.manual_seed(1)
    x_TD = torch.randn(12, 64)
    pad_T = torch.tensor([False] * 9 + [True] * 3)
    _, aux_pack = moe(x_TD, _routing(torch.arange(12), [0, 2, 9, 12], pad_T))
    _, aux_a = moe(x_TD[:2], _routing(torch.arange(2), [0, 2]))
    _, aux_b = moe(x_TD[2:9], _routing(torch.arange(7), [0, 7]))
    # Mean over the two real samples; the padding segment is not a sample.
    torch.testing.assert_close(aux_pack, (aux_a + aux_b) / 2, rtol=1e-6, atol=0)  # fp32 sums
    _, aux_one = moe(x_TD[:9], _routing(torch.arange(9), [0, 9]))
    assert not torch.allclose(aux_pack, aux_one), "pack treated as one sequence"


def test_balance_loss_matches_v3_formula_for_one_sample():
    torch.manual_seed(2)
    scores_RE = torch.rand(5, 8) + 0.1
    expert_RK = scores_RE.topk(2, dim=-1).indices
    routing = _routing(torch.arange(5), [0, 5])
    f = torch.zeros(8).index_add(0, expert_RK.flatten(), torch.ones(10)) * 8 / (2 * 5)
    p = (scores_RE / scores_RE.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(balance_loss(expert_RK, scores_RE, routing), (f * p).sum())


def test_all_padding_gives_zero_aux_and_finite_zero_grads():
    moe = _moe()
    x_TD = torch.randn(6, 64, requires_grad=True)
    y_TD, aux = moe(x_TD, _routing(torch.arange(6), [0, 6], torch.ones(6, dtype=torch.bool)))
    assert aux.item() == 0.0
    (aux + 0.0 * y_TD.sum()).backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() == 0, name


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_grouped_experts_equal_per_token_loop(layer_idx):
    moe = _moe(layer_idx=layer_idx)
    moe.shared = None
    x_TD = torch.randn(9, 64)
    ids_T = torch.randint(0, 64, (9,))
    routing = _routing(ids_T, [0, 9])
    y_TD, _ = moe(x_TD, routing)
    expert_RK, weight_RK, _ = moe.router(x_TD, routing)
    ref = torch.zeros_like(x_TD)
    for t in range(9):
        for j in range(expert_RK.shape[1]):
            e = int(expert_RK[t, j])
            h = clamped_swiglu(moe.w_gate_up[e] @ x_TD[t], moe.limit) @ moe.w_down[e].t()
            ref[t] += weight_RK[t, j] * h
    torch.testing.assert_close(y_TD, ref, rtol=1e-5, atol=1e-6)  # summation order differs


def test_clamped_swiglu_limits():
    gu = torch.tensor([[100.0, -100.0, 100.0, -100.0]])
    out = clamped_swiglu(gu, 10.0)
    expected = torch.nn.functional.silu(torch.tensor([10.0, -100.0])) * torch.tensor([10.0, -10.0])
    torch.testing.assert_close(out[0], expected)
