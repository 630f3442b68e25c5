"""What autograd saves for backward, by layer kind and module: the measurement behind the memory
plan's activation terms (`models/common/activations.py`), used by
`benchmarks/bench_activation_width.py` and the tests that keep the plan next to the code.

A saved_tensors_hooks pack hook records every saved storage once (parameters are not
activations) under the innermost module running, by (layer kind, module path inside the layer):
kind `dense` / `csa` / `hca` for decoder layers, `mtp` for MTP depths, `model` for the rest.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


class SavedBytes:
    """`with SavedBytes(model, cfg) as saved: model(...)`: every storage the forward saved for
    backward, once, in `saved.bytes[(kind, module path)]`. Sizes are read when the forward is
    done: a recompute part releases its output's storage after its consumer saved it."""

    def __init__(self, model: nn.Module, cfg) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.storages: list[tuple[tuple[str, str], torch.UntypedStorage]] = []
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.tensors: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.stack = [("model", "")]
        self.hooks = []
        roots = {f"layers.{i}": cfg.layer_kind(i) for i in range(cfg.num_layers)}
        roots.update({f"mtp.{k}": "mtp" for k in range(len(model.mtp))})
        for name, module in model.named_modules():
            parts = name.split(".")
            root = ".".join(parts[:2])
            kind = roots.get(root, "model")
            path = ".".join(parts[2:]) if root in roots else name
            self.hooks += [
                module.register_forward_pre_hook(lambda *_, k=(kind, path): self._push(k)),
                module.register_forward_hook(lambda *_: self._pop()),
            ]

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self.remove()
        self.finish()

    def _push(self, key: tuple[str, str]) -> None:
        self.stack.append(key)

    def _pop(self) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # The storage object (held until `finish`), not its data pointer: a released part's
        # memory is reused by later tensors at the same address.
        ident = storage._cdata
        if storage.data_ptr() in self.params or ident in self.seen or storage.nbytes() == 0:
            return t
        self.seen.add(ident)
        key = self.stack[-1]
        self.storages.append((key, storage))
        self.tensors[key].append(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
        return t

    def finish(self) -> None:
        for key, storage in self.storages:
            self.bytes[key] += storage.nbytes()
        self.storages = []  # no reference may outlive the forward (the backward frees them)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (kind, _), b in self.bytes.items():
            out[kind] += b
        return dict(out)
