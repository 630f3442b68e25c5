"""DeepSeek-V4.1 out in its release layout, beside the release it came from or on its own.

`save_release(tensors, source, out, dtype=...)` writes {release name: float tensor} (decoded,
[out, in], routed experts one tensor per expert and projection, as `release/tensors.py` reads
them) as a release directory at `out`, atomically (a temp directory renamed into place):
- `dtype="fp8"` (as released): every tensor in its release kind (tensors.py): FP8 32 x 32,
  FP4 experts, Engram FP8 rows, bf16 and fp32 as stored. A block whose values equal the
  source's keeps the source's bytes (requantize.py: the block scale is not always recoverable
  from decoded values), so an unchanged release is written back bit for bit;
- `dtype="bfloat16"`: the quantized kinds as bf16, the rest as stored.
The source may be one of our bf16 exports (`write_release`), which stores the quantized kinds
as bf16 (but the Engram tables its run held frozen: FP8 rows): a tensor it stores bf16 has no
bytes to keep, so for fp8 it is quantized afresh by its kind, as `write_release` does.
Each tensor must be one the source stores, of the source's shape; every text tensor of the
source must be given. The source's tensors that are not the text model (`tensors.not_text`:
vision tower, `aligner.*`, `image_*`, DSpark `mtp.*`, `bias_vl`) and were not given are copied
byte for byte (carried.py) and named in one log line, as are the text tensors named in `keep`
(the frozen Engram tables of a run that placed them: the release's FP8 rows and scales, in a
bf16 export too); any other source tensor left out is an error. Of those, a quantized kind the
source stores bf16 is, in an fp8 export, read and quantized afresh instead (so the shards hold
what config.json declares) and named in a log line of its own. config.json is the one made
from the source's (an export's: `config_json.release_config`), else the source's, with the
release's `quantization_config` (FP8 32 x 32 blocks, FP4 experts) for fp8 and none for bf16;
the tokenizer files are copied.

`write_release(tensors, out, config=...)` writes a model that came from no release (a run from
a preset): every tensor quantized afresh by its kind for fp8, the quantized kinds as bf16 for
bf16; the tensors named in `rows` (frozen Engram tables the model held as FP8 rows) as FP8 rows
in either dtype; nothing is carried.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from primus_v4.checkpoint_formats.carried import copy_carried
from primus_v4.checkpoint_formats.fp8_fp4 import quantize
from primus_v4.checkpoint_formats.requantize import requantize
from primus_v4.checkpoint_formats.sharded import (
    SCALE_SUFFIXES,
    CheckpointReader,
    ExportDtype,
    WriteSummary,
    tokenizer_files,
    write_checkpoint,
)
from primus_v4.errors import CheckpointFormatError
from primus_v4.log import get_logger
from primus_v4.models.deepseek_v41.release.config_json import QUANTIZATION_CONFIG
from primus_v4.models.deepseek_v41.release.tensors import (
    FORMATS,
    check_stored,
    kind_of,
    not_text,
    parts_summary,
    read_stored,
)

log = get_logger(__name__)
Tensors = Mapping[str, torch.Tensor]


@dataclass(kw_only=True, frozen=True)
class ReleaseExport:
    """What `save_release` wrote: the writer's summary and the stored names carried over."""

    summary: WriteSummary
    carried: list[str]


def _stored_names(reader: CheckpointReader, name: str) -> list[str]:
    """The stored tensors of logical `name`: itself and its scale when it has one."""
    stored = set(reader.stored_names())
    base = name.removesuffix(".weight")
    scales = [base + s for s in SCALE_SUFFIXES if name.endswith(".weight") and base + s in stored]
    return [name, *scales]


def _check_source(reader: CheckpointReader, name: str) -> None:
    """Raise naming `name` unless the source stores it as the release layout does or, a
    quantized kind, as bf16 (a bf16 export's)."""
    kind = kind_of(name)
    if kind not in FORMATS or reader.storage(name) != "bf16":
        check_stored(reader, name, kind)


def _quantized_kind(name: str) -> str | None:
    """The quantized kind (FORMATS) of the release tensor `name`; None for another kind or a
    name outside the text model's table (a vision tower's)."""
    try:
        kind = kind_of(name)
    except CheckpointFormatError:
        return None
    return kind if kind in FORMATS else None


