"""DeepSeek-V4.1's base kept as released (`model.lora.base: release`, release/kept_base.py) on
the golden release: every FP8 (32 x 32) / FP4 weight stays as its stored bytes and decodes to
exactly what the loader decodes; with fresh adapters the logits are the decoded base's bit for
bit; with trained adapters logits and adapter gradients equal the decoded-base model's; a
random-init base is quantized as the release's writer quantizes it."""

from __future__ import annotations

import copy

import pytest
import torch
from dsv41_model import CHECKPOINT, documents, golden, next_token_labels, pack

from primus_v4.config.schema import LORA_ENGRAM_TARGETS, LORA_TARGETS
from primus_v4.models.common.kept_base import release_weights
from primus_v4.models.common.lora import LoraSpec
from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.lora import apply_lora
from primus_v4.models.deepseek_v41.model import DeepseekV41Model
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release.kept_base import keep_release_base
from primus_v4.models.deepseek_v41.release.load import check, load_pretrained

ALL = LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS + LORA_ENGRAM_TARGETS)
TOL = 1e-5  # the V4 kept-base tolerance: float32, summation order only


def _load(keep: bool) -> torch.nn.Module:
    token_map = golden()["token_map"]
    return load_pretrained(CHECKPOINT, progress=False, keep_release=keep, token_map=token_map)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    return _load(False), _load(True)


def _logits_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    docs = documents()[:2]
    ids, pos, psp = pack(docs)
    with torch.no_grad():
        logits = model(ids, pos, packed_seq_params=psp).logits
    model(ids, pos, packed_seq_params=psp, labels=next_token_labels(docs)).loss_sum.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return logits, grads


def test_kept_weights_decode_to_the_loaders_bits(pair) -> None:
    decoded, kept = pair
    cfg = decoded.cfg
    quantized = {n for n, e in adapter.name_table(cfg).items() if e.kind in ("fp8", "fp4")}
    weights = {w.ours: w for w in release_weights(kept)}
    assert weights.keys() == quantized
    assert {w.fmt.name for w in weights.values()} == {"fp8-32x32", "fp4-1x32"}
    reference = decoded.state_dict()
    assert all(torch.equal(w(), reference[n]) for n, w in weights.items())
    own = kept.state_dict()
    assert own.keys() == reference.keys() - quantized  # no base bytes in a checkpoint
    assert all(torch.equal(own[n], reference[n]) for n in own)
    check(CHECKPOINT, cfg, keep_release=True)


def test_fresh_adapters_give_the_decoded_base_logits_and_trained_ones_its_gradients(pair) -> None:
    decoded, kept = (copy.deepcopy(m) for m in pair)
    for m in (decoded, kept):
        apply_lora(m, ALL, seed=5)
    with torch.no_grad():
        docs = documents()[:2]
        ids, pos, psp = pack(docs)
        assert torch.equal(kept(ids, pos, packed_seq_params=psp).logits,
                           decoded(ids, pos, packed_seq_params=psp).logits)  # fmt: skip
        gen = torch.Generator().manual_seed(12)
        mine = dict(kept.named_parameters())
        for name, a in decoded.named_parameters():
            if a.requires_grad:
                a.copy_(torch.randn(a.shape, generator=gen) * 0.05)
                mine[name].copy_(a)
    (got, got_grads), (want, want_grads) = _logits_and_grads(kept), _logits_and_grads(decoded)
    assert float((got - want).abs().max() / want.abs().max()) < TOL
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, g in got_grads.items():
        w = want_grads[name]
        assert float((g - w).abs().max() / w.abs().max().clamp(min=1e-30)) < TOL, name


def test_a_random_init_base_is_quantized_as_the_release_writes_it() -> None:
    cfg = DeepseekV41Config.preset("tiny_v41")
    torch.manual_seed(0)
    model = DeepseekV41Model(cfg)
    decoded = copy.deepcopy(model)
    assert keep_release_base(model, cfg, dtype=torch.float32) > 0
    from primus_v4.checkpoint_formats.fp8_fp4 import dequantize, quantize
    from primus_v4.models.deepseek_v41.release.tensors import FORMATS

    reference = decoded.state_dict()
    for w in release_weights(model):
        entry = adapter.name_table(cfg)[w.ours]
        fmt = FORMATS[entry.kind]
        parts = [dequantize(*quantize(p, fmt=fmt), torch.float32, fmt=fmt)
                 for p in adapter.split(entry, reference[w.ours])]  # fmt: skip
        assert torch.equal(w(), adapter.join(entry, parts)), w.ours
