"""How the DeepSeek-V4.1 release stores each tensor, by name, and its tensors read decoded.

Storage kinds (`kind_of(release_name)`):
  fp8     float8_e4m3fn [out, in] + `.scale` e8m0 per 32 x 32 block (`FP8_32X32`): attention
          wq_a / wq_b / wkv / wo_a / wo_b, indexer wq_b, shared experts w1-w3, Engram wkv
  fp4     int8 [out, in/2], two e2m1 codes per byte (low nibble = even column) + `.scale` e8m0
          per 32 inputs (`FP4_1X32`): routed experts, one tensor per expert and projection
  fp8row  float8_e4m3fn [rows, head_dim] + `.scale` e8m0 per 32 values of a row (`FP8_1X32`):
          the Engram tables
  bf16    embed, head, every norm, router weight, compressor wkv / wgate, indexer wk /
          weights_proj, Engram q_weight / k_weight
  fp32    attn_sink, hc_{attn,ffn}_{fn,base,scale}, router bias and bias_vl
A name outside this table is not a V4.1 text tensor (`kind_of` raises naming it). `not_text`
names the release's tensors that are not the text model (vision tower, `aligner.*`, `image_*`,
the DSpark stages `mtp.*`, the image tokens' router bias `bias_vl`): a load leaves them, an
export copies them byte for byte.

`read_tensors(directory, want)` -> {release name: float32 tensor} of the logical tensors `want`
accepts (scales folded into their weights), each decoded exactly by its kind; a tensor stored
otherwise than its kind says is refused naming it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

from primus_v4.checkpoint_formats.fp8_fp4 import (
    FP4_1X32,
    FP8_1X32,
    FP8_32X32,
    QuantFormat,
    dequantize,
)
from primus_v4.checkpoint_formats.requantize import stored_views
from primus_v4.checkpoint_formats.sharded import CheckpointReader
from primus_v4.errors import CheckpointFormatError

FORMATS: dict[str, QuantFormat] = {"fp8": FP8_32X32, "fp4": FP4_1X32, "fp8row": FP8_1X32}
PLAIN: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
# CheckpointReader.storage() of each kind's stored tensor
STORED_AS = {"fp8": "fp8", "fp4": "fp4", "fp8row": "fp8", "bf16": "bf16", "fp32": "fp32"}

_L = r"(?:layers|mtp)\.\d+\."  # a decoder layer, or a DSpark stage (the same kinds)
KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), kind)
    for pattern, kind in (
        (rf"{_L}attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight", "fp8"),
        (rf"{_L}attn\.indexer\.wq_b\.weight", "fp8"),
        (rf"{_L}ffn\.shared_experts\.w[123]\.weight", "fp8"),
        (rf"{_L}engram\.wkv\.weight", "fp8"),
        (rf"{_L}ffn\.experts\.\d+\.w[123]\.weight", "fp4"),
        (rf"{_L}engram\.embed\.weight", "fp8row"),
        (r"(embed|head|norm)\.weight", "bf16"),
        (rf"{_L}(attn_norm|ffn_norm)\.weight", "bf16"),
        (rf"{_L}attn\.(q_norm|kv_norm|compressor\.norm|indexer\.k_norm)\.weight", "bf16"),
        (rf"{_L}attn\.compressor\.(wkv|wgate)\.weight", "bf16"),
        (rf"{_L}attn\.indexer\.(wk|weights_proj)\.weight", "bf16"),
        (rf"{_L}ffn\.gate\.weight", "bf16"),
        (rf"{_L}engram\.(q_weight|k_weight)", "bf16"),
        (rf"{_L}attn\.attn_sink", "fp32"),
        (rf"{_L}hc_(attn|ffn)_(fn|base|scale)", "fp32"),
        (rf"{_L}ffn\.gate\.(bias|bias_vl)", "fp32"),
        (r"(vision|aligner)\..*|image_(start|newline|end)", "bf16"),
        (r"mtp\.\d+\.main_proj\.weight", "fp8"),
        (r"mtp\.\d+\.(main_norm|norm)\.weight", "bf16"),
        (r"mtp\.\d+\.(markov_head\.(embed|head)|confidence_head\.proj)\.weight", "bf16"),
    )
)
NOT_TEXT = re.compile(r"(vision|aligner|mtp)\..*|image_.*|layers\.\d+\.ffn\.gate\.bias_vl")


def kind_of(name: str) -> str:
    """The storage kind of the release tensor `name` (see the module docstring)."""
    for pattern, kind in KINDS:
        if pattern.fullmatch(name):
            return kind
    raise CheckpointFormatError(f"'{name}': not a tensor of the DeepSeek-V4.1 text model")


def not_text(name: str) -> bool:
    """A release tensor that is not part of the text model (left by a load, carried by an
    export)."""
    return NOT_TEXT.fullmatch(name) is not None


def _part(name: str) -> str:
    """The part of the release a tensor outside the text model belongs to (its log group)."""
    head, _, rest = name.partition(".")
    if head == "mtp":
        return f"mtp.{rest.partition('.')[0]}"
    if head.startswith("image_"):
        return "image_*"
    if name.endswith(".bias_vl"):
        return "ffn.gate.bias_vl"
    if head in ("vision", "aligner"):
        return head
    return name.removesuffix(".scale").removesuffix(".weight")  # a text tensor kept as stored


def parts_summary(names: list[str]) -> str:
    """`names` grouped by part with counts, in one short phrase ("2,841 tensors: mtp.0 120,
    ...") instead of every name."""
    counts: dict[str, int] = {}
    for name in names:
        counts[_part(name)] = counts.get(_part(name), 0) + 1
    groups = ", ".join(f"{part} {n:,}" for part, n in sorted(counts.items()))
    return f"{len(names):,} tensor{'s' if len(names) != 1 else ''} ({groups})"


def check_stored(reader: CheckpointReader, name: str, kind: str) -> None:
    """Raise naming `name` unless the release stores it as `kind` says."""
    stored = reader.storage(name)
    if stored != STORED_AS[kind]:
        raise CheckpointFormatError(
            f"{reader.directory / reader.shard_of(name)}: '{name}' is stored {stored}, the "
            f"DeepSeek-V4.1 release layout has it {kind}"
        )


def read_stored(
    reader: CheckpointReader, name: str, fmt: QuantFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored codes and e8m0 scale of quantized `name`, undecoded (the codec's dtypes);
    a scale of another block shape is refused naming it."""
    n, k = reader.shape(name)  # logical: a packed FP4 weight reads as [N, K]
    weight = torch.empty(n, k if fmt.kind == "fp8" else k // 2, dtype=torch.uint8)
    scale = torch.empty(fmt.scale_shape(n, k), dtype=torch.uint8)
    reader.read_stored_into(name, weight, scale)
    return stored_views(weight, scale, fmt)


def read_decoded(reader: CheckpointReader, name: str) -> torch.Tensor:
    """One logical tensor of the release, decoded exactly into float32 by its kind."""
    kind = kind_of(name)
    check_stored(reader, name, kind)
    if kind in FORMATS:
        weight, scale = read_stored(reader, name, FORMATS[kind])
        return dequantize(weight, scale, torch.float32, fmt=FORMATS[kind])
    return reader.read(name, torch.float32)


def read_tensors(
    directory: str | os.PathLike, want: Callable[[str], bool] = lambda name: not not_text(name)
) -> dict[str, torch.Tensor]:
    """{release name: float32 tensor} of the release's logical tensors that `want` accepts (by
    default the text model's)."""
    with CheckpointReader(directory) as reader:
        return {name: read_decoded(reader, name) for name in reader.names() if want(name)}
