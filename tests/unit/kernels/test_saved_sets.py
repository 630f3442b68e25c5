"""What each sparse-attention backend saves for backward beyond the reference, as the memory plan
counts it (kernels/saved_sets.py), against saved-tensor hooks: the op alone on packed layouts for
torch, our Triton kernel (interpreter) and primus-turbo's adapter (through a stand-in that saves
what its autograd function saves), and the whole tiny model on the Triton backend.

Legend: T = queries, H = heads, D = head dim, N = key-buffer rows.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from packed_cases import packed_case

from primus_v4.errors import ConfigError
from primus_v4.kernels import turbo
from primus_v4.kernels.registry import ENV_VAR
from primus_v4.kernels.saved_sets import attention_beyond_reference, planned_attention_backend
from primus_v4.kernels.sparse_attention import sparse_attention_torch, sparse_attention_triton
from primus_v4.memory.plan import saved_parts
from primus_v4.memory.saved_bytes import SavedBytes
from primus_v4.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model


class _SparseMLAStandIn(torch.autograd.Function):
    """primus_turbo's SparseMLAFunc as far as memory goes: it saves (q, kv, o, lse,
    topk_indices, attn_sink) as called; the math is the dense softmax of its contract."""

    @staticmethod
    def forward(ctx, q, kv, topk, sink, kv_lora_rank, scale):  # type: ignore[override]
        t, h, _ = q.shape
        mask = torch.zeros(t, kv.shape[0], dtype=torch.bool)
        rows, slots = (topk >= 0).nonzero(as_tuple=True)
        mask[rows, topk[rows, slots].long()] = True
        s = torch.einsum("thd,nd->thn", q, kv).float() * scale
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        sink_ = (sink if sink is not None else s.new_full((h,), float("-inf")))[None, :, None]
        lse = torch.logsumexp(torch.cat((s, sink_.expand(t, h, 1)), -1), -1)
        o = torch.einsum("thn,nd->thd", torch.exp(s - lse[..., None]), kv[:, :kv_lora_rank].float())
        o = o.to(q.dtype)
        ctx.save_for_backward(q, kv, o, lse, topk, sink)
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        raise NotImplementedError  # only what forward saves is measured here


def _turbo(q, kv, sink, **kw):
    return turbo.sparse_attention_turbo(q, kv, sink, **kw)


def _saved_beyond_inputs(fn, q, kv, sink, kw) -> int:
    """Bytes of the storages `fn` saves for backward that are not its inputs'."""
    inputs = {t.untyped_storage().data_ptr() for t in (q, kv, sink, *kw.values())
              if isinstance(t, torch.Tensor)}  # fmt: skip
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, kv, sink, **kw)
    return sum(seen.values())


def _candidates(kw) -> int:
    """The adapter's index width before padding: each range at its widest, then the indices."""
    widths = (kw["hi_TR"] - kw["lo_TR"]).amax(dim=0).clamp(min=0)
    return int(widths.sum()) + (kw["idx_TK"].shape[1] if kw["idx_TK"] is not None else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "triton", "primus_turbo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_backend_saves_what_the_plan_counts(monkeypatch, backend, dtype, seed) -> None:
    monkeypatch.setattr(turbo, "_lookup", lambda *_: (_SparseMLAStandIn.apply, None))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (int(torch.randint(2, 6, (1,), generator=gen)),),
                            generator=gen).tolist()  # fmt: skip
    dim = turbo.MLA_V_DIM if backend == "primus_turbo" else 16
    (q, kv, sink), kw = packed_case(lengths=lengths, window=8, topk=5, heads=2, dim=dim,
                                    seed=seed)  # fmt: skip
    q, kv = q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_()
    sink = sink.requires_grad_()
    fn = {"torch": sparse_attention_torch, "triton": sparse_attention_triton,
          "primus_turbo": _turbo}[backend]  # fmt: skip
    measured = _saved_beyond_inputs(fn, q, kv, sink, kw)
    lse = q.shape[0] * q.shape[1] * 4  # the float32 row log-sum-exp every backend keeps
    planned = attention_beyond_reference(
        backend, rows=q.shape[0], keys=kv.shape[0], heads=q.shape[1], head_dim=q.shape[2],
        candidates=_candidates(kw), b=q.element_size(),
    )  # fmt: skip
    assert measured == planned + lse


