"""The merged export of a LoRA run: base + (alpha / r) B A, written in the release layout.

A LoRA checkpoint holds the adapters and the buffers (router bias, hash table) only. The export
streams one decoder layer (or MTP depth) at a time: the base tensors from the run's
`model.pretrained` release (decoded as the loader decodes them) or, for a random-init run, from
the init (the whole model drawn once from `train.seed`: small models only), the checkpoint's
buffers over them, then each adapted weight merged in float32 and handed to the release writer,
which casts to bf16 or quantizes to the release's FP8 / FP4 (blocks of the merged weight).

Adapter names are the model's (models/deepseek_v4/lora.py): `<linear>.lora_A` [k, r, in] /
`.lora_B` [k, out_k, r] on output spans of `<linear>.weight`; `<attn>.wo_a_lora.lora_{A,B}` on
`<attn>.wo_a` [G, O, I]; `<moe>.expert_lora.{gate,up,down}_{A,B}` [E' , ...] on `<moe>.w_gate_up`
(gate rows [0, F), up rows [F, 2F)) and `<moe>.w_down`, E' = 1 for adapters shared by the experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from primus_v4.models import spec_of
from primus_v4.training.checkpoint import safe_dcp

ADAPTER_SUFFIXES = ("lora_A", "lora_B", "gate_A", "gate_B", "up_A", "up_B", "down_A", "down_B")


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


def _add_rows(w: torch.Tensor, delta: torch.Tensor, lo: int) -> None:
    w[..., lo : lo + delta.shape[-2], :] += delta


@torch.no_grad()
def merge_adapters(
    state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora: Any
) -> list[str]:
    """Replace each adapted base weight of `state` by W + s B A (float32). `lora` is the run's
    `model.lora` section. Returns the merged names; an adapter whose base is absent is an error."""
    scale = lora.alpha / lora.rank
    merged: dict[str, torch.Tensor] = {}

    def base(name: str) -> torch.Tensor:
        if name not in merged:
            if name not in state:
                raise KeyError(f"adapter for {name}, which this piece does not hold")
            merged[name] = state[name].float().clone()
        return merged[name]

    for name in sorted(n for n in adapters if n.endswith("_A")):
        owner, _, attr = name.rpartition(".")
        a = adapters[name].float()
        b = adapters[f"{owner}.{attr[:-1]}B"].float()
        delta = torch.bmm(b, a) * scale  # [k | G | E', out, in]
        if attr == "lora_A" and owner.endswith(".wo_a_lora"):
            base(owner.removesuffix("_lora")).add_(delta)
        elif attr == "lora_A":  # a LoRALinear: k output spans of one size
            w = base(f"{owner}.weight")
            k, out_k = delta.shape[0], delta.shape[1]
            if k * out_k == w.shape[0]:
                starts = [i * out_k for i in range(k)]
            else:  # one half of the shared expert's fused gate_up: w1 rows first, then w3
                starts = [0 if "shared_experts.w1" in lora.targets else out_k]
            for i, lo in enumerate(starts):
                _add_rows(w, delta[i], lo)
        else:  # routed experts: per expert [E, ...], or one adapter shared by them [1, ...]
            moe = owner.removesuffix(".expert_lora")
            kind = attr[:-2]
            if kind == "down":
                base(f"{moe}.w_down").add_(delta)
            else:
                w = base(f"{moe}.w_gate_up")
                _add_rows(w, delta, 0 if kind == "gate" else w.shape[-2] // 2)
    state.update(merged)
    return sorted(merged)


def _group_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ""


def load_group(checkpoint: Path, names: list[str], stored: dict) -> dict[str, torch.Tensor]:
    """`names` of a DCP checkpoint's model state (`stored`: name -> (shape, dtype))."""
    state = {n: torch.empty(stored[n][0], dtype=stored[n][1]) for n in names}
    if state:
        safe_dcp.load({"model": state}, checkpoint, no_dist=True)
    return state


def merged_state(
    cfg: Any,
    run: Any,
    checkpoint: Path,
    stored: dict[str, tuple[torch.Size, torch.dtype]],
    groups: list[list[str]],
) -> Iterator[dict[str, torch.Tensor]]:
    """The merged model, one group of our tensor names at a time (export/run.py's groups)."""
    by_group: dict[str, list[str]] = {}
    for name in stored:
        by_group.setdefault(_group_of(name), []).append(name)
    with base_reader(cfg, run) as read:
        for group in groups:
            state = read(group)
            own = load_group(checkpoint, by_group.get(_group_of(group[0]), []), stored)
            adapters = {n: t for n, t in own.items() if is_adapter(n)}
            state.update({n: t for n, t in own.items() if n in state})  # buffers: the run's
            merge_adapters(state, adapters, run.model.lora)
            yield state


def base_reader(cfg: Any, run: Any) -> _release_base | _drawn_base:
    """`with base_reader(cfg, run) as read:` read(our names) -> the run's base tensors (float32):
    its model.pretrained release, or the init drawn from its seed."""
    pretrained = run.model.pretrained
    return _release_base(cfg, pretrained) if pretrained else _drawn_base(cfg, run)


class _release_base:
    """`with _release_base(cfg, dir) as read:` read(names) -> those tensors of the release."""

    def __init__(self, cfg: Any, directory: str) -> None:
        self.cfg, self.directory = cfg, directory
        self.release = spec_of(cfg).release

    def __enter__(self):
        self.reader = self.release.open(self.directory).__enter__()

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return self.release.names.read_state(self.cfg, self.reader, names)

        return read

    def __exit__(self, *exc: object) -> None:
        self.reader.__exit__(*exc)


class _drawn_base:
    """The random init of a run without model.pretrained: its whole model drawn once from
    `train.seed` in the run's dtype (the base it trained against; with model.lora.base:
    release quantized to FP8 / FP4 and decoded, as the run held it), read in float32."""

    def __init__(self, cfg: Any, run: Any) -> None:
        self.cfg, self.run = cfg, run

    def __enter__(self):
        from primus_v4.training.build import assemble

        model = assemble(
            self.cfg, self.run.model, seed=self.run.train.seed, draw_on="cpu", adapters=False
        ).model
        state = model.state_dict()
        state.update({w.ours: w() for w in spec_of(self.cfg).release.release_weights(model)})

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: state[n].float() for n in names}

        return read

    def __exit__(self, *exc: object) -> None:
        return None
