"""Engram tables sharded by rows over 2 gloo ranks equal the replicated model: frozen FP8 rows
loaded from the release (each rank reads only its rows) and a trainable sharded table, whose
rows' gradients are the replicated table's gradient summed over the ranks; the run's placement
on a meta model filled by the release loader, which reads only each rank's rows. One launch
checks all, each rank on its own pack."""

from __future__ import annotations

import copy

from harness import run_ranks


def _step(model, rank):
    import torch
    from dsv41_model import documents, next_token_labels, pack

    docs = documents()
    docs = docs[rank::2]
    ids, pos, psp = pack(docs)
    out = model(ids, pos, packed_seq_params=psp)
    labels = next_token_labels(docs)[0]
    keep = labels >= 0
    torch.nn.functional.cross_entropy(out.logits[0][keep], labels[keep]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def _differences(rank: int, world: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from dsv41_model import CHECKPOINT, load_model

    from primus_v4.models.deepseek_v41.engram_placement import (
        engram_modules,
        place_engram,
        read_release_rows,
        row_range,
    )

    torch.set_num_threads(1)
    ref = load_model()
    want_logits, want = _step(ref, rank)
    names = [n for n, _ in engram_modules(ref)]
    rows = {n: ref.get_submodule(n).table.shape[0] for n in names}
    lo_hi = {n: row_range(rows[n], rank, world) for n in names}
    out: dict[str, float] = {}

    tables, read = read_release_rows(CHECKPOINT, names, lo_hi=lo_hi)
    out["bytes_read"] = read
    out["bytes_own_rows"] = sum((hi - lo) * 33 for lo, hi in lo_hi.values())
    frozen = copy.deepcopy(ref)
    placed = place_engram(frozen, placement="sharded", trainable=False, tables=tables)
    out["frozen_rows_held"] = sum(s.hi - s.lo for s in placed.values())
    logits, grads = _step(frozen, rank)
    out["frozen_logits"] = (logits - want_logits).abs().max().item()
    out["frozen_grads"] = max((g - want[n]).abs().max().item() for n, g in grads.items())
    out["frozen_grad_names"] = float(sorted(grads) == sorted(n for n in want if "table" not in n))

    trained = copy.deepcopy(ref)
    placed = place_engram(trained, placement="sharded", trainable=True)
    logits, grads = _step(trained, rank)
    out["trainable_logits"] = (logits - want_logits).abs().max().item()
    table_diff = other_diff = compared = 0.0
    for name, g in grads.items():
        if name.endswith("placed.weight"):
            module = name.removesuffix(".placed.weight")
            total = want[f"{module}.table"].clone()
            dist.all_reduce(total)  # the replicated table's gradient over the ranks' packs
            lo, hi = lo_hi[module]
            table_diff = max(table_diff, (g - total[lo:hi]).abs().max().item())
            compared += 1
        else:
            other_diff = max(other_diff, (g - want[name]).abs().max().item())
    out["trainable_table_grads"] = table_diff
    out["trainable_other_grads"] = other_diff
    out["trainable_tables_compared"] = compared
    out["trainable_params"] = float(sum(s.weight.numel() for s in placed.values()))
    out.update(_placed_before_load(trained, frozen))
    return out


def _placed_before_load(trained, frozen) -> dict[str, float]:
    """A run's placement (`place_for_run`, over DP x CP = the 2 ranks) on a meta model, then
    the release loader: each rank's rows come straight from the release (no whole table is
    ever allocated), equal to the rows placed from the loaded model."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from dsv41_model import CHECKPOINT, golden

    from primus_v4.config.schema import EngramConfig
    from primus_v4.models.deepseek_v4.weight_init import init_buffers
    from primus_v4.models.deepseek_v41.engram_placement import engram_modules, place_for_run
    from primus_v4.models.deepseek_v41.model import DeepseekV41Model
    from primus_v4.models.deepseek_v41.release.load import load_rank_weights

    ctx = SimpleNamespace(dp_cp=SimpleNamespace(size=dist.get_world_size(), group=None))
    out = {}
    for trainable, want in ((True, trained), (False, frozen)):
        with torch.device("meta"):
            model = DeepseekV41Model(trained.cfg)
        section = SimpleNamespace(engram=EngramConfig(placement="sharded", trainable=trainable))
        placed = place_for_run(model, section, ctx=ctx)
        model.to_empty(device="cpu")
        load_rank_weights(model, CHECKPOINT, token_map=golden()["token_map"])
        init_buffers(model)
        kind = "trainable" if trainable else "frozen"
        tables = [getattr(m, "table", None) for _, m in engram_modules(model)]
        out[f"{kind}_whole_tables"] = float(sum(t is not None for t in tables))
        got, ref = model.state_dict(keep_vars=True), want.state_dict(keep_vars=True)
        out[f"{kind}_state_equal"] = float(
            sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in got)
        )
        stores = {n: s for n, s in placed.items()}
        rows_equal = all(
            torch.equal(a, b)
            for n, s in stores.items()
            for a, b in zip(
                [s.weight] if trainable else s.stored(),
                [want.get_submodule(n).placed.weight]
                if trainable
                else want.get_submodule(n).placed.stored(),
                strict=True,
            )
        )
        out[f"{kind}_rows_equal"] = float(rows_equal)
        out[f"{kind}_owner_reduced"] = float(
            all(getattr(s.weight, "owner_reduced", False) for s in stores.values())
            if trainable else not any(p.requires_grad is False for p in model.parameters())
        )  # fmt: skip
    return out


def test_sharded_engram_equals_the_replicated_model():
    results = run_ranks(_differences, 2, timeout_s=240)
    rows = 660 + 864  # the golden tables' rows, split in halves
    assert sum(r["frozen_rows_held"] for r in results) == rows
    assert sum(r["trainable_params"] for r in results) == rows * 32
    for r in results:
        assert r["bytes_read"] == r["bytes_own_rows"]  # only this rank's rows are read
        assert r["frozen_grad_names"] == 1.0
        assert r["frozen_logits"] == 0.0 and r["frozen_grads"] == 0.0
        assert r["trainable_logits"] == 0.0 and r["trainable_other_grads"] == 0.0
        assert r["trainable_tables_compared"] == 2 and r["trainable_table_grads"] <= 1e-6
        for kind in ("trainable", "frozen"):  # placed on a meta model, then the loader
            assert r[f"{kind}_whole_tables"] == 0.0
            assert r[f"{kind}_state_equal"] == 1.0 and r[f"{kind}_rows_equal"] == 1.0
            assert r[f"{kind}_owner_reduced"] == 1.0
