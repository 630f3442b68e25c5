"""`primus-v4 export` of DeepSeek-V4.1 runs whose Engram tables were placed: dp2 runs (2 gloo
ranks, one launch) from the golden tiny release, float32, 2 steps, Engram sharded over the
ranks, frozen and trainable. The trained model is compared with its export loaded whole in one
process (`load_pretrained`, float32) after rounding its weights as a bf16 export stores them (the
release's bf16 and quantized kinds to bf16, its fp32 kinds kept).

- frozen: the checkpoint holds no table (the rows are the release's); the export carries the
  release's stored FP8 rows and scales byte for byte (bf16 and fp8 exports), and the exported
  model's logits equal the trained model's; without the release to carry them from, the export
  stops naming the tables;
- trainable: the checkpoint holds each table as rows of the whole table; a bf16 export writes the
  whole trained table (never a rank's slice) and its logits equal the trained model's; an fp8
  export writes the trained rows' FP8 1 x 32 encoding (as the release stores its rows; rows
  the run left unchanged keep the release's bytes);
- a trained model in memory whose tables are sharded is refused by `save_pretrained`, naming the
  table (a rank holds only its rows).
"""

from __future__ import annotations

from pathlib import Path

from harness import run_ranks

SETTINGS = ("model.preset=null", "train.steps=2",
            "train.global_batch_size=2", "train.warmup_steps=1", "train.lr=1e-2",
            "checkpoint.interval=2", "model.engram.placement=sharded")  # fmt: skip
PACKS = [[100, 70, 60], [33, 150, 60], [127, 3, 111], [200, 40]]
RUNS = {"frozen": (), "trainable": ("model.engram.trainable=true",)}
ENGRAMS = ("layers.1.engram", "layers.4.engram")  # the golden release's Engram layers
TABLES = tuple(f"{n}.embed" for n in ENGRAMS)  # their release tables


def _logits(model):
    import torch
    from dsv41_model import documents, pack

    ids, pos, psp = pack(documents()[:3])
    model.eval()
    with torch.no_grad():
        return model(ids, pos, packed_seq_params=psp).logits.float()


def _as_exported(model) -> None:
    """Round `model`'s weights in place as a bf16 export stores them (the quantized and bf16
    kinds of the release as bf16, its fp32 kinds as they are)."""
    import torch

    from primus_v4.models.deepseek_v41.release.state_dict_adapter import name_table

    kinds = {n: e.kind for n, e in name_table(model.cfg).items()}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            table = name.removesuffix(".placed.weight") + ".table"
            if kinds.get(name, kinds.get(table)) not in (None, "fp32"):
                t.copy_(t.bfloat16())


def _refused_in_memory(model, out: Path) -> str:
    """save_pretrained of the trained model whose tables are placed: the error line."""
    from dsv41_model import CHECKPOINT

    from primus_v4 import save_pretrained
    from primus_v4.errors import CheckpointFormatError

    try:
        save_pretrained(model, out, source=CHECKPOINT)
    except CheckpointFormatError as exc:
        return str(exc)
    return "written"


def _rank(rank: int, world: int, out: str) -> dict:
    import torch.distributed as dist
    from dsv41_model import CHECKPOINT
    from train_fakes import FakeCorpus, tiny_run

    from primus_v4.parallel.groups import destroy_parallel
    from primus_v4.training.trainer import Trainer

    got = {}
    for kind, settings in RUNS.items():
        root = Path(out) / kind
        run = tiny_run(root / f"rank{rank}", *SETTINGS, f"model.pretrained={CHECKPOINT}",
                       *settings, f"checkpoint.dir={root / 'ckpt'}", world=world)  # fmt: skip
        trainer = Trainer(run, corpus=FakeCorpus(PACKS))
        try:
            losses = [r.loss for r in trainer.train().rows]
            rows = {
                n: (m.lo, m.hi, None if m.weight is None else m.weight.detach().clone())
                for n, m in trainer.model.named_modules()
                if n.endswith("engram.placed")
            }
            got[kind] = {
                "losses": losses,
                "rows": rows,
                "in_memory": _refused_in_memory(trainer.model, root / f"saved{rank}"),
            }
            _as_exported(trainer.model)
            got[kind]["logits"] = _logits(trainer.model)
        finally:
            trainer.runtime.close()
            destroy_parallel()
        if rank == 0:
            got[kind]["exports"] = _export(root, without_release=kind == "frozen")
        dist.barrier()
    return got


