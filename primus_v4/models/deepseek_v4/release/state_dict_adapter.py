"""DeepSeek-V4's state-dict adapter: the released checkpoint's names <-> ours, one table.

Legend: E = routed experts (L = those of an expert-parallel shard), D = hidden, F = expert ffn,
G = output groups, O = o_lora rank, I = heads x head_dim / G.

`name_table(cfg)` lists every tensor of our full model's state dict (parameters and persistent
buffers) with the release tensors it is made of and how (`op`):
  copy      same shape (most tensors; our module names differ, the values do not)
  wo_a      ours [G, O, I] = release `attn.wo_a.weight` [G*O, I] viewed per group
  cat0      ours `moe.shared.gate_up.weight` [2F, D] = cat(shared_experts.w1, shared_experts.w3)
  gate_up   ours `moe.w_gate_up` [E, 2F, D]: row e = cat(experts.e.w1, experts.e.w3)
  down      ours `moe.w_down` [E, D, F]: row e = experts.e.w2
Expert tensors are the release's per-expert [out, in] weights stacked, so every release tensor is
one contiguous block of ours (loads decode into it, exports write it as is); an expert-parallel
shard holds rows
[lo, hi) and asks for `expert_range=(lo, hi)`. Pipeline stages ask for the names they keep: our
names carry the global layer index (`layers.7.`), so any subset of the state dict resolves.

`build_state` returns new tensors; `fill_state` copies into existing ones in place (one release
tensor in memory at a time).

`release_tensors(cfg)` lists the release's LOGICAL tensors (a quantized linear is its `.weight`,
dequantized shape) with the storage kind; `stored_tensors(cfg)` what an FP8 release stores:
  fp8   float8_e4m3fn weight [out, in] + `<stem>.scale` e8m0 [ceil(out/128), ceil(in/128)]
  fp4   int8 weight [out, in/2] (two e2m1 codes per byte) + `<stem>.scale` e8m0 [out, in/32]
  bf16 / fp32 / int64   stored as is.
Kinds follow DeepSeek's inference/model.py: the attention, indexer-query, shared-expert and MTP
projection linears are FP8; routed experts FP4; embedding, LM head, norms, router weight,
compressor projections and the indexer's `weights_proj` bf16; mHC, sinks, `ape` and `gate.bias`
fp32; `tid2eid` int64.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from primus_v4.models.deepseek_v4.config import DeepseekV4Config
from primus_v4.models.deepseek_v4.release.config_json import config_from_release, config_to_release

__all__ = [
    "IGNORED",
    "ReleaseTensor",
    "TableEntry",
    "build_state",
    "carried",
    "config_from_release",
    "config_to_release",
    "fill_state",
    "ignored",
    "name_table",
    "needed",
    "release_tensors",
    "split_release",
    "stored_name_map",
    "stored_tensors",
    "to_release",
]

FP8_BLOCK = 128
FP4_BLOCK = 32
E8M0 = torch.float8_e8m0fnu  # the scales' dtype (ue8m0: a power of two per block)
# Tensors a released checkpoint may hold that we skip on purpose: DeepSeek's own converter
# (inference/convert.py) drops an MTP depth's copies of the shared embedding and LM head.
IGNORED = (r"^mtp\.\d+\.emb(ed)?\.", r"^mtp\.\d+\.head\.weight$")
STORED_DTYPE = {
    "fp8": torch.float8_e4m3fn,
    "fp4": torch.int8,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "int64": torch.int64,
}


@dataclass(frozen=True, kw_only=True)
class ReleaseTensor:
    """One logical release tensor: its name, logical shape and storage kind."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def scale_name(self) -> str | None:
        """The `.scale` companion of a quantized weight (None for unquantized kinds)."""
        if self.kind not in ("fp8", "fp4"):
            return None
        return self.name.removesuffix(".weight") + ".scale"

    def stored(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Names, shapes and dtypes as an FP8 release stores this tensor."""
        out, inp = self.shape if len(self.shape) == 2 else (0, 0)
        if self.kind == "fp8":
            scale = (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK))
            return {self.name: (self.shape, STORED_DTYPE["fp8"]), self.scale_name: (scale, E8M0)}
        if self.kind == "fp4":
            return {
                self.name: ((out, inp // 2), STORED_DTYPE["fp4"]),
                self.scale_name: ((out, inp // FP4_BLOCK), E8M0),
            }
        return {self.name: (self.shape, STORED_DTYPE[self.kind])}


@dataclass(frozen=True, kw_only=True)
class TableEntry:
    """One of our tensors and the release tensors it is made of (see the module docstring)."""

    ours: str
    shape: tuple[int, ...]
    op: str
    release: tuple[ReleaseTensor, ...]
    """For gate_up / down: per expert (w1, w3) / (w2,), flattened in expert order."""

    def release_names(self, expert_range: tuple[int, int] | None = None) -> list[str]:
        if self.op not in ("gate_up", "down") or expert_range is None:
            return [r.name for r in self.release]
        per = 2 if self.op == "gate_up" else 1
        lo, hi = expert_range
        return [r.name for r in self.release[lo * per : hi * per]]


def _fp8(name: str, out: int, inp: int) -> ReleaseTensor:
    return ReleaseTensor(name=name, shape=(out, inp), kind="fp8")


def _t(name: str, shape: tuple[int, ...], kind: str) -> ReleaseTensor:
    return ReleaseTensor(name=name, shape=shape, kind=kind)


def _hc(ours: str, rel: str, cfg: DeepseekV4Config, rows: int, groups: int) -> list[TableEntry]:
    """mHC mixer (rows = (2 + K) K, groups 3) or HyperHead (rows = K, groups 1)."""
    k_d = cfg.hc_mult * cfg.hidden_size
    parts = (
        ("proj.weight", "fn", (rows, k_d)),
        ("bias", "base", (rows,)),
        ("scale", "scale", (groups,)),
    )
    return [_copy(f"{ours}.{o}", _t(f"{rel}_{r}", shape, "fp32")) for o, r, shape in parts]


def _copy(ours: str, rel: ReleaseTensor) -> TableEntry:
    return TableEntry(ours=ours, shape=rel.shape, op="copy", release=(rel,))


def _compressor(
    ours: str, rel: str, cfg: DeepseekV4Config, ratio: int, dim: int
) -> list[TableEntry]:
    coff = 2 if ratio == 4 else 1
    d = cfg.hidden_size
    return [
        _copy(f"{ours}.wkv.weight", _t(f"{rel}.wkv.weight", (coff * dim, d), "bf16")),
        _copy(f"{ours}.wgate.weight", _t(f"{rel}.wgate.weight", (coff * dim, d), "bf16")),
        _copy(f"{ours}.ape", _t(f"{rel}.ape", (ratio, coff * dim), "fp32")),
        _copy(f"{ours}.norm.weight", _t(f"{rel}.norm.weight", (dim,), "bf16")),
    ]


def _attention(ours: str, rel: str, cfg: DeepseekV4Config, ratio: int) -> list[TableEntry]:
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.q_lora_rank
    g, o = cfg.o_groups, cfg.o_lora_rank
    wo_a = _fp8(f"{rel}.wo_a.weight", g * o, h * hd // g)
    out = [
        _copy(f"{ours}.wq_a.weight", _fp8(f"{rel}.wq_a.weight", q, d)),
        _copy(f"{ours}.q_norm.weight", _t(f"{rel}.q_norm.weight", (q,), "bf16")),
        _copy(f"{ours}.wq_b.weight", _fp8(f"{rel}.wq_b.weight", h * hd, q)),
        _copy(f"{ours}.wkv.weight", _fp8(f"{rel}.wkv.weight", hd, d)),
        _copy(f"{ours}.kv_norm.weight", _t(f"{rel}.kv_norm.weight", (hd,), "bf16")),
        TableEntry(ours=f"{ours}.wo_a", shape=(g, o, h * hd // g), op="wo_a", release=(wo_a,)),
        _copy(f"{ours}.wo_b.weight", _fp8(f"{rel}.wo_b.weight", d, g * o)),
    ]
    if cfg.attn_sink:
        out.append(_copy(f"{ours}.attn_sink", _t(f"{rel}.attn_sink", (h,), "fp32")))
    if ratio:
        out += _compressor(f"{ours}.compressor", f"{rel}.compressor", cfg, ratio, hd)
    if ratio == 4:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        out += [
            _copy(f"{ours}.indexer.wq_b.weight", _fp8(f"{rel}.indexer.wq_b.weight", ih * idim, q)),
            _copy(
                f"{ours}.indexer.weights_proj.weight",
                _t(f"{rel}.indexer.weights_proj.weight", (ih, d), "bf16"),
            ),
        ]
        out += _compressor(f"{ours}.indexer.compressor", f"{rel}.indexer.compressor", cfg, 4, idim)
    return out


def _moe(ours: str, rel: str, cfg: DeepseekV4Config, hashed: bool) -> list[TableEntry]:
    d, e, f, k = cfg.hidden_size, cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.moe_router_topk
    out = [_copy(f"{ours}.router.weight", _t(f"{rel}.gate.weight", (e, d), "bf16"))]
    if hashed:
        out.append(
            _copy(f"{ours}.router.tid2eid", _t(f"{rel}.gate.tid2eid", (cfg.vocab_size, k), "int64"))
        )
    else:
        out.append(_copy(f"{ours}.router.bias", _t(f"{rel}.gate.bias", (e,), "fp32")))
    ex = f"{rel}.experts"
    gate_up = tuple(
        _t(f"{ex}.{i}.{w}.weight", (f, d), "fp4") for i in range(e) for w in ("w1", "w3")
    )
    down = tuple(_t(f"{ex}.{i}.w2.weight", (d, f), "fp4") for i in range(e))
    out += [
        TableEntry(ours=f"{ours}.w_gate_up", shape=(e, 2 * f, d), op="gate_up", release=gate_up),
        TableEntry(ours=f"{ours}.w_down", shape=(e, d, f), op="down", release=down),
    ]
    sf = cfg.moe_shared_expert_intermediate_size
    if sf:
        sh = f"{rel}.shared_experts"
        out += [
            TableEntry(
                ours=f"{ours}.shared.gate_up.weight",
                shape=(2 * sf, d),
                op="cat0",
                release=(_fp8(f"{sh}.w1.weight", sf, d), _fp8(f"{sh}.w3.weight", sf, d)),
            ),
            _copy(f"{ours}.shared.down.weight", _fp8(f"{sh}.w2.weight", d, sf)),
        ]
    return out


def _block(ours: str, rel: str, cfg: DeepseekV4Config, layer: int, ratio: int) -> list[TableEntry]:
    d, k = cfg.hidden_size, cfg.hc_mult
    out = _hc(f"{ours}.attn_mix", f"{rel}.hc_attn", cfg, (2 + k) * k, 3)
    out += _hc(f"{ours}.ffn_mix", f"{rel}.hc_ffn", cfg, (2 + k) * k, 3)
    out += [
        _copy(f"{ours}.attn_norm.weight", _t(f"{rel}.attn_norm.weight", (d,), "bf16")),
        _copy(f"{ours}.ffn_norm.weight", _t(f"{rel}.ffn_norm.weight", (d,), "bf16")),
    ]
    out += _attention(f"{ours}.attn", f"{rel}.attn", cfg, ratio)
    return out + _moe(f"{ours}.moe", f"{rel}.ffn", cfg, hashed=layer < cfg.num_hash_layers)


def name_table(cfg: DeepseekV4Config) -> dict[str, TableEntry]:
    """Every tensor of our full model's state dict -> its release tensors (module docstring)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    rows = [
        _copy("embedding.weight", _t("embed.weight", (v, d), "bf16")),
        _copy("lm_head.weight", _t("head.weight", (v, d), "bf16")),
        _copy("final_norm.weight", _t("norm.weight", (d,), "bf16")),
        *_hc("head_hc", "hc_head", cfg, cfg.hc_mult, 1),
    ]
    for i, ratio in enumerate(cfg.compress_ratios):
        rows += _block(f"layers.{i}", f"layers.{i}", cfg, i, ratio)
    for k in range(cfg.mtp_num_layers or 0):
        ours, rel = f"mtp.{k}", f"mtp.{k}"
        rows += [
            _copy(f"{ours}.enorm.weight", _t(f"{rel}.enorm.weight", (d,), "bf16")),
            _copy(f"{ours}.hnorm.weight", _t(f"{rel}.hnorm.weight", (d,), "bf16")),
            _copy(f"{ours}.e_proj.weight", _fp8(f"{rel}.e_proj.weight", d, d)),
            _copy(f"{ours}.h_proj.weight", _fp8(f"{rel}.h_proj.weight", d, d)),
            _copy(f"{ours}.final_norm.weight", _t(f"{rel}.norm.weight", (d,), "bf16")),
            *_hc(f"{ours}.head_hc", f"{rel}.hc_head", cfg, cfg.hc_mult, 1),
        ]
        rows += _block(f"{ours}.block", rel, cfg, cfg.num_layers + k, cfg.mtp_compress_ratio)
    return {r.ours: r for r in rows}


