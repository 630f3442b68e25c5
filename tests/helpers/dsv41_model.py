"""The DeepSeek-V4.1 model golden set (tests/fixtures/dsv41_golden): its model, documents, packs."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_golden"
CHECKPOINT = GOLDEN / "checkpoint"
IGNORE = -100


@functools.cache
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / "golden.safetensors")


@functools.cache
def golden_grads() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN / "grads.safetensors")


def documents() -> list[torch.Tensor]:
    g = golden()
    return [g[f"doc{i}.input_ids"] for i in range(len([k for k in g if k.endswith(".input_ids")]))]


def load_model():
    """The golden checkpoint as a float32 model with the stub tokenizer's token map."""
    from primus_v4.models.deepseek_v41.release.load import load_pretrained

    return load_pretrained(CHECKPOINT, dtype=torch.float32, token_map=golden()["token_map"])


def pack(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams]:
    """(ids [1, T], position ids [1, T], THD PackedSeqParams) of the documents in one row."""
    lens = [len(d) for d in docs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lens),
        max_seqlen_kv=max(lens),
    )
    pos = torch.cat([torch.arange(n) for n in lens])
    return torch.cat(docs)[None], pos[None], psp


def stored_bytes(directory: str | Path, names: list[str]) -> dict[str, tuple[str, torch.Tensor]]:
    """{stored name: (safetensors dtype, its bytes as uint8)} of tensors of a release
    directory, read as stored (no decoding)."""
    from safetensors import safe_open

    from primus_v4.checkpoint_formats.sharded import _weight_map

    where = _weight_map(Path(directory))
    out = {}
    for name in names:
        with safe_open(Path(directory) / where[name], "pt") as f:
            t = f.get_tensor(name)
        out[name] = (str(t.dtype), t.contiguous().view(-1).view(torch.uint8))
    return out


def next_token_labels(docs: list[torch.Tensor]) -> torch.Tensor:
    """[1, T]: each document's next token, IGNORE on its last row (never across documents)."""
    return torch.cat([torch.cat([d[1:], torch.tensor([IGNORE])]) for d in docs])[None]
