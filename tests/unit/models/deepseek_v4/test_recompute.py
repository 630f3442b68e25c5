"""Selective recompute: every choice gives the same loss and gradients, bit for bit, as no
recompute (float32, a ragged pack through a dense, a CSA and an HCA layer and an MTP depth) and
saves less for backward."""

from __future__ import annotations

import pytest
import torch
from test_model import make_pack, psp_of, tiny_cfg

from primus_v4.errors import ConfigError
from primus_v4.models.common.recompute_choice import MODULES
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model

CHOICES = [[m] for m in MODULES] + [list(MODULES)]


def _cfg(modules: list[str] | None, **kw) -> DeepseekV4Config:
    rec = {} if modules is None else dict(recompute_granularity="selective",
                                          recompute_modules=modules)  # fmt: skip
    # bf16-free tiny model; MTP depth of kind CSA so its layer exercises the indexer path too.
    return tiny_cfg(init_method_std=0.05, mtp_compress_ratio=4, **rec, **kw)


def _step(model: DeepseekV4Model, pack: dict) -> tuple[torch.Tensor, list, int]:
    """Loss, every parameter gradient and the bytes autograd saved (each storage once)."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(pack["ids"][None], pack["pos"][None], packed_seq_params=psp_of(pack["cu"]),
                    labels=pack["labels"][None], loss_mask=pack["loss_mask"][None],
                    padding_mask=pack["padding"][None])  # fmt: skip
    total = out.loss + out.mtp_loss + out.aux_loss
    params_ = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(total, params_, allow_unused=True)
    return total.detach(), list(grads), sum(seen.values())


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = DeepseekV4Model(_cfg(None))
    pack = make_pack(lengths=[3, 9, 130, 20], pad=4)
    return model.state_dict(), pack, _step(model, pack)


@pytest.mark.parametrize("modules", CHOICES, ids=lambda m: "+".join(m))
def test_selective_recompute_is_bit_identical_and_saves_less(reference, modules) -> None:
    state, pack, (loss, grads, saved) = reference
    model = DeepseekV4Model(_cfg(modules))
    model.load_state_dict(state)
    got_loss, got_grads, got_saved = _step(model, pack)
    assert torch.equal(got_loss, loss)
    for g0, g1 in zip(grads, got_grads, strict=True):
        assert (g0 is None) == (g1 is None)
        assert g0 is None or torch.equal(g0, g1)  # the same ops on the same inputs
    assert got_saved < saved


def test_a_discarded_part_is_rebuilt_before_its_consumer_reads_it() -> None:
    from primus_v4.models.common.recompute import DiscardedPart

    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    part = DiscardedPart(lambda a: torch.tanh(a) * 2)
    h = part(x)
    y = h @ w  # the consumer saves h
    part.discard(after=y)
    assert h.untyped_storage().nbytes() == 0  # released until backward needs it
    y.sum().backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    (torch.tanh(x2) * 2 @ w2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_unknown_or_empty_modules_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="mla_up_proj"):
        _cfg(["attention"])
    with pytest.raises(ConfigError, match="choose one or more"):
        _cfg([])
    assert _cfg(None).recompute_granularity is None
    assert DeepseekV4Config.preset("tiny", recompute_granularity="selective").recompute_modules


def _with_adapters(model: DeepseekV4Model) -> DeepseekV4Model:
    from primus_v4.config.schema import LORA_TARGETS
    from primus_v4.models.deepseek_v4.lora import LoraSpec, apply_lora

    apply_lora(model, LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS), seed=2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.requires_grad and name.endswith("B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_selective_recompute_keeps_every_adapter_gradient(reference) -> None:
    """LoRA adapters inside recomputed parts (wq_b's in mla_up_proj, the shared and routed
    experts') get the gradients they get without recompute, bit for bit."""
    state, pack, _ = reference
    got = []
    for modules in (None, list(MODULES)):
        model = DeepseekV4Model(_cfg(modules))
        model.load_state_dict(state)
        got.append(_step(_with_adapters(model), pack))
    (loss, want, _), (loss2, grads, _) = got
    assert torch.equal(loss2, loss) and len(grads) == len(want) > 40
    for g, w in zip(grads, want, strict=True):
        assert (g is None) == (w is None) and (w is None or torch.equal(g, w))
    assert sum(w is not None and bool(w.abs().max() > 0) for w in want) > 0.9 * len(want)
