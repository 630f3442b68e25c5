"""Sharded safetensors checkpoints as DeepSeek releases them: per-tensor positioned reads and
atomic sharded writes. Model-agnostic: tensor names are the file's (a model's state-dict adapter
maps them to its own).

A checkpoint directory holds `config.json` and either `model.safetensors.index.json` + shards or
one `model.safetensors`. Quantized weights are stored as `<module>.weight` plus a sibling
`<module>.scale` (FP8 e4m3 with 128x128 ue8m0 blocks, or FP4 e2m1 packed two per int8 byte with
ue8m0 scales per 32 inputs; see fp8_fp4.py). `CheckpointReader.names()` lists the logical
tensors (scales folded into their weights); `read(name, dtype=)` returns one dequantized tensor
and counts the stored bytes it touched. `write_checkpoint` writes a directory the same way.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from primus_v4.checkpoint_formats.fp8_fp4 import (
    FP4_BLOCK,
    FP8_BLOCK,
    QuantFormat,
    dequantize,
    dequantize_fp4_into,
    dequantize_fp8,
    dequantize_fp8_into,
    quantize_fp4,
    quantize_fp8,
    work_dtype,
)
from primus_v4.checkpoint_formats.read_record import ReadRecord, open_record
from primus_v4.checkpoint_formats.safetensors_io import (
    ShardWriter,
    StoredTensor,
    read_header,
    writable_bytes,
)
from primus_v4.durable import partial_path
from primus_v4.errors import CheckpointFormatError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
# the release's storage per tensor: fp8 / fp4 are quantized linear weights, the rest as named
Storage = Literal["fp8", "fp4", "bf16", "fp32", "int64"]
ExportDtype = Literal["bfloat16", "fp8"]
# a storage kind of its own: (logical name, tensor) -> the stored tensors, e.g. a weight and scale
Encoder = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
_PLAIN_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "int64": torch.int64,
}


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing (a release directory needs it)") from None
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None


def _weight_map(directory: Path) -> dict[str, str]:
    """Stored tensor name -> shard file name, from the index or the single file."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFormatError(f"{index}: no 'weight_map' object")
        by_shard: dict[str, str] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, name)
        for shard, name in sorted(by_shard.items()):
            if not (directory / shard).is_file():
                raise CheckpointFormatError(
                    f"{directory / shard}: shard missing (the index maps '{name}' and others to "
                    "it); download the complete checkpoint"
                )
        return dict(weight_map)
    single = directory / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(read_header(single), SINGLE_FILE)
    raise CheckpointFormatError(
        f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}; point at a released checkpoint "
        "directory (config.json + safetensors)"
    )


def load_workers() -> int:
    """Reader threads for a load: torch's thread budget (what OMP_NUM_THREADS / set_num_threads
    give this process), at most 4 (a load is bound by memory bandwidth past a few)."""
    return max(1, min(4, torch.get_num_threads()))


