"""EP=2 (2 gloo processes) vs EP=1: same outputs, losses, router outputs and gradients.

Each rank routes its own pack (as under data parallel); the EP=1 reference runs both packs
through the unsharded layer in one process, so its expert gradients are the sum both ranks'
tokens contribute, which is what each EP rank must hold for its own experts.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from harness import run_ranks

from primus_v4.models.deepseek_v4 import DeepseekV4Config
from primus_v4.models.deepseek_v4.infra.parallelize import shard_moe
from primus_v4.models.deepseek_v4.layout import RowLayout
from primus_v4.models.deepseek_v4.moe import MoE, RoutingInputs
from primus_v4.parallel.groups import ParallelDims, destroy_parallel, init_parallel

TOL = 1e-5  # float32; EP only regroups rows, so differences are summation-order rounding


def _moe(layer_idx: int) -> MoE:
    cfg = DeepseekV4Config.preset("tiny", vocab_size=64, moe_aux_loss_coeff=1.0)
    torch.manual_seed(0)
    moe = MoE(cfg, layer_idx=layer_idx)
    moe.init_weights(0.2)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    for p in moe.shared.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def _pack(rank: int) -> tuple[torch.Tensor, RoutingInputs, torch.Tensor, int]:
    """Rank-specific pack: 3 samples then padding (never routed), and a loss weight."""
    g = torch.Generator().manual_seed(10 + rank)
    t = 12 + 2 * rank
    pad_T = torch.zeros(t, dtype=torch.bool)
    pad_T[-3:] = True
    cu = torch.tensor([0, 4, 7 + rank, t - 3, t])
    ids_T = torch.randint(0, 64, (t,), generator=g)
    x_TD = torch.randn(t, 64, generator=g)
    layout = RowLayout.from_cu_seqlens(cu, local_rows=t)
    routing = RoutingInputs.build(ids_T, layout, pad_T)
    return x_TD, routing, torch.randn(t, 64, generator=g), t - 3


def _loss(moe: MoE, x_TD, routing, w_TD) -> tuple[torch.Tensor, torch.Tensor]:
    y_TD, aux = moe(x_TD, routing)
    return (y_TD * w_TD).sum() + aux, y_TD


def _compare(rank: int, world: int) -> dict[str, float]:
    ctx = init_parallel(ParallelDims(world=world, ep=2), backend="gloo")
    diffs: dict[str, float] = {}
    for layer_idx, kind in ((0, "hash"), (1, "topk")):
        ref = _moe(layer_idx)
        ep = copy.deepcopy(ref)
        shard_moe(ep, ctx.ep)
        lo, n = rank * 4, 4  # 8 experts over 2 ranks

        packs = [_pack(r) for r in range(world)]
        ref_losses, ref_ys, ref_x = [], [], []
        for x_TD, routing, w_TD, _ in packs:
            x_TD = x_TD.clone().requires_grad_()
            loss, y_TD = _loss(ref, x_TD, routing, w_TD)
            ref_losses.append(loss)
            ref_ys.append(y_TD.detach())
            ref_x.append(x_TD)
        torch.stack(ref_losses).sum().backward()

        x_TD, routing, w_TD, real_rows = packs[rank]
        x_TD = x_TD.clone().requires_grad_()
        loss, y_TD = _loss(ep, x_TD, routing, w_TD)
        loss.backward()
        assert ep.dispatcher.sent_rows == real_rows * 2, "padding rows were dispatched"

        router_ref = ref.router(x_TD.detach(), routing)
        router_ep = ep.router(x_TD.detach(), routing)
        assert torch.equal(router_ref[0], router_ep[0]), f"{kind}: routing changed"
        replicated = {
            "router": (ep.router.weight.grad, ref.router.weight.grad),
            "shared": (ep.shared.down.weight.grad, ref.shared.down.weight.grad),
        }
        for g_ep, _ in replicated.values():
            dist.all_reduce(g_ep)  # replicated params: their gradient is the sum over ranks
        checks = {
            "loss": (loss.detach(), ref_losses[rank].detach()),
            "y": (y_TD.detach(), ref_ys[rank]),
            "router_weights": (router_ep[1], router_ref[1]),
            "x_grad": (x_TD.grad, ref_x[rank].grad),
            "w_gate_up_grad": (ep.w_gate_up.grad, ref.w_gate_up.grad[lo : lo + n]),
            "w_down_grad": (ep.w_down.grad, ref.w_down.grad[lo : lo + n]),
            **{f"{k}_grad": v for k, v in replicated.items()},
        }
        for name, (got, want) in checks.items():
            err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            diffs[f"{kind}/{name}"] = err
            assert err <= TOL, f"{kind} {name}: relative max error {err:.3g} > {TOL}"
    destroy_parallel()
    return diffs


def test_ep2_matches_ep1() -> None:
    diffs = run_ranks(_compare, 2, timeout_s=90)
    worst = max(max(d.values()) for d in diffs)
    assert worst <= TOL