def release_tensors(cfg: DeepseekV4Config) -> dict[str, ReleaseTensor]:
    """Every logical release tensor of this config, by name (release order of the table)."""
    return {r.name: r for e in name_table(cfg).values() for r in e.release}


def stored_tensors(cfg: DeepseekV4Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor an FP8 release of this config stores (weights and `.scale`), by name."""
    return {n: s for r in release_tensors(cfg).values() for n, s in r.stored().items()}


# transformers' `save_pretrained` writes the release's names under "model." with a few of its
# own (the rest of its reverse renaming lands back on the release's): name -> release name
_HF_NAMES = (
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.(\d+)\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
    (r"^model\.", ""),
)


def is_hf_saved(names: Iterable[str]) -> bool:
    """Whether stored tensor names are transformers' `save_pretrained` layout ("model." ...)."""
    return any(n.startswith("model.") for n in names)


def from_hf_name(name: str) -> str:
    """The release name of a tensor as transformers' `save_pretrained` stores it."""
    for pattern, repl in _HF_NAMES:
        out, hits = re.subn(pattern, repl, name)
        if hits:
            return out
    return name


def stored_name_map(names: Iterable[str]) -> Callable[[str], str] | None:
    """The `rename=` of a checkpoint reader: transformers' names -> the release's when the
    directory was saved by `save_pretrained`, None (read as stored) otherwise."""
    return from_hf_name if is_hf_saved(names) else None


def ignored(name: str) -> bool:
    """True for a checkpoint name on the documented ignore list (`IGNORED`)."""
    return any(re.search(p, name) for p in IGNORED)


def carried(cfg: DeepseekV4Config, names: Iterable[str]) -> list[str]:
    """Checkpoint tensors the model does not hold that an export copies byte for byte: a
    DSpark drafter's `mtp.*` (DeepSeek-V4-Flash-0731, `cfg.dspark`)."""
    return sorted(n for n in names if cfg.dspark and n.startswith("mtp."))


def _entries(cfg: DeepseekV4Config, names: Iterable[str]) -> list[TableEntry]:
    table = name_table(cfg)
    missing = [n for n in names if n not in table]
    if missing:
        raise KeyError(
            f"{len(missing)} of our tensors have no release mapping, e.g. {missing[:5]}; "
            "extend primus_v4/models/deepseek_v4/release/state_dict_adapter.py"
        )
    return [table[n] for n in names]


def needed(
    cfg: DeepseekV4Config,
    our_names: Iterable[str],
    *,
    expert_range: tuple[int, int] | None = None,
) -> list[str]:
    """Logical release names needed to fill `our_names` (a rank's stage / expert shard)."""
    return [n for e in _entries(cfg, list(our_names)) for n in e.release_names(expert_range)]


def _join(entry: TableEntry, parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    if entry.op == "copy":
        return parts[0]
    if entry.op == "wo_a":
        return parts[0].reshape(entry.shape)
    if entry.op == "cat0":
        return torch.cat(parts, dim=0)
    if entry.op == "gate_up":  # per expert: cat(w1, w3) [2F, D]
        return torch.stack([torch.cat(parts[2 * i : 2 * i + 2], 0) for i in range(rows)])
    if entry.op == "down":
        return torch.stack(parts)
    raise ValueError(f"unknown table op {entry.op!r}")


def join_release(entry: TableEntry, parts: list[torch.Tensor], *, rows: int) -> torch.Tensor:
    """Release tensors (`split_release`'s order) as our tensor `entry.ours`; `rows`: the
    experts of a routed-expert entry."""
    return _join(entry, parts, rows)


def split_release(entry: TableEntry, t: torch.Tensor) -> list[torch.Tensor]:
    """Our tensor `t` (`entry.ours`, possibly an expert shard) as views of its release tensors,
    in `entry.release_names` order."""
    return _split(entry, t)


def _split(entry: TableEntry, t: torch.Tensor) -> list[torch.Tensor]:
    if entry.op == "copy":
        return [t]
    if entry.op == "wo_a":
        return [t.reshape(entry.release[0].shape)]
    if entry.op == "cat0":
        return list(t.chunk(2, dim=0))
    if entry.op == "gate_up":
        return [w for row in t for w in row.chunk(2, dim=0)]
    if entry.op == "down":
        return list(t)
    raise ValueError(f"unknown table op {entry.op!r}")


def _expected_shape(entry: TableEntry, expert_range: tuple[int, int] | None) -> tuple[int, ...]:
    if entry.op in ("gate_up", "down") and expert_range is not None:
        return (expert_range[1] - expert_range[0], *entry.shape[1:])
    return entry.shape


def _checked_entries(
    cfg: DeepseekV4Config,
    our_shapes: Mapping[str, torch.Size | tuple[int, ...]],
    expert_range: tuple[int, int] | None,
) -> list[TableEntry]:
    entries = _entries(cfg, list(our_shapes))
    for entry in entries:
        want = tuple(our_shapes[entry.ours])
        if want != _expected_shape(entry, expert_range):
            raise ValueError(
                f"{entry.ours}: our tensor is {want} but the release layout of this config "
                f"gives {_expected_shape(entry, expert_range)} (expert_range={expert_range})"
            )
    return entries


def _fetch(
    entry: TableEntry,
    expert_range: tuple[int, int] | None,
    get: Callable[[str], torch.Tensor],
) -> Iterator[torch.Tensor]:
    """The entry's release tensors one at a time, each shape-checked against the table."""
    by_name = {r.name: r for r in entry.release}
    for n in entry.release_names(expert_range):
        t = get(n)
        if tuple(t.shape) != by_name[n].shape:
            raise ValueError(
                f"release tensor {n} has shape {tuple(t.shape)}, expected {by_name[n].shape} "
                f"for our {entry.ours} {entry.shape}"
            )
        yield t


def build_state(
    cfg: DeepseekV4Config,
    our_shapes: Mapping[str, torch.Size | tuple[int, ...]],
    get: Callable[[str], torch.Tensor],
    *,
    expert_range: tuple[int, int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Our tensors (keys of `our_shapes`) from release tensors fetched by `get(logical_name)`.

    Checks every fetched release tensor's shape and every built tensor against `our_shapes`;
    a mismatch raises naming the tensor and both shapes. `progress(n)` is called per tensor.
    Holds every built tensor at once: to fill existing tensors in place use `fill_state`."""
    out: dict[str, torch.Tensor] = {}
    for entry in _checked_entries(cfg, our_shapes, expert_range):
        parts = list(_fetch(entry, expert_range, get))
        out[entry.ours] = _join(entry, parts, int(our_shapes[entry.ours][0]))
        if progress is not None:
            progress(len(parts))
    return out


@torch.no_grad()
def fill_state(
    cfg: DeepseekV4Config,
    targets: Mapping[str, torch.Tensor],
    get: Callable[[str], torch.Tensor] | None = None,
    *,
    expert_range: tuple[int, int] | None = None,
    progress: Callable[[int], None] | None = None,
    read_into: Callable[[str, torch.Tensor, tuple[int, ...]], None] | None = None,
) -> None:
    """Like `build_state`, but fills `targets[our_name]` (parameters / buffers) in place, one
    release tensor at a time: every release tensor is one view of ours (`_split`), the whole
    tensor, a chunk of it or an expert row. `read_into(name, out, shape)`, when given, writes
    release tensor `name` (checked to be `shape`) into the view `out`, so a loader can decode
    straight into the parameter; otherwise the view is copied from `get(name)`."""
    if (get is None) == (read_into is None):
        raise ValueError("fill_state needs exactly one of `get` and `read_into`")
    shapes = {k: tuple(v.shape) for k, v in targets.items()}
    for entry in _checked_entries(cfg, shapes, expert_range):
        names = entry.release_names(expert_range)
        views = _split(entry, targets[entry.ours])
        by_name = {r.name: r for r in entry.release}
        if read_into is not None:
            for name, view in zip(names, views, strict=True):
                read_into(name, view, by_name[name].shape)
        else:
            for view, part in zip(views, _fetch(entry, expert_range, get), strict=True):
                view.copy_(part)
        if progress is not None:
            progress(len(names))


def read_state(cfg: DeepseekV4Config, reader: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """{our name: float32 tensor} of `names` (whole tensors) read from an open release."""
    table = name_table(cfg)
    targets = {n: torch.empty(table[n].shape, dtype=torch.float32) for n in names}
    with reader.concurrent(1) as read_into:
        fill_state(cfg, targets, read_into=read_into)
    return targets


def to_release(
    cfg: DeepseekV4Config,
    state: Mapping[str, torch.Tensor],
    *,
    expert_range: tuple[int, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors -> (logical release name, tensor) pairs, in table order (exact inverse of
    `build_state`: views and chunks only, each contiguous). Non-table keys raise."""
    for entry in _entries(cfg, list(state)):
        names = entry.release_names(expert_range)
        parts = _split(entry, state[entry.ours])
        yield from zip(names, parts, strict=True)