class CheckpointReader:
    """Reads of a release directory, one tensor at a time, straight into their destination.

    Tensors are read with positioned reads from the shard files, not memory-mapped: a mapped
    page counts in the resident set for as long as the map lives, a read one does not, so peak
    memory stays at the parameters plus one chunk of scratch. Quantized weights are decoded
    chunk by chunk into the destination (`read_into`). `bytes_read` sums the stored bytes
    (weights and their scales) of every tensor read so far, which is what a rank that reads
    only its own slice is measured by.
    """

    CHUNK = 1 << 21  # elements decoded per step: scratch stays in cache-sized pieces

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        rename: Callable[[Iterable[str]], Callable[[str], str] | None] | None = None,
    ) -> None:
        """`rename(stored_names)` may return a function from stored names to the names the
        caller reads by (e.g. a transformers-saved checkpoint's names to the release's)."""
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointFormatError(f"{self.directory}: not a directory")
        self.config: dict = _load_json(self.directory / CONFIG_FILE)
        self._shard_of = _weight_map(self.directory)
        self._meta: dict[str, StoredTensor] = {}
        for shard in sorted(set(self._shard_of.values())):
            self._meta.update(read_header(self.directory / shard))
        for name, shard in self._shard_of.items():
            if self._meta.get(name, None) is None or self._meta[name].shard != shard:
                raise CheckpointFormatError(
                    f"{self.directory / shard}: the index maps '{name}' to this shard but it "
                    "does not hold it; the index and the shards are from different checkpoints"
                )
        to_name = rename(list(self._shard_of)) if rename is not None else None
        if to_name is not None:
            renamed = {to_name(n): n for n in self._shard_of}
            if len(renamed) != len(self._shard_of):
                raise CheckpointFormatError(
                    f"{self.directory}: two stored tensors map to one release name"
                )
            self._shard_of = {r: self._shard_of[n] for r, n in renamed.items()}
            self._meta = {r: self._meta[n] for r, n in renamed.items()}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # open files and the byte count; reads need none
        self._local = threading.local()  # per-thread decode scratch
        self._scale_of: dict[str, str] = {}
        for name in self._shard_of:
            for suffix in SCALE_SUFFIXES:
                if name.endswith(suffix):
                    weight = name[: -len(suffix)] + ".weight"
                    if weight in self._shard_of:
                        self._scale_of[weight] = name
        scales = set(self._scale_of.values())
        self._names = sorted(n for n in self._shard_of if n not in scales)
        self.bytes_read = 0
        self._record = open_record()  # read_record.recording_reads: digests of what is read
        self._name_at = {(m.shard, m.offset): n for n, m in self._meta.items()}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _stored(self, name: str) -> StoredTensor:
        if name not in self._shard_of:
            raise CheckpointFormatError(
                f"{self.directory}: no tensor '{name}' in the checkpoint ({len(self._names)} "
                "tensors; check the model config matches this checkpoint)"
            )
        return self._meta[name]

    def names(self) -> list[str]:
        """Logical tensor names (quantization scales folded into their weights), sorted."""
        return list(self._names)

    def stored_names(self) -> list[str]:
        return sorted(self._shard_of)

    def shard_of(self, name: str) -> str:
        return self._stored(name).shard

    def storage(self, name: str) -> str:
        """'fp8' / 'fp4' for quantized weights, 'bf16' / 'fp32' / 'int64' (else the torch dtype
        name) for tensors stored as is."""
        stored = self._stored(name)
        if name in self._scale_of:
            return "fp4" if stored.dtype in (torch.int8, torch.float4_e2m1fn_x2) else "fp8"
        plain = {v: k for k, v in _PLAIN_DTYPES.items()}
        return plain.get(stored.dtype, str(stored.dtype).removeprefix("torch."))

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype (float8_e4m3fn / int8 for quantized weights)."""
        return self._stored(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape: a packed FP4 weight `[N, K/2]` reads as `[N, K]`."""
        shape = self._stored(name).shape
        return (*shape[:-1], 2 * shape[-1]) if self.storage(name) == "fp4" else shape

    def nbytes(self, name: str) -> int:
        """Stored bytes of a logical tensor, its scale included."""
        scale = self._scale_of.get(name)
        return self._stored(name).nbytes + (self._stored(scale).nbytes if scale else 0)

    def total_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self._names)

    def read_check(self, name: str, shape: Sequence[int]) -> None:
        """Raise naming the tensor unless its logical shape is `shape` (the parameter's)."""
        if tuple(shape) != self.shape(name):
            raise CheckpointFormatError(
                f"{self.directory / self.shard_of(name)}: '{name}' has shape "
                f"{list(self.shape(name))} in the checkpoint but {list(shape)} in the model; "
                "the config does not match this checkpoint"
            )

    def _fd(self, shard: str) -> int:
        """The shard's file descriptor, opened once and kept until `close`."""
        with self._lock:
            if shard not in self._fds:
                self._fds[shard] = os.open(self.directory / shard, os.O_RDONLY)
            return self._fds[shard]

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def _pread(self, stored: StoredTensor, into: torch.Tensor, start: int = 0) -> None:
        """Fill the contiguous CPU tensor `into` with the stored bytes from `start` on (positioned
        reads: no shared file position, so threads may read at once)."""
        fd = self._fd(stored.shard)
        view, done = writable_bytes(into), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], stored.offset + start + done)
            if not n:
                raise self._shrank(stored, stored.offset + start + done)
            done += n
        if self._record is not None:
            name = self._name_at[stored.shard, stored.offset]
            self._record.add(name, stored.shard, stored.offset + start, view)

    def _shrank(self, stored: StoredTensor, at: int) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.directory / stored.shard}: ended inside a tensor at byte {at} (the file "
            "shrank while being read)"
        )

    def carry_into(self, record: ReadRecord, name: str) -> None:
        """Stored tensor `name` (a scale too) digested whole into `record.carried`, read a
        piece of at most 16 MiB at a time (read_record.py); not counted in `bytes_read`:
        nothing is loaded."""
        stored = self._stored(name)
        fd, end = self._fd(stored.shard), stored.offset + stored.nbytes

        def pieces() -> Iterator[bytes]:
            at = stored.offset
            while at < end:
                data = os.pread(fd, min(1 << 24, end - at), at)
                if not data:
                    raise self._shrank(stored, at)
                at += len(data)
                yield data

        record.carry(name, stored.shard, stored.offset, pieces())

    def _raw(self, name: str) -> torch.Tensor:
        """A stored tensor as stored, in new memory."""
        stored = self._stored(name)
        out = torch.empty(stored.shape, dtype=stored.dtype)
        self._pread(stored, out)
        self._count(stored.nbytes)
        return out

    def _scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's (bytes, int32 index) scratch, at least `n` elements each."""
        local = self._local
        if getattr(local, "bytes", None) is None or local.bytes.numel() < n:
            local.bytes = torch.empty(n, dtype=torch.uint8)
            local.index = torch.empty(n, dtype=torch.int32)
        return local.bytes[:n], local.index

    def read(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        *,
        shape: Sequence[int] | None = None,
        fmt: QuantFormat | None = None,
    ) -> torch.Tensor:
        """One tensor, dequantized when stored FP8/FP4 (into `dtype`, default bfloat16), else
        as stored (cast to `dtype` when given). `shape` (the parameter's) is checked. `fmt`: the
        block format of a quantized tensor (default DeepSeek-V4's FP8 128x128 / FP4 1x32)."""
        if shape is not None:
            self.read_check(name, shape)
        kind = self.storage(name)
        if kind in ("fp8", "fp4") and fmt is not None:
            if fmt.kind != kind:
                raise CheckpointFormatError(
                    f"{self.directory / self.shard_of(name)}: '{name}' is stored {kind}, "
                    f"expected {fmt.name}"
                )
            weight, scale = self._raw(name), self._raw(self._scale_of[name])
            return dequantize(weight, scale, dtype or torch.bfloat16, fmt=fmt)
        if kind in ("fp8", "fp4"):
            out_dtype = dtype or torch.bfloat16
            work = work_dtype(out_dtype)
            out = torch.empty(self.shape(name), dtype=work)
            self._decode_into(name, kind, out)
            return out.to(out_dtype)
        tensor = self._raw(name)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def read_into(self, name: str, out: torch.Tensor, *, shape: Sequence[int]) -> None:
        """`out.copy_(read(name, out.dtype, shape=shape))` without the temporary: bytes are read
        straight into `out` when it is a contiguous CPU tensor of the stored dtype, and FP8 /
        FP4 weights decode into it chunk by chunk."""
        self.read_check(name, shape)
        kind = self.storage(name)
        direct = out.device.type == "cpu" and out.is_contiguous()
        if kind in ("fp8", "fp4") and direct and work_dtype(out.dtype) == out.dtype:
            self._decode_into(name, kind, out)
        elif direct and kind not in ("fp8", "fp4") and out.dtype == self.dtype(name):
            stored = self._stored(name)
            self._pread(stored, out)
            self._count(stored.nbytes)
        else:
            out.copy_(self.read(name, out.dtype))

    def read_stored_into(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> str:
        """Quantized weight `name` as stored, undecoded: its bytes into `weight` and its ue8m0
        scale bytes into `scale` (uint8 tensors of the stored shapes, on any device). Returns
        the kind ('fp8' / 'fp4'); a weight stored unquantized raises naming it."""
        kind = self.storage(name)
        if kind not in ("fp8", "fp4"):
            raise CheckpointFormatError(
                f"{self.directory / self.shard_of(name)}: '{name}' is stored as {kind}, not "
                "FP8 / FP4; only a quantized release can be kept as released"
            )
        for dst, part in ((weight, name), (scale, self._scale_of[name])):
            stored = self._stored(part)
            if tuple(dst.shape) != tuple(stored.shape) or stored.dtype.itemsize != 1:
                raise CheckpointFormatError(
                    f"{self.directory / stored.shard}: '{part}' is stored {list(stored.shape)} "
                    f"{stored.dtype}, expected {list(dst.shape)} of one byte each (FP8 / FP4 "
                    "codes, ue8m0 scales)"
                )
            direct = dst.device.type == "cpu" and dst.is_contiguous()
            host = dst if direct else torch.empty(dst.shape, dtype=torch.uint8)
            self._pread(stored, host)
            self._count(stored.nbytes)
            if not direct:
                dst.copy_(host)
        return kind

    def read_stored_rows(self, name: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) of FP8 weight `name` with a per-row scale block (one scale row per
        weight row), undecoded: (uint8 codes [hi - lo, K], uint8 scales [hi - lo, K / block]).
        Only those rows' bytes are read."""
        scale = self._scale_of.get(name)
        if scale is None:
            raise CheckpointFormatError(
                f"{self.directory / self.shard_of(name)}: '{name}' has no scale tensor; a row "
                "read needs FP8 rows with per-row scales"
            )
        out = []
        for part in (name, scale):
            stored = self._stored(part)
            if stored.dtype.itemsize != 1 or not 0 <= lo <= hi <= stored.shape[0]:
                raise CheckpointFormatError(
                    f"{self.directory / stored.shard}: '{part}' is stored {list(stored.shape)} "
                    f"{stored.dtype}; rows [{lo}, {hi}) of one-byte codes cannot be read from it"
                )
            row = math.prod(stored.shape[1:])
            rows = torch.empty(hi - lo, *stored.shape[1:], dtype=torch.uint8)
            self._pread(stored, rows, lo * row)
            self._count(rows.numel())
            out.append(rows)
        return out[0], out[1]

    def _decode_into(self, name: str, kind: str, out: torch.Tensor) -> None:
        """Dequantize `name` into the contiguous CPU tensor `out`, a row chunk at a time."""
        weight, scale = self._stored(name), self._raw(self._scale_of[name])
        self._count(weight.nbytes)
        n, k = out.shape
        if kind == "fp8" and k % FP8_BLOCK:  # partial column blocks: decode whole
            out.copy_(dequantize_fp8(self._raw_counted(weight), scale, out.dtype))
            return
        row_bytes = weight.nbytes // n
        block = FP8_BLOCK if kind == "fp8" else 1  # fp8 chunks start on a block row
        rows = max(block, self.CHUNK // k // block * block)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            raw, index = self._scratch((r1 - r0) * row_bytes)
            self._pread(weight, raw, r0 * row_bytes)
            dst = out[r0:r1]
            if kind == "fp8":
                rb = r0 // FP8_BLOCK
                s = scale[rb : rb + -(-(r1 - r0) // FP8_BLOCK)]
                dequantize_fp8_into(raw.view(r1 - r0, k), s, dst, index)
            else:
                dequantize_fp4_into(raw.view(r1 - r0, k // 2), scale[r0:r1], dst, index)

    def _raw_counted(self, stored: StoredTensor) -> torch.Tensor:
        """The stored bytes of an already counted tensor, as its stored dtype."""
        out = torch.empty(stored.shape, dtype=stored.dtype)
        self._pread(stored, out)
        return out

    @contextlib.contextmanager
    def concurrent(
        self, workers: int, progress: Callable[[int], None] | None = None
    ) -> Iterator[Callable[[str, torch.Tensor, Sequence[int]], None]]:
        """A `read_into(name, out, shape)` callback that queues each read on `workers` threads
        and returns at once; leaving the block waits for all of them and raises the first error.
        Each thread has its own scratch and positioned reads share no file state. Decoding is a
        byte gather that torch runs on one thread whatever its pool, so threads are what make a
        load use the cores; torch ops run single-threaded meanwhile, as nested intra-op teams
        would oversubscribe the cores (and stall whenever one thread is descheduled).
        `progress(1)` is called per finished tensor."""

        def read(name: str, out: torch.Tensor, shape: Sequence[int]) -> None:
            with torch.no_grad():  # grad mode is per thread
                self.read_into(name, out, shape=shape)
            if progress is not None:
                progress(1)

        if workers <= 1:
            yield read
            return
        threads, futures = torch.get_num_threads(), []
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="release-read") as pool:
                yield lambda name, out, shape: futures.append(pool.submit(read, name, out, shape))
                try:
                    for future in futures:
                        future.result()
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        finally:
            torch.set_num_threads(threads)


@dataclass(kw_only=True, frozen=True)
class WriteSummary:
    """What `write_checkpoint` wrote."""

    directory: Path
    shards: int
    tensors: int
    total_bytes: int


def _encode(
    name: str, tensor: torch.Tensor, storage: str | Encoder, dtype: ExportDtype
) -> list[tuple[str, torch.Tensor]]:
    """One logical tensor -> the stored tensors (a weight and maybe its scale)."""
    if callable(storage):
        return storage(name, tensor)
    if storage in ("fp8", "fp4") and dtype == "fp8":
        if tensor.ndim != 2 or not name.endswith(".weight"):
            raise CheckpointFormatError(
                f"'{name}' {list(tensor.shape)}: only 2-D '.weight' tensors can be stored {storage}"
            )
        try:
            q, scale = quantize_fp8(tensor) if storage == "fp8" else quantize_fp4(tensor)
        except ValueError as err:
            raise CheckpointFormatError(
                f"'{name}' {list(tensor.shape)}: {err}; the release's {storage} layout cannot "
                "hold it, export with dtype 'bfloat16'"
            ) from None
        return [(name, q), (name.removesuffix(".weight") + ".scale", scale)]
    target = torch.bfloat16 if storage in ("fp8", "fp4") else _PLAIN_DTYPES.get(storage)
    if target is None:
        raise CheckpointFormatError(f"'{name}': unknown storage '{storage}' (expected {Storage})")
    # cast and lay out in one pass (exported experts are transposed views); `to` returns a
    # same-dtype tensor unchanged, hence the contiguous() (a no-op when already contiguous)
    out = tensor.detach().to(target, memory_format=torch.contiguous_format).contiguous()
    return [(name, out)]


def _release_config(config: dict, dtype: ExportDtype) -> dict:
    """The config.json to write: `quantization_config` (and FP4 experts) only for fp8. A
    config that brings its own (a release's config.json, other blocks than DeepSeek-V4's) keeps
    it as given for fp8 and drops it for bf16."""
    if "quantization_config" in config:
        return config if dtype == "fp8" else {
            k: v for k, v in config.items() if k != "quantization_config"
        }  # fmt: skip
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "expert_dtype")}
    out["torch_dtype"] = "bfloat16"
    if dtype == "fp8":
        out["expert_dtype"] = "fp4"
        out["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        }
    return out


def _prepare_target(out_dir: Path) -> Path:
    """A fresh temp directory beside `out_dir` (renamed into place at the end)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointFormatError(
            f"{out_dir}: exists and is not an empty directory; choose a new output directory"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(out_dir)
    tmp.mkdir()
    return tmp


def write_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    kinds: Mapping[str, str] | Callable[[str], str],
    config: dict,
    *,
    dtype: ExportDtype = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Sequence[str | os.PathLike] = (),
    progress: Callable[[int], None] | None = None,
    carry: Callable[[Path], Mapping[str, str]] | None = None,
) -> WriteSummary:
    """Write release-named tensors as a release directory, atomically.

    `tensors` is consumed lazily (one shard's worth is held at a time); `kinds[name]` (a mapping
    or a callable) says how the release stores each tensor (a model adapter's storage kinds, or
    an `Encoder` that gives the stored tensors itself);
    `dtype` "bfloat16" stores fp8/fp4 tensors as bf16, "fp8" quantizes them like the release. Shards
    hold at most `max_shard_bytes` (a single larger tensor gets its own shard); `extra_files`
    (tokenizer files) are copied in. Everything is written to a temp directory that is renamed
    to `out_dir` when complete, so a reader never sees a half-written checkpoint.
    `progress(n)` is called per written tensor. `carry(temp_dir)` writes further shards there
    (tensors copied as stored, carried.py) and returns their weight map, which joins the index.
    """
    if dtype not in ("bfloat16", "fp8"):
        raise CheckpointFormatError(f"export dtype '{dtype}': expected 'bfloat16' or 'fp8'")
    storage = kinds.__getitem__ if isinstance(kinds, Mapping) else kinds
    out_dir = Path(out_dir)
    tmp = _prepare_target(out_dir)
    try:
        _, weight_map, total = _write_shards(
            tmp, tensors, storage, dtype, max_shard_bytes, progress
        )
        if carry is not None:
            carried = dict(carry(tmp))
            weight_map.update(carried)
            for shard in set(carried.values()):
                total += sum(t.nbytes for t in read_header(tmp / shard).values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        release_config = _release_config(config, dtype)
        (tmp / CONFIG_FILE).write_text(json.dumps(release_config, indent=2) + "\n")
        for path in extra_files:
            shutil.copyfile(path, tmp / Path(path).name)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WriteSummary(
        directory=out_dir,
        shards=len(set(weight_map.values())),
        tensors=len(weight_map),
        total_bytes=total,
    )


ENCODE_AHEAD_BYTES = 256 << 20  # source bytes an export queues ahead of its writes


def _encoded(
    tensors: Iterable[tuple[str, torch.Tensor]], storage: Callable[[str], str], dtype: ExportDtype
) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """(logical name, stored tensors) per source tensor, in order, encoded ahead on worker
    threads (`load_workers()` of them; torch ops and file writes release the GIL) while the
    caller writes: quantizing overlaps the disk and uses the cores (its byte gathers are serial
    in torch, so torch ops run single-threaded meanwhile, see `CheckpointReader.concurrent`).
    Tensors are queued ahead up to `ENCODE_AHEAD_BYTES` of their source bytes (at least
    workers + 1 of them), so a write that waits for a core does not stall the encoders; that
    bounds what is encoded and not yet written."""
    workers = load_workers()
    threads = torch.get_num_threads()
    if workers > 1:
        torch.set_num_threads(1)

    def encode(name: str, tensor: torch.Tensor) -> tuple[str, list[tuple[str, torch.Tensor]]]:
        return name, _encode(name, tensor, storage(name), dtype)

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="export-encode") as pool:
            ahead: collections.deque = collections.deque()  # (future, source bytes)
            queued = 0
            for name, tensor in tensors:
                size = tensor.numel() * tensor.element_size()
                ahead.append((pool.submit(encode, name, tensor), size))
                queued += size
                while len(ahead) > workers and queued > ENCODE_AHEAD_BYTES:
                    future, size = ahead.popleft()
                    queued -= size
                    yield future.result()
            while ahead:
                yield ahead.popleft()[0].result()
    finally:
        torch.set_num_threads(threads)


def _header_room(max_shard_bytes: int) -> int:
    """Room reserved for a shard's header: ~1/1024 of its bytes (a header entry is ~150 B, a
    Flash shard of 5 GB holds ~800 tensors), within [2 KiB, 2 MiB]; a shard whose header is
    full is closed early."""
    return min(2 << 20, max(2 << 10, max_shard_bytes // 1024))


def _write_shards(
    tmp: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    storage: Callable[[str], str],
    dtype: ExportDtype,
    max_shard_bytes: int,
    progress: Callable[[int], None] | None,
) -> tuple[list[str], dict[str, str], int]:
    """Stream tensors into numbered shards, then give them their final `-of-` names."""
    written: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    shard: ShardWriter | None = None
    total = 0
    try:
        for _, encoded in _encoded(tensors, storage, dtype):
            size = sum(t.numel() * t.element_size() for _, t in encoded)
            full = shard is not None and (
                shard.data_bytes + size > max_shard_bytes or not shard.fits(encoded)
            )
            if shard is not None and full and shard.names:
                shard.close()
                written.append((shard.path.name, shard.names))
                shard = None
            if shard is None:
                path = tmp / f"shard-{len(written):05d}.safetensors"
                shard = ShardWriter(path, header_room=_header_room(max_shard_bytes))
            for stored_name, t in encoded:
                if stored_name in seen:
                    raise CheckpointFormatError(f"'{stored_name}' given twice to write_checkpoint")
                seen.add(stored_name)
                shard.add(stored_name, t)
            total += size
            if progress is not None:
                progress(1)
        if shard is not None:
            shard.close()
            written.append((shard.path.name, shard.names))
            shard = None
    finally:
        if shard is not None:
            shard.abort()
    weight_map: dict[str, str] = {}
    final: list[str] = []
    for i, (tmp_name, names) in enumerate(written):
        name = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (tmp / tmp_name).rename(tmp / name)
        final.append(name)
        weight_map.update(dict.fromkeys(names, name))
    return final, weight_map, total


def tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer/generation files of a release directory that exist (copied on export)."""
    return [Path(directory) / f for f in TOKENIZER_FILES if (Path(directory) / f).is_file()]


__all__ = [
    "FP4_BLOCK",
    "CheckpointFormatError",
    "CheckpointReader",
    "Encoder",
    "Storage",
    "WriteSummary",
    "tokenizer_files",
    "write_checkpoint",
]
