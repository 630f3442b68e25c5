"""Where Engram tables live: replicated, sharded by rows over a process group, or in host memory.

Legend: R = rows of a table, E = row width, N = row ids a step looks up, U = distinct ones,
n = ranks of the group, r = this rank.

A table is two Flash tables of ~384M rows x 256 (~100 GB each in FP8): a step reads 24 rows per
token per Engram layer, so no rank needs the whole table. `place_engram` swaps each `Engram`'s
`table` parameter for a `PlacedTable`:

- frozen (`model.engram.trainable: false`): the rows stay in the release encoding, FP8 e4m3
  codes with one e8m0 scale per 32 values of a row (QuantFormat FP8_1X32), and are decoded after
  the lookup. `replicated`: every rank holds all rows on its device; `host`: all rows in host
  memory, a step gathers its rows there and copies them to the device; `sharded`: rank r holds
  rows [r x ceil(R / n), (r + 1) x ceil(R / n)) on its device.
- trainable (`sharded`): rank r's rows are a parameter in the model dtype, so its gradient and
  optimizer state cover only those rows.

A sharded lookup: the distinct row ids of the step go to their owners (an all-to-all of the ids
each rank needs), each owner answers with its rows (codes and scales, or its parameter's rows),
and the requester decodes them and expands them to the step's [N, E]. Backward of a trainable
table sends each gathered row's gradient back to its owner (the reverse all-to-all), which adds
the answers of every rank into its rows' gradient: the owner's gradient is the sum over the
group, the same as the replicated table's gradient all-reduced over the group.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from primus_v4.checkpoint_formats.fp8_fp4 import FP8_1X32, dequantize, quantize
from primus_v4.errors import ConfigError
from primus_v4.log import get_logger

log = get_logger(__name__)

PLACEMENTS = ("replicated", "sharded", "host")


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the rows rank `rank` of `size` owns (equal blocks, the last one shorter)."""
    per = math.ceil(rows / size)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def encode_rows(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, E] -> (FP8 e4m3 codes [R, E], e8m0 scales [R, E / 32]) as uint8, the release's
    encoding of an Engram table."""
    codes, scales = quantize(table.detach().float(), fmt=FP8_1X32)
    return codes.view(torch.uint8), scales.view(torch.uint8)


def decode_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(uint8 codes [N, E], uint8 scales [N, E / 32]) -> [N, E] in `dtype`, exactly."""
    weight = codes.view(torch.float8_e4m3fn)
    scale = scales.view(torch.float8_e8m0fnu)
    return dequantize(weight, scale, dtype, fmt=FP8_1X32)


def _exchange(tensor: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """all_to_all of the rows of `tensor` ([sum(send), ...]): rank j gets `send[j]` rows."""
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=group)
    return out


class _Route:
    """Who asks whom for which rows in one sharded lookup (the ids sorted, so by owner)."""

    def __init__(self, ids_U: torch.Tensor, rows: int, group: Any) -> None:
        self.group = group
        n = dist.get_world_size(group)
        per = math.ceil(rows / n)
        owner = torch.div(ids_U, per, rounding_mode="floor")
        self.send = torch.bincount(owner, minlength=n).tolist()
        counts = torch.tensor(self.send, dtype=torch.int64, device=ids_U.device)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        self.recv = got.tolist()
        rank = dist.get_rank(group)
        self.asked = _exchange(ids_U, self.send, self.recv, group) - row_range(rows, rank, n)[0]

    def answer(self, rows_local: torch.Tensor) -> torch.Tensor:
        """Rows [sum(recv), ...] this rank owns and others asked for -> theirs, back."""
        return _exchange(rows_local, self.recv, self.send, self.group)

    def give_back(self, grad_U: torch.Tensor) -> torch.Tensor:
        """Gradients of the rows this rank asked for -> to their owners [sum(recv), E]."""
        return _exchange(grad_U, self.send, self.recv, self.group)