def _export(root: Path, *, without_release: bool) -> dict:
    """Exports of the run's step-2 checkpoint, each loaded whole in this process; and, with
    `without_release`, its export as if the run had no release: the error line."""
    from dataclasses import replace

    import torch

    from primus_v4.export.run import (
        ExportError,
        export_checkpoint,
        find_source,
        release_tensor_count,
    )
    from primus_v4.models.deepseek_v41.release.load import load_pretrained

    source = find_source(root / "ckpt")
    out: dict = {}
    models = {}
    for dtype in ("bfloat16", "fp8"):
        target = root / f"export_{dtype}"
        written = []
        export_checkpoint(source, target, dtype=dtype, progress=written.append)
        assert len(written) == release_tensor_count(source)  # the progress bar's total
        models[dtype] = load_pretrained(target, dtype=torch.float32, progress=False)
        out[dtype] = {"dir": str(target), "logits": _logits(models[dtype]),
                      "tables": {n: models[dtype].get_submodule(n).table.detach().clone()
                                 for n in ENGRAMS}}  # fmt: skip
    with torch.no_grad():  # the bf16 export with the fp8 export's Engram rows only
        for n in ENGRAMS:
            models["bfloat16"].get_submodule(n).table.copy_(out["fp8"]["tables"][n])
    out["fp8 engram only"] = {"logits": _logits(models["bfloat16"])}
    if not without_release:
        return out
    alone = replace(source, run=replace(source.run, model=replace(source.run.model,
                                                                   pretrained=None)))  # fmt: skip
    try:
        export_checkpoint(alone, root / "export_no_release")
        out["no_release"] = "written"
    except ExportError as exc:
        out["no_release"] = str(exc)
    out["no_release_left"] = (root / "export_no_release").exists()
    return out


def _stored(directory: str | Path) -> dict:
    """{stored name: (dtype, raw bytes)} of the Engram tables (codes and scales) of a release."""
    from dsv41_model import stored_bytes

    return stored_bytes(directory, [f"{t}.{part}" for t in TABLES for part in ("weight", "scale")])


def test_exports_of_placed_engram_runs(tmp_path: Path) -> None:
    import torch
    from dsv41_model import CHECKPOINT

    from primus_v4.models.deepseek_v41.engram_placement import decode_rows, encode_rows

    ranks = run_ranks(_rank, 2, str(tmp_path), timeout_s=600)
    source = _stored(CHECKPOINT)
    for kind in RUNS:
        one, two = ranks[0][kind], ranks[1][kind]
        print(f"\n{kind}: losses {one['losses']}")
        assert torch.equal(one["logits"], two["logits"])  # replicas: the same model
        for r in (one, two):  # never written without the tables: refused, naming them
            message = r["in_memory"]
            assert "layers.1.engram" in message, message
            # trainable: a rank holds its rows only; frozen: the rows of the release the model
            # was read from, which the trainer's model does not record
            assert ("rows [" if kind == "trainable" else "does not record") in message, message
        exports = one["exports"]
        diff = (exports["bfloat16"]["logits"] - one["logits"]).abs().max().item()
        print(f"{kind}: bf16 export vs the trained model, max |logits difference| {diff:.3e}")
        assert diff == 0.0  # the same weights and Engram rows, float32 on one process
        if kind == "frozen":
            for dtype in ("bfloat16", "fp8"):  # the release's bytes, carried unchanged
                got = _stored(exports[dtype]["dir"])
                assert got.keys() == source.keys()
                for name, (dt, raw) in source.items():
                    assert got[name][0] == dt and torch.equal(got[name][1], raw), (dtype, name)
            print(f"frozen, no release: {exports['no_release']}\nin memory: {one['in_memory']}")
            assert "layers.1.engram.table" in exports["no_release"], exports["no_release"]
            assert "model.pretrained" in exports["no_release"]
            assert not exports["no_release_left"]
            continue
        for module in ENGRAMS:
            name = f"{module}.placed"
            (lo0, hi0, w0), (lo1, hi1, w1) = one["rows"][name], two["rows"][name]
            assert (lo0, hi1) == (0, hi1) and hi0 == lo1  # the two halves of the table
            trained = torch.cat([w0, w1])
            exported = exports["bfloat16"]["tables"][module]
            assert exported.shape == trained.shape, module
            assert torch.equal(exported, trained.bfloat16().float()), module
            # rows 32 wide: one FP8 1 x 32 block each, re-encoded where the run moved it
            moved = (trained != decode_rows(*source_rows(module), torch.float32)).any(1)
            encoded = decode_rows(*encode_rows(trained), torch.float32)
            fp8 = exports["fp8"]["tables"][module]
            assert torch.equal(fp8, torch.where(moved[:, None], encoded, trained)), module
            err = ((fp8 - trained).abs() / trained.abs().amax(1, keepdim=True)).max().item()
            moved = moved.sum()
            # e4m3 rounds to 3 mantissa bits (relative error <= 2^-4), the scale to the row's
            # largest value: no value moves by more than 2^-4 of it
            print(f"{module}: {int(moved)} of {trained.shape[0]} rows trained; fp8 export "
                  f"re-encoding error {err:.3e} of the row's largest value")  # fmt: skip
            assert moved > 0 and err <= 2**-4
        for what in ("fp8", "fp8 engram only"):  # measured: FP8 of the weights, of the rows
            diff = (exports[what]["logits"] - one["logits"]).abs().max().item()
            print(
                f"trainable: {what} export vs the trained model, max |logits difference| "
                f"{diff:.3e} (logits up to {one['logits'].abs().max().item():.2f})"
            )


def source_rows(module: str):
    """The golden release's rows of `module`'s table, undecoded (codes, scales)."""
    from dsv41_model import CHECKPOINT

    from primus_v4.checkpoint_formats.sharded import CheckpointReader

    with CheckpointReader(CHECKPOINT) as reader:
        name = f"{module}.embed.weight"
        return reader.read_stored_rows(name, 0, reader.shape(name)[0])
