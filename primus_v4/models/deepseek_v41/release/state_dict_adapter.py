"""DeepSeek-V4.1's state-dict adapter: the released text backbone's names <-> ours, one table.

Legend: E = routed experts, D = hidden, F = expert ffn, G = output groups, O = o_lora rank,
I = heads x head_dim / G.

`name_table(cfg)` lists every tensor of our model's state dict with the release tensors it is
made of and how (`op`): `copy` (same shape), `wo_a` (ours [G, O, I] = release [G*O, I]), `cat0`
(the shared expert's gate_up = cat(w1, w3)), `gate_up` / `down` (ours [E, ...] = per-expert
cat(w1, w3) / w2). `release_tensors(cfg)` gives each logical release tensor its storage format:
  fp8     float8_e4m3fn [out, in] + `.scale` e8m0 per 32 x 32 block (attention / indexer-query /
          shared-expert / Engram `wkv` projections)
  fp4     int8 [out, in/2], two e2m1 codes per byte + `.scale` e8m0 per 32 inputs (routed experts)
  fp8row  float8_e4m3fn [rows, E] + `.scale` e8m0 per 32 values of a row (Engram tables)
  bf16 / fp32   stored as is.
Tensors of the release that are not the text backbone (the vision tower, `aligner.*`,
`image_*`, the DSpark stages `mtp.*`, and `ffn.gate.bias_vl`, the routing bias of image tokens)
are `tensors.not_text`: never loaded, carried over by an export. Each entry's storage kind is
one of `tensors.py`'s (its `kind_of` agrees, tested).

`saved_as(cfg, section)`: where a training checkpoint holds the Engram tables placed by
`model.engram` (engram_placement.py): a trainable table sharded over ranks as
`layers.L.engram.placed.weight` (rows of the whole table), a frozen one nowhere (its rows are the
release's, which an export carries unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from primus_v4.models.deepseek_v41.config import DeepseekV41Config
from primus_v4.models.deepseek_v41.release.tensors import read_decoded
from primus_v4.models.deepseek_v41.vision import vision_tensors


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One tensor of ours: the release tensors it is made of, how, and their storage kind."""

    ours: str
    release: tuple[str, ...]
    op: str
    kind: str
    shapes: tuple[tuple[int, ...], ...]
    ours_shape: tuple[int, ...] | None = None  # when it differs from the release's (wo_a)

    @property
    def shape(self) -> tuple[int, ...]:
        """Our tensor's shape (the whole model's)."""
        if self.ours_shape is not None:
            return self.ours_shape
        if self.op == "cat0":
            return (2 * self.shapes[0][0], *self.shapes[0][1:])
        if self.op == "gate_up":
            return (len(self.shapes) // 2, 2 * self.shapes[0][0], *self.shapes[0][1:])
        if self.op == "down":
            return (len(self.shapes), *self.shapes[0])
        return self.shapes[0]


def _e(ours: str, rel: str, shape: tuple[int, ...], kind: str, op: str = "copy") -> Entry:
    return Entry(ours=ours, release=(rel,), op=op, kind=kind, shapes=(shape,))


def _attention(o: str, r: str, cfg: DeepseekV41Config, layer: int | None) -> list[Entry]:
    """A layer's attention tensors (`layer` None: a DSpark stage's, window only)."""
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.q_lora_rank
    g, lo = cfg.o_groups, cfg.o_lora_rank
    out = [
        _e(f"{o}.attn_sink", f"{r}.attn_sink", (h,), "fp32"),
        _e(f"{o}.wq_a.weight", f"{r}.wq_a.weight", (q, d), "fp8"),
        _e(f"{o}.q_norm.weight", f"{r}.q_norm.weight", (q,), "bf16"),
        _e(f"{o}.wq_b.weight", f"{r}.wq_b.weight", (h * hd, q), "fp8"),
        _e(f"{o}.wkv.weight", f"{r}.wkv.weight", (hd, d), "fp8"),
        _e(f"{o}.kv_norm.weight", f"{r}.kv_norm.weight", (hd,), "bf16"),
        Entry(
            ours=f"{o}.wo_a",
            release=(f"{r}.wo_a.weight",),
            op="wo_a",
            kind="fp8",
            shapes=((g * lo, h * hd // g),),
            ours_shape=(g, lo, h * hd // g),
        ),
        _e(f"{o}.wo_b.weight", f"{r}.wo_b.weight", (d, g * lo), "fp8"),
    ]
    if layer is None:
        return out
    ratio, ih, idim = cfg.compress_ratios[layer], cfg.index_n_heads, cfg.index_head_dim
    if layer in cfg.kv_source_layer_ids:
        c = f"{r}.compressor"
        out += [
            _e(f"{o}.compressor.wkv.weight", f"{c}.wkv.weight", (hd, d), "bf16"),
            _e(f"{o}.compressor.norm.weight", f"{c}.norm.weight", (hd,), "bf16"),
            _e(f"{o}.index_keys.wk.weight", f"{r}.indexer.wk.weight", (idim, hd), "bf16"),
            _e(f"{o}.index_keys.k_norm.weight", f"{r}.indexer.k_norm.weight", (idim,), "bf16"),
        ]
        if ratio > 1:
            out.append(_e(f"{o}.compressor.wgate.weight", f"{c}.wgate.weight", (hd, d), "bf16"))
    if layer in cfg.index_source_layer_ids:
        i = f"{r}.indexer"
        out += [
            _e(f"{o}.indexer.wq_b.weight", f"{i}.wq_b.weight", (ih * idim, q), "fp8"),
            _e(f"{o}.indexer.weights_proj.weight", f"{i}.weights_proj.weight", (ih, d), "bf16"),
        ]
    return out


def _moe(o: str, r: str, cfg: DeepseekV41Config) -> list[Entry]:
    d, f, e = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
    s = f"{r}.shared_experts"
    return [
        _e(f"{o}.router.weight", f"{r}.gate.weight", (e, d), "bf16"),
        _e(f"{o}.router.bias", f"{r}.gate.bias", (e,), "fp32"),
        Entry(
            ours=f"{o}.shared.gate_up.weight",
            release=(f"{s}.w1.weight", f"{s}.w3.weight"),
            op="cat0",
            kind="fp8",
            shapes=((f, d), (f, d)),
        ),
        _e(f"{o}.shared.down.weight", f"{s}.w2.weight", (d, f), "fp8"),
        Entry(
            ours=f"{o}.w_gate_up",
            release=tuple(
                n
                for x in range(e)
                for n in (f"{r}.experts.{x}.w1.weight", f"{r}.experts.{x}.w3.weight")
            ),
            op="gate_up",
            kind="fp4",
            shapes=((f, d),) * 2 * e,
        ),
        Entry(
            ours=f"{o}.w_down",
            release=tuple(f"{r}.experts.{x}.w2.weight" for x in range(e)),
            op="down",
            kind="fp4",
            shapes=((d, f),) * e,
        ),
    ]


def _mixers_and_norms(o: str, r: str, cfg: DeepseekV41Config) -> list[Entry]:
    d, k = cfg.hidden_size, cfg.hc_mult
    out = [
        _e(f"{o}.attn_norm.weight", f"{r}.attn_norm.weight", (d,), "bf16"),
        _e(f"{o}.ffn_norm.weight", f"{r}.ffn_norm.weight", (d,), "bf16"),
    ]
    for ours, rel in (("attn_mix", "hc_attn"), ("ffn_mix", "hc_ffn")):
        out += [
            _e(f"{o}.{ours}.proj.weight", f"{r}.{rel}_fn", ((2 + k) * k, k * d), "fp32"),
            _e(f"{o}.{ours}.bias", f"{r}.{rel}_base", ((2 + k) * k,), "fp32"),
            _e(f"{o}.{ours}.scale", f"{r}.{rel}_scale", (3,), "fp32"),
        ]
    return out


def _block(cfg: DeepseekV41Config, layer: int) -> list[Entry]:
    o, r = f"layers.{layer}", f"layers.{layer}"
    d, k = cfg.hidden_size, cfg.hc_mult
    out = _mixers_and_norms(o, r, cfg)
    out += _attention(f"{o}.attn", f"{r}.attn", cfg, layer)
    out += _moe(f"{o}.moe", f"{r}.ffn", cfg)
    if layer in cfg.engram_layer_ids:
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        g = f"{r}.engram"
        out += [
            _e(f"{o}.engram.table", f"{g}.embed.weight", (rows, cfg.engram_head_dim), "fp8row"),
            _e(f"{o}.engram.wkv.weight", f"{g}.wkv.weight", (d * (k + 1), cols), "fp8"),
            _e(f"{o}.engram.q_weight", f"{g}.q_weight", (k, d), "bf16"),
            _e(f"{o}.engram.k_weight", f"{g}.k_weight", (k, d), "bf16"),
        ]
    return out


def _dspark_stage(cfg: DeepseekV41Config, stage: int) -> list[Entry]:
    """One DSpark draft stage (ours `dspark.stages.<k>`, the release's `mtp.<k>`): a window-only
    layer with its own MoE; stage 0 adds the main projection, the last the final norm and the
    Markov and confidence heads (models/deepseek_v41/dspark.py)."""
    from primus_v4.models.deepseek_v41.dspark import stage_config

    o, r = f"dspark.stages.{stage}", f"mtp.{stage}"
    d, v, rank = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    out = _mixers_and_norms(o, r, cfg)
    out += _attention(f"{o}.attn", f"{r}.attn", cfg, None)
    out += _moe(f"{o}.moe", f"{r}.ffn", stage_config(cfg))
    if stage == 0:
        width = d * len(cfg.dspark_target_layer_ids)
        out += [
            _e(f"{o}.main_proj.weight", f"{r}.main_proj.weight", (d, width), "fp8"),
            _e(f"{o}.main_norm.weight", f"{r}.main_norm.weight", (d,), "bf16"),
        ]
    if stage == cfg.dspark_stages - 1:
        out += [
            _e(f"{o}.norm.weight", f"{r}.norm.weight", (d,), "bf16"),
            _e(f"{o}.markov_head.embed.weight", f"{r}.markov_head.embed.weight", (v, rank),
               "bf16"),
            _e(f"{o}.markov_head.head.weight", f"{r}.markov_head.head.weight", (v, rank), "bf16"),
            _e(f"{o}.confidence_head.proj.weight", f"{r}.confidence_head.proj.weight",
               (1, d + rank), "bf16"),
        ]  # fmt: skip
    return out


def name_table(cfg: DeepseekV41Config, *, drafter: bool | None = None) -> dict[str, Entry]:
    """Every tensor of our model's state dict (parameters and persistent buffers) -> its entry;
    with `drafter` (default: when the config trains it, `dspark_train`), the DSpark stages'
    too."""
    if drafter is None:
        drafter = cfg.dspark_train != "off"
    d, v = cfg.hidden_size, cfg.vocab_size
    entries = [
        _e("embedding.weight", "embed.weight", (v, d), "bf16"),
        _e("lm_head.weight", "head.weight", (v, d), "bf16"),
        _e("final_norm.weight", "norm.weight", (d,), "bf16"),
    ]
    for layer in range(cfg.num_layers):
        entries += _block(cfg, layer)
    if drafter:
        for stage in range(cfg.dspark_stages):
            entries += _dspark_stage(cfg, stage)
    # the image encoder's parts a run trains (`vision_train`), under the release's own names
    entries += [_e(name, name, shape, "bf16") for name, shape in vision_tensors(cfg).items()]
    return {e.ours: e for e in entries}


def engram_tables(cfg: DeepseekV41Config) -> list[str]:
    """Our names of the Engram tables (`layers.L.engram.table`)."""
    return [f"layers.{layer}.engram.table" for layer in cfg.engram_layer_ids]


def saved_as(cfg: DeepseekV41Config, section: Any) -> dict[str, str | None]:
    """{our name: the name a training checkpoint of a run (`section`: its `model` section)
    stores it under when placed, or None when it keeps it out} for the Engram tables; a table
    left in place (replicated trainable, or rows not FP8-encodable) is stored as itself."""
    trainable = section.engram.trainable
    out: dict[str, str | None] = {
        name: name.removesuffix("table") + "placed.weight" if trainable else None
        for name in engram_tables(cfg)
    }
    if section.draft.train == "only":  # the frozen backbone: carried from the release
        out.update({n: None for n in name_table(cfg) if not n.startswith("dspark.")})
    return out


def release_tensors(cfg: DeepseekV41Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every logical release tensor of the text backbone -> (logical shape, storage kind)."""
    return {
        rel: (shape, e.kind)
        for e in name_table(cfg).values()
        for rel, shape in zip(e.release, e.shapes, strict=True)
    }


def join(entry: Entry, parts: list[torch.Tensor]) -> torch.Tensor:
    """Our tensor from its release parts (in `entry.release` order)."""
    if entry.op == "copy":
        return parts[0]
    if entry.op == "wo_a":
        return parts[0].reshape(entry.ours_shape)  # [G*O, I] -> [G, O, I]
    if entry.op == "cat0":
        return torch.cat(parts, dim=0)
    if entry.op == "gate_up":
        return torch.stack([torch.cat(parts[i : i + 2], 0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)  # down


def split(entry: Entry, t: torch.Tensor) -> list[torch.Tensor]:
    """Our tensor -> its release parts (in `entry.release` order): `join`'s inverse."""
    if entry.op == "copy":
        return [t]
    if entry.op == "wo_a":
        return [t.reshape(-1, t.shape[-1])]
    if entry.op == "cat0":
        return list(t.chunk(2, dim=0))
    if entry.op == "gate_up":
        return [p for row in t for p in row.chunk(2, dim=0)]
    return list(t)  # down


def expert_slice(entry: Entry, lo: int, hi: int) -> Entry:
    """The entry of an expert weight restricted to the global experts [lo, hi)."""
    per = 2 if entry.op == "gate_up" else 1
    return replace(
        entry, release=entry.release[lo * per : hi * per], shapes=entry.shapes[lo * per : hi * per]
    )


def build_state(
    cfg: DeepseekV41Config, get: Callable[[str, str], torch.Tensor], names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """Our state dict (or the `names` subset) from `get(release_name, kind)`."""
    table = name_table(cfg)
    out = {}
    for ours in table if names is None else names:
        e = table[ours]
        out[ours] = join(e, [get(rel, e.kind) for rel in e.release])
    return out


def read_state(cfg: DeepseekV41Config, reader: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """{our name: float32 tensor} of `names` (whole tensors) read from an open release
    (a `CheckpointReader`), each release part decoded exactly by its storage kind."""
    table = name_table(cfg)
    return {n: join(table[n], [read_decoded(reader, r) for r in table[n].release]) for n in names}


def to_release(cfg: DeepseekV41Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{release_name: tensor} (logical, unquantized) of every text-backbone tensor of `state`,
    and of the DSpark stages when it holds them (a drafter trained or loaded)."""
    out = {}
    drafter = any(name.startswith("dspark.") for name in state)
    for ours, e in name_table(cfg, drafter=drafter or None).items():
        if ours in state:
            out.update(zip(e.release, split(e, state[ours].detach()), strict=True))
    return out