def _recoded(reader: CheckpointReader, name: str, dtype: ExportDtype) -> bool:
    """Whether the source's tensor `name`, not given, is re-encoded rather than copied: a
    quantized kind the source stores bf16, in an fp8 export."""
    return dtype == "fp8" and _quantized_kind(name) is not None and reader.storage(name) == "bf16"


def _checked(reader: CheckpointReader, pieces: Iterable[Tensors], given: set[str]) -> Iterator:
    """(name, tensor) of every piece, each checked against the source as it streams past."""
    known = set(reader.names())
    for piece in pieces:
        for name, tensor in piece.items():
            where = reader.directory
            if name not in known:
                raise CheckpointFormatError(f"'{name}': the release {where} has no such tensor")
            if tuple(tensor.shape) != reader.shape(name):
                raise CheckpointFormatError(
                    f"'{name}' {list(tensor.shape)}: the release {where} stores it as "
                    f"{list(reader.shape(name))}"
                )
            if name in given:
                raise CheckpointFormatError(f"'{name}' given twice to save_release")
            _check_source(reader, name)
            given.add(name)
            yield name, tensor


def _as_released(reader: CheckpointReader) -> Callable[[str, torch.Tensor], list]:
    """The encoder of the quantized kinds for an export as released (see requantize.py)."""

    def encode(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        fmt = FORMATS[kind_of(name)]
        weight, scale = read_stored(reader, name, fmt)
        try:
            q, s = requantize(tensor, weight, scale, fmt=fmt)
        except ValueError as err:
            raise CheckpointFormatError(f"'{name}': {err}") from None
        return [(name, q), (name.removesuffix(".weight") + ".scale", s)]

    return encode


def _check_complete(reader: CheckpointReader, given: set[str]) -> list[str]:
    """The source's tensors not in `given`; raises naming them unless all are outside the
    text model."""
    left = [n for n in reader.names() if n not in given]
    text = [n for n in left if not not_text(n)]
    if text:
        raise CheckpointFormatError(
            f"{reader.directory}: {len(text)} tensor(s) of the text model were not given "
            f"to the export: {', '.join(text[:8])}{' ...' if len(text) > 8 else ''}"
        )
    return left


def _left(reader: CheckpointReader, given: set[str], keep: set[str]) -> list[str]:
    """The source's tensors not given (all of them outside the text model or in `keep`, else
    an error)."""
    return _check_complete(reader, given | keep) + sorted(keep - given)


def _with_recoded(
    reader: CheckpointReader,
    checked: Iterator[tuple[str, torch.Tensor]],
    given: set[str],
    keep: set[str],
    dtype: ExportDtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checked given tensors, then the source's tensors left that are re-encoded
    (`_recoded`), each read decoded in float32."""
    yield from checked
    recoded = [n for n in _left(reader, given, keep) if _recoded(reader, n, dtype)]
    if recoded:
        log.info("%s: stored bf16, not given, quantized afresh for the fp8 export: %s",
                 reader.directory, parts_summary(recoded))  # fmt: skip
    for name in recoded:
        yield name, reader.read(name, torch.float32)


def _given_only(
    progress: Callable[[int], None] | None, given: set[str]
) -> Callable[[int], None] | None:
    """`progress` ticked for the given tensors alone (the total its caller counts), not for
    the re-encoded ones written after them: a tensor is written after it is streamed, so the
    k-th write is a given one exactly while k <= len(given)."""
    if progress is None:
        return None
    written = 0

    def tick(n: int) -> None:
        nonlocal written
        written += n
        if written <= len(given):
            progress(n)

    return tick


def _carry(
    reader: CheckpointReader,
    given: set[str],
    carried: list[str],
    keep: set[str],
    dtype: ExportDtype,
) -> Callable[[Path], dict[str, str]]:
    """The writer's `carry` hook: once every given tensor is written, the source's tensors
    left are copied as stored, less those re-encoded (`_recoded`)."""

    def carry(tmp: Path) -> dict[str, str]:
        left = [n for n in _left(reader, given, keep) if not _recoded(reader, n, dtype)]
        carried.extend(s for n in left for s in _stored_names(reader, n))
        if not carried:
            return {}
        log.info("%s: outside the text model or kept as released, carried byte for byte: %s",
                 reader.directory, parts_summary(carried))  # fmt: skip
        return copy_carried(reader.directory, tmp, carried)

    return carry


def _declared(config: dict) -> dict:
    """`config` with the release's `quantization_config` (the writer keeps it for fp8 and
    drops it for bf16)."""
    return {**config, "quantization_config": dict(QUANTIZATION_CONFIG)}


def save_release(
    tensors: Tensors | Iterable[Tensors],
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: ExportDtype = "fp8",
    max_shard_bytes: int = 5 * 2**30,
    progress: Callable[[int], None] | None = None,
    keep: Iterable[str] = (),
    config: Callable[..., dict] | None = None,
) -> ReleaseExport:
    """Write `tensors` (one dict, or a stream of dicts that together hold the text model) in
    the layout of the release at `source` to `out`, with the source's tensors `keep` copied as
    stored; config.json is `config(given=<the source's>)` (default: the source's); see the
    module docstring."""
    pieces = [tensors] if isinstance(tensors, Mapping) else tensors
    given: set[str] = set()
    carried: list[str] = []
    keep = set(keep)
    with CheckpointReader(source) as reader:
        unknown = sorted(n for n in keep if n not in set(reader.names()))
        if unknown:
            raise CheckpointFormatError(
                f"{reader.directory}: has no {', '.join(unknown)} to carry into the export"
            )
        if isinstance(tensors, Mapping):  # known up front: refused before anything is written
            _check_complete(reader, set(tensors) | keep)
        encode = _as_released(reader)

        def storage(name: str) -> str | Callable:
            kind = kind_of(name)
            if kind not in FORMATS:
                return kind
            if dtype != "fp8":
                return "fp8"  # bfloat16: the quantized kinds as bf16
            return _quantized if reader.storage(name) == "bf16" else encode  # no bytes to keep

        summary = write_checkpoint(
            out,
            _with_recoded(reader, _checked(reader, pieces, given), given, keep, dtype),
            storage,
            _declared(reader.config if config is None else config(given=reader.config)),
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            extra_files=tokenizer_files(reader.directory),
            progress=_given_only(progress, given),
            carry=_carry(reader, given, carried, keep, dtype),
        )
    return ReleaseExport(summary=summary, carried=carried)


def _quantized(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A tensor of a quantized kind, quantized afresh in its kind's blocks (no release beside
    it to keep bytes from): its codes and its e8m0 scale."""
    fmt = FORMATS[kind_of(name)]
    try:
        stored = quantize(tensor.detach().float(), fmt=fmt)
    except ValueError as err:
        why = f"{err}; the {fmt.name} blocks of the release cannot hold it"
        raise CheckpointFormatError(f"'{name}' {list(tensor.shape)}: {why}") from None
    return list(zip((name, name.removesuffix(".weight") + ".scale"), stored, strict=True))


def write_release(
    tensors: Iterable[Tensors],
    out: str | os.PathLike,
    *,
    config: dict,
    dtype: ExportDtype = "fp8",
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Iterable[str | os.PathLike] = (),
    progress: Callable[[int], None] | None = None,
    rows: Iterable[str] = (),
) -> WriteSummary:
    """Write `tensors` (a stream of {release name: tensor} dicts that together hold the model)
    as a release directory at `out` with no release beside it, `config` as its config.json and
    `extra_files` (the tokenizer's) copied in; see the module docstring."""
    rows = set(rows)

    def storage(name: str) -> str | Callable:
        kind = kind_of(name)
        if kind in FORMATS:  # bf16: the quantized kinds as bf16, but the rows held as FP8
            return _quantized if dtype == "fp8" or name in rows else "fp8"
        return kind

    stream = ((name, tensor) for piece in tensors for name, tensor in piece.items())
    return write_checkpoint(out, stream, storage, _declared(config), dtype=dtype,
                            max_shard_bytes=max_shard_bytes, extra_files=list(extra_files),
                            progress=progress)  # fmt: skip
