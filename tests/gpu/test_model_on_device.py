"""The tiny model's packing contract on the device, with the CPU tests' own packs and helpers:
a pack equals its samples run alone, and no gradient crosses a sample boundary."""

from __future__ import annotations

import itertools

import pytest
import torch
from cpu_helpers import load
from kernel_cases import relative_error

from primus_v4.kernels import registry
from primus_v4.models.deepseek_v4 import DeepseekV4Model

pytestmark = pytest.mark.gpu

# float32: packed and alone run GEMMs and softmaxes over different row counts, so device
# kernels tile them differently; 1e-4 of the logit scale bounds that reordering noise.
# bfloat16: the same reordering after bf16 rounding (2^-8) through 3 layers + MTP; the CPU bf16
# path measures 3.2e-2 on the 130-row sample, so 6e-2 (2x). Isolation itself is checked exactly
# by the cross-sample gradient test below.
TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}
DTYPES = pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16"])


def _model(device: torch.device, dtype: torch.dtype) -> DeepseekV4Model:
    cpu = load("unit/models/test_model.py")
    torch.manual_seed(0)
    model = DeepseekV4Model(cpu.tiny_cfg(init_method_std=0.05))
    return model.to(device=device, dtype=dtype)


def _pack(device: torch.device) -> dict[str, torch.Tensor]:
    cpu = load("unit/models/test_model.py")
    return {k: v.to(device) for k, v in cpu.make_pack().items()}


@DTYPES
def test_pack_equals_each_sample_alone(device, dtype):
    cpu = load("unit/models/test_model.py")
    model, p = _model(device, dtype), _pack(device)
    with torch.no_grad():
        out, _ = cpu.run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"])
        heads = [out.logits, *out.mtp_logits]
        cu = p["cu"].tolist()
        for a, b in itertools.pairwise(cu[:-1]):  # every real sample (not the pad segment)
            alone, _ = cpu.run(model, p["ids"][a:b])
            for packed_h, alone_h in zip(heads, [alone.logits, *alone.mtp_logits], strict=True):
                err = relative_error(packed_h[0, a:b].cpu(), alone_h[0].cpu())
                assert err <= TOL[dtype], (dtype, a, b, err)


@DTYPES
def test_auto_backends_equal_the_torch_backends(device, dtype, monkeypatch):
    """The model as auto builds it on this device (primus_turbo / triton / grouped_mm where
    their probes accept) against the same weights on the torch reference backends."""
    cpu = load("unit/models/test_model.py")
    built = {}
    for spec in ("torch", "auto"):
        monkeypatch.setenv(registry.ENV_VAR, spec)
        torch.manual_seed(0)
        built[spec] = DeepseekV4Model(cpu.tiny_cfg(init_method_std=0.05)).to(device, dtype)
    built["auto"].load_state_dict(built["torch"].state_dict())
    p = _pack(device)
    grads = {}
    for spec, model in built.items():
        out, embs = cpu.run(model, p["ids"], cu=p["cu"], pos=p["pos"], padding=p["padding"],
                            labels=p["labels"], loss_mask=p["loss_mask"])  # fmt: skip
        total = out.loss + out.mtp_loss + out.aux_loss
        grads[spec] = (total.detach().float().cpu(), torch.autograd.grad(total, embs[0])[0].cpu())
    # the same tolerances as packed-vs-alone: both sides reorder and round the same math
    assert relative_error(grads["auto"][0], grads["torch"][0]) <= TOL[dtype]
    assert relative_error(grads["auto"][1], grads["torch"][1]) <= TOL[dtype]


@DTYPES
def test_no_gradient_crosses_samples(device, dtype):
    # Exact zero in any dtype: masked scores are -inf, so no path carries a gradient across.
    cpu = load("unit/models/test_model.py")
    model, p = _model(device, dtype), _pack(device)
    for victim, source in [(3, 2), (4, 3), (2, 1), (3, 0)]:
        assert cpu.cross_sample_grad(model, p, victim, source) == 0.0, (victim, source)
    assert cpu.cross_sample_grad(model, p, 3, 3) > 0.0  # the probe is live


@pytest.mark.parametrize("kind", ["dense", "csa", "hca"])
@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_shards_equal_unsharded(device, kind, size):
    """Contiguous CP shards (the CPU test's in-process comm, tensors on the device) reproduce
    the unsharded attention's output and gradients."""
    cp = load("unit/models/test_attention_cp.py")
    cfg = cp.DeepseekV4Config.preset(
        "tiny", attn_sliding_window=16, init_method_std=0.2, index_topk=8, index_topk_chunk=16
    )
    torch.manual_seed(0)
    att = cp.Attention(cfg, compress_ratio=cp.RATIOS[kind], layer_idx=1).to(device)
    with torch.no_grad():
        att.attn_sink.normal_()
    cu = torch.tensor([0, *cp.LENS]).cumsum(0).to(device)
    s = int(cu[-1])
    full = cp.RowLayout.from_cu_seqlens(cu, local_rows=s)
    pos = torch.arange(s, device=device) - full.seq_start_T.to(device)
    x = torch.randn(s, cfg.hidden_size, device=device, requires_grad=True)
    g = torch.randn(s, cfg.hidden_size, device=device)

    (att(x, positions_T=pos, layout=full) * g).sum().backward()
    y = att(x, positions_T=pos, layout=full).detach()
    ref_x = x.grad.clone()
    x.grad = None
    y_cp = cp._run_sharded(att, x, pos, cu, size)
    (y_cp * g).sum().backward()
    # float32 on the device: only chunk boundaries and summation order differ (as on CPU), but
    # device reductions reorder more freely than CPU ones: 1e-4 of the output scale.
    assert relative_error(y_cp.detach().cpu(), y.cpu()) <= 1e-4
    assert relative_error(x.grad.cpu(), ref_x.cpu()) <= 1e-4