def _model_saved(cfg, monkeypatch, backend: str) -> dict[str, int]:
    monkeypatch.setenv(ENV_VAR, f"sparse_attention={backend}")
    torch.manual_seed(0)
    model = DeepseekV4Model(cfg)
    seq, ids = 192, torch.randint(1, 512, (1, 192))
    cu = torch.tensor([0, seq], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=seq, max_seqlen_kv=seq)  # fmt: skip
    with SavedBytes(model, cfg) as saved:
        model(ids, packed_seq_params=psp, labels=ids, loss_mask=torch.ones(1, seq))
    return saved.by_kind()


def test_the_model_on_triton_saves_what_the_plan_adds(monkeypatch) -> None:
    """Triton against torch, per layer kind: the measured difference is the planned one."""
    cfg = DeepseekV4Config.preset("tiny", vocab_size=512)
    torch_saved = _model_saved(cfg, monkeypatch, "torch")
    triton_saved = _model_saved(cfg, monkeypatch, "triton")
    for kind, layer in (("dense", 0), ("csa", 1), ("hca", 2), ("mtp", None)):
        plan = {
            b: sum(saved_parts(cfg, layer, rows=192, seq=192, b=4, attention_backend=b).values())
            for b in ("torch", "triton")
        }
        assert triton_saved[kind] - torch_saved[kind] == plan["triton"] - plan["torch"] > 0, kind


FLASH = {"heads": 64, "head_dim": 512}


def test_the_plan_takes_the_largest_set_auto_may_run(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    # Planning for a GPU from a CPU host: auto may run primus_turbo on Flash in bf16 ...
    assert planned_attention_backend(for_accelerator=True, b=2, **FLASH)[0] == "primus_turbo"
    # ... not in float32 or at a head shape its kernels refuse, where Triton is the largest.
    assert planned_attention_backend(for_accelerator=True, b=4, **FLASH)[0] == "triton"
    shape = {"heads": 4, "head_dim": 64}
    assert planned_attention_backend(for_accelerator=True, b=2, **shape)[0] == "triton"
    # A CPU run's auto is the reference.
    assert planned_attention_backend(for_accelerator=False, b=2, **FLASH)[0] == "torch"
    monkeypatch.setenv(ENV_VAR, "auto,sparse_attention=triton")
    backend, why = planned_attention_backend(for_accelerator=True, b=2, **FLASH)
    assert backend == "triton" and ENV_VAR in why
    monkeypatch.setenv(ENV_VAR, "sparse_attention=grouped_mm")
    with pytest.raises(ConfigError, match="grouped_mm"):
        planned_attention_backend(for_accelerator=True, b=2, **FLASH)


def test_flash_per_row_extras_at_4k() -> None:
    """The arithmetic at Flash's CSA shape (4096 rows, window 128 + top-k 512): Triton keeps
    its output (64 x 512 bf16 = 64 KiB a row); turbo its 576-wide q copy and 512-wide output
    (136 KiB), 640 int32 indices (2.5 KiB) and the 576-wide key buffer copy."""
    rows, keys = 4096, 4096 + 127 + 1024
    args = {"rows": rows, "keys": keys, "heads": 64, "head_dim": 512, "candidates": 640, "b": 2}
    assert attention_beyond_reference("triton", **args) == rows * 65536
    want = rows * (64 * (576 + 512) * 2 + 640 * 4) + keys * 576 * 2
    assert attention_beyond_reference("primus_turbo", **args) == want
    assert attention_beyond_reference("torch", **args) == 0