class _GatherOwned(torch.autograd.Function):
    """Rows `ids_U` of a table sharded over `route.group`; backward sends each row's gradient
    back to its owner, who adds the answers of all ranks into its shard's gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, route: _Route) -> torch.Tensor:
        ctx.route, ctx.shape = route, shard.shape
        local = route.asked.to(shard.device)
        ctx.save_for_backward(local)
        return route.answer(shard.detach()[local])

    @staticmethod
    def backward(ctx, grad_U: torch.Tensor):
        (local,) = ctx.saved_tensors
        got = ctx.route.give_back(grad_U.detach().contiguous())
        grad = grad_U.new_zeros(ctx.shape).index_add_(0, local, got)
        return grad, None


class PlacedTable(nn.Module):
    """One Engram table at its placement: `table_rows(ids)` -> the rows [*ids.shape, E].

    rows: the whole table's row count; lo / hi: the rows this rank holds; group: the process
    group the rows are sharded over (sharded only)."""

    def __init__(
        self,
        *,
        placement: str,
        rows: int,
        width: int,
        dtype: torch.dtype,
        trainable: bool,
        group: Any = None,
        lo: int = 0,
        hi: int | None = None,
    ) -> None:
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"Engram placement {placement!r}: choose from {list(PLACEMENTS)}")
        if trainable and placement == "host":
            raise ValueError("a trainable Engram table is replicated or sharded, not on the host")
        self.placement, self.rows, self.width, self.dtype = placement, rows, width, dtype
        self.trainable, self.group = trainable, group
        self.lo, self.hi = lo, rows if hi is None else hi
        held = self.hi - self.lo
        self.weight: nn.Parameter | None = None
        if trainable:
            self.weight = nn.Parameter(torch.empty(held, width, dtype=dtype))
        elif placement == "host":  # plain attributes: moving the module leaves them on the host
            self.host_codes = torch.empty(held, width, dtype=torch.uint8)
            self.host_scales = torch.empty(held, width // FP8_1X32.block_cols, dtype=torch.uint8)
        else:
            # not in the state dict: frozen rows are the release's (or the seed's draw), which
            # a resumed run reads again; each rank of a sharded table holds other rows
            codes = torch.empty(held, width, dtype=torch.uint8)
            scales = torch.empty(held, width // FP8_1X32.block_cols, dtype=torch.uint8)
            self.register_buffer("codes", codes, persistent=False)
            self.register_buffer("scales", scales, persistent=False)

    def held_bytes(self) -> int:
        """Bytes this rank holds for the table (device, or host for `host`)."""
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        codes, scales = self.stored()
        return codes.numel() + scales.numel()

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.placement == "host":
            return self.host_codes, self.host_scales
        return self.codes, self.scales

    @torch.no_grad()
    def fill(self, table: torch.Tensor) -> None:
        """Set this rank's rows from the whole table [R, E] (or its rows [lo, hi))."""
        part = table if table.shape[0] == self.hi - self.lo else table[self.lo : self.hi]
        if self.weight is not None:
            self.weight.copy_(part)
            return
        codes, scales = encode_rows(part)
        self.fill_encoded(codes, scales)

    @torch.no_grad()
    def fill_encoded(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Set this rank's rows from their release encoding (uint8 codes and scales)."""
        if self.weight is not None:
            self.weight.copy_(decode_rows(codes, scales, self.weight.dtype))
            return
        own_codes, own_scales = self.stored()
        own_codes.copy_(codes)
        own_scales.copy_(scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids_U, inverse = torch.unique(ids.flatten(), return_inverse=True)
        rows_U = self._distinct(ids_U, ids.device)
        return rows_U[inverse].unflatten(0, ids.shape)

    def _distinct(self, ids_U: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Rows of the sorted distinct ids, on `device`, in `self.dtype`."""
        if self.placement == "sharded":
            held = self.codes if self.weight is None else self.weight
            route = _Route(ids_U.to(held.device), self.rows, self.group)
            if self.weight is not None:
                return _GatherOwned.apply(self.weight, route)
            local = route.asked.to(self.codes.device)
            codes = route.answer(self.codes[local]).to(device)
            scales = route.answer(self.scales[local]).to(device)
            return decode_rows(codes, scales, self.dtype)
        if self.weight is not None:
            return self.weight[ids_U.to(self.weight.device)]
        codes, scales = self.stored()
        at = ids_U.to(codes.device)
        picked_codes, picked_scales = codes[at], scales[at]
        if self.placement == "host":
            pin = torch.cuda.is_available() and device.type == "cuda"
            if pin:
                picked_codes, picked_scales = picked_codes.pin_memory(), picked_scales.pin_memory()
            picked_codes = picked_codes.to(device, non_blocking=pin)
            picked_scales = picked_scales.to(device, non_blocking=pin)
        return decode_rows(picked_codes, picked_scales, self.dtype)


def engram_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every Engram of `model` (DeepSeek-V4.1 layers with a table)."""
    from primus_v4.models.deepseek_v41.engram import Engram

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Engram)]


def place_engram(
    model: nn.Module,
    *,
    placement: str,
    trainable: bool,
    group: Any = None,
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, PlacedTable]:
    """Swap every Engram's `table` parameter for a `PlacedTable` (in place). The rows come from
    the module's own table (its values, encoded FP8 when frozen) unless `tables` gives, by
    Engram module name, this rank's rows already encoded (`read_release_rows`). Replicated and
    trainable keeps the plain parameter (nothing to place). Returns {module name: table}."""
    placed: dict[str, PlacedTable] = {}
    if placement == "replicated" and trainable:
        return placed
    n = dist.get_world_size(group) if placement == "sharded" else 1
    r = dist.get_rank(group) if placement == "sharded" else 0
    for name, engram in engram_modules(model):
        table = engram.table
        rows, width = table.shape
        lo, hi = row_range(rows, r, n)
        device = None if table.is_meta or placement == "host" else table.device
        with torch.device(device or "cpu"):
            store = PlacedTable(placement=placement, rows=rows, width=width, dtype=table.dtype,
                                trainable=trainable, group=group, lo=lo, hi=hi)  # fmt: skip
        if tables is not None and name in tables:
            store.fill_encoded(*tables[name])
        elif not table.is_meta:
            store.fill(table.detach())
        del engram.table
        engram.placed = store
        placed[name] = store
    return placed


def place_for_run(model: nn.Module, section: Any, *, ctx: Any) -> dict[str, PlacedTable]:
    """A run's `model.engram` (`section` is its `model` section) applied to this rank's
        module after the cut and fill.

        The sharded group is DP x CP (`ctx.dp_cp`): the ranks holding the same layers (a pipeline
        stage's ranks; a stage without Engram layers places nothing), each of which looks up its own
        pack's rows. Over one rank, `sharded` holds every row, as `replicated` does. A trainable
        sharded table's gradient is summed over the group by its owner already (the lookup's
        backward), so it is tagged `owner_reduced`: the optimizer sums it over no replicas; and
    `expert_group` / `global_shape`: checkpoints store it, and its optimizer state, as rows of the
    whole table. A frozen table is no state: a resumed run places it again from the release (or
    the seed's draw)."""
    engram = section.engram
    placement = engram.placement
    modules = engram_modules(model)
    width = modules[0][1].table.shape[1] if modules else 0
    if not engram.trainable and width % FP8_1X32.block_cols:
        if placement != "replicated":
            raise ConfigError(
                f"model.engram.placement={placement}: frozen Engram rows are held as FP8 with "
                f"a scale per {FP8_1X32.block_cols} values, and this model's rows are {width} "
                "wide; set model.engram.trainable=true or placement replicated"
            )
        for _, module in modules:  # frozen in the model dtype: nothing to encode
            module.table.requires_grad_(False)
        return {}
    if placement == "sharded" and ctx.dp_cp.size == 1:
        placement = "replicated"
    group = ctx.dp_cp.group if placement == "sharded" else None
    placed = place_engram(model, placement=placement, trainable=engram.trainable, group=group)
    for store in placed.values():
        if store.weight is not None and placement == "sharded":
            store.weight.owner_reduced = True  # type: ignore[attr-defined]
            # checkpoints store it as rows of the whole [R, E] table over the group
            store.weight.expert_group = group  # type: ignore[attr-defined]
            store.weight.global_shape = (store.rows, store.width)  # type: ignore[attr-defined]
    if placed:
        held = sum(s.held_bytes() for s in placed.values())
        log.info("Engram %s, %s: %d tables, %.1f MiB held on this rank", placement,
                 "trainable" if engram.trainable else "frozen (FP8 rows)", len(placed),
                 held / 2**20)  # fmt: skip
    return placed


def release_name(module_name: str) -> str:
    """`layers.L.engram` (ours) -> `layers.L.engram.embed.weight` (the release's table)."""
    return f"{module_name}.embed.weight"


def read_release_rows(
    directory: str | os.PathLike, names: list[str], *, lo_hi: dict[str, tuple[int, int]]
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    """This rank's rows [lo, hi) of the release's Engram tables, undecoded: {module name:
    (codes, scales)} and the bytes read (only those rows' codes and scales)."""
    from primus_v4.checkpoint_formats.sharded import CheckpointReader

    out = {}
    with CheckpointReader(directory) as reader:
        for name in names:
            lo, hi = lo_hi[name]
            out[name] = reader.read_stored_rows(release_name(name), lo, hi)
        return out, reader.bytes_read
