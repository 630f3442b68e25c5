"""A DeepSeek-V4.1 run that started from one of our bf16 exports (a release storing the quantized
kinds as bf16, its frozen Engram tables as FP8 rows) exports beside it in both dtypes: fp8
quantizes afresh in the release's blocks what the source holds no FP8 / FP4 bytes of (32 x 32
scales, config.json declaring them), bf16 writes bf16 (no quantization_config), the Engram rows
stay the source's FP8 rows byte for byte; every tensor reads back as the trained one within the
format's rounding. Tensors such a source stores bf16 and an fp8 export carries (a drafter the run
did not train) are quantized afresh rather than copied, so the shards hold what config.json
declares."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from train_fakes import FakeCorpus

from primus_v4.checkpoint_formats.fp8_fp4 import dequantize, quantize
from primus_v4.checkpoint_formats.sharded import CheckpointReader, tokenizer_files
from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release.config_json import QUANTIZATION_CONFIG
from primus_v4.models.deepseek_v41.release.load import (
    load_pretrained,
    read_config,
    release_token_map,
)
from primus_v4.models.deepseek_v41.release.save import save_release, write_release
from primus_v4.models.deepseek_v41.release.tensors import FORMATS, kind_of
from primus_v4.training.trainer import Trainer

SEQ = 128
PACKS = [[60, 50]]
DTYPES = ("bfloat16", "fp8")
MODES = ("only", "joint")  # a drafter-only run (backbone frozen) and a full fine-tune


def _run(tmp: Path, *items: str) -> dict[str, torch.Tensor]:
    """A one-step checkpointed run of `items` on the fake corpus under `tmp`: its trained
    state (our names)."""
    items = ("output.progress_bar=false", "output.plot=false", "train.shuffle=false",
             f"output.dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ckpt'}", "train.steps=1",
             "train.warmup_steps=0", "train.global_batch_size=1", "train.lr=0.01",
             f"data.seq_length={SEQ}", "model.draft.anchor_rate=0.5", *items)  # fmt: skip
    trainer = Trainer(resolve_run(load_config(overrides=list(items)), world=1),
                      corpus=FakeCorpus(PACKS, seq_length=SEQ))  # fmt: skip
    trainer.train()
    return {n: t.detach().float().clone() for n, t in trainer.model.state_dict().items()}


def _export(run: Path, out: Path, dtype: str) -> Path:
    code = main(["export", "--run", str(run), "--out", str(out), "--dtype", dtype,
                 "--no-progress"])  # fmt: skip
    assert code == 0, (run, dtype)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bf16 export of a tiny V4.1 preset run with its drafter trained: a release storing
    every quantized kind as bf16 but the Engram tables (32 wide: held frozen as FP8 rows by the
    run, drawn from its seed)."""
    tmp = tmp_path_factory.mktemp("preset")
    _run(tmp, "model.preset=tiny_v41", "model.draft.train=joint",
         "model.overrides.engram_head_dim=32")  # fmt: skip
    return _export(tmp / "run", tmp / "bf16", "bfloat16")


@pytest.fixture(scope="module", params=MODES)
def beside(request, source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A run of `model.draft.train` mode from the bf16 export: (its exports by dtype, its
    trained state)."""
    tmp = tmp_path_factory.mktemp(request.param)
    trained = _run(tmp, "model.preset=null", f"model.pretrained={source}",
                   f"model.draft.train={request.param}")  # fmt: skip
    return {d: _export(tmp / "run", tmp / d, d) for d in DTYPES}, trained


def _headers(directory: Path) -> dict[str, dict]:
    """{stored name: its safetensors header entry} of every shard of a release."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with shard.open("rb") as f:
            out.update(json.loads(f.read(int.from_bytes(f.read(8), "little"))))
    out.pop("__metadata__", None)
    return out


def _bytes(directory: Path, names: list[str]) -> dict[str, tuple[str, bytes]]:
    """{stored name: (its dtype, its bytes)} of `names` in a release."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name in names:
        with safe_open(str(directory / index[name]), "pt") as f:
            tensor = f.get_tensor(name)
        out[name] = (str(tensor.dtype), tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return out


def _values(directory: Path) -> dict[str, torch.Tensor]:
    """{release name: float32 tensor} of every logical tensor of a release, decoded in the
    V4.1 blocks or cast from how it is stored (read_tensors wants the release's layout)."""
    with CheckpointReader(directory) as reader:
        return {n: reader.read(n, torch.float32, fmt=FORMATS.get(kind_of(n)))
                for n in reader.names()}  # fmt: skip


def _check_layout(directory: Path, dtype: str, *, rows: bool) -> None:
    """config.json declares the 32 x 32 blocks iff fp8; an fp8 export stores every quantized
    kind quantized with a scale per block of it (FP8 32 x 32, FP4 per 32 inputs, Engram FP8
    rows per 32 values of a row), a bf16 one stores them bf16 but the Engram tables held as
    FP8 rows (`rows`)."""
    config = json.loads((directory / "config.json").read_text())
    assert (config.get("quantization_config") == QUANTIZATION_CONFIG) == (dtype == "fp8")
    assert ("quantization_config" in config) == (dtype == "fp8")
    stored = _headers(directory)
    quantized = [n for n in stored if n.endswith(".weight") and kind_of(n) in FORMATS]
    assert quantized
    for name in quantized:
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        (n, k), kind = stored[name]["shape"], kind_of(name)
        if dtype == "bfloat16" and not (rows and kind == "fp8row"):
            assert scale is None and stored[name]["dtype"] == "BF16", name
            continue
        want = {"fp8": ("F8_E4M3", [math.ceil(n / 32), math.ceil(k / 32)]),
                "fp4": ("I8", [n, 2 * k // 32]),
                "fp8row": ("F8_E4M3", [n, math.ceil(k / 32)])}[kind]  # fmt: skip
        assert (stored[name]["dtype"], scale and scale["shape"]) == want, name


def _rounded(kind: str, value: torch.Tensor, dtype: str) -> torch.Tensor:
    """A release part of `kind` as an export of `dtype` stores it, decoded: fp32 exact, bf16
    rounded to bf16, a quantized kind in fp8 quantized afresh in its kind's blocks."""
    if kind == "fp32":
        return value
    if dtype == "bfloat16" or kind not in FORMATS:
        return value.bfloat16().float()
    fmt = FORMATS[kind]
    return dequantize(*quantize(value.float().contiguous(), fmt=fmt), torch.float32, fmt=fmt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_run_from_a_bf16_export_exports_beside_it(beside, source: Path, dtype: str) -> None:
    exports, trained = beside
    _check_layout(exports[dtype], dtype, rows=True)
    # the source's tokenizer, as the export's: its Engram map built once (it takes seconds)
    token_map = release_token_map(source, read_config(source))
    back = load_pretrained(exports[dtype], drafter=True, progress=False, token_map=token_map)
    back = back.state_dict()
    table = adapter.name_table(read_config(exports[dtype]), drafter=True)
    assert any(n.startswith("dspark.") for n in table)
    placed = [n for n in table if n not in trained]  # the frozen Engram tables: carried
    assert placed and all(table[n].kind == "fp8row" for n in placed), placed
    for name in placed:
        stored = [s for rel in table[name].release for s in (rel, rel[: -len("weight")] + "scale")]
        assert _bytes(exports[dtype], stored) == _bytes(source, stored), name
    for name, entry in table.items():
        if name in placed:
            continue
        parts = [_rounded(entry.kind, p, dtype) for p in adapter.split(entry, trained[name])]
        assert torch.equal(back[name].float(), adapter.join(entry, parts)), (name, entry.kind)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_drafter_carried_from_a_bf16_source_is_written_as_declared(
    source: Path, dtype: str, tmp_path: Path
) -> None:
    """A source storing every quantized kind bf16 (its Engram tables too): the text tensors
    given, its `mtp.*` (not given: carried) of the quantized kinds are quantized afresh for
    fp8, the rest (all of them for bf16) copied as stored; the progress counts the given
    tensors alone."""
    values = _values(source)
    plain = tmp_path / "plain"
    config = json.loads((source / "config.json").read_text())
    write_release([values], plain, config=config, dtype="bfloat16",
                  extra_files=tokenizer_files(source))  # fmt: skip
    given = {n: t for n, t in values.items() if not n.startswith("mtp.")}
    ticks: list[int] = []
    export = save_release(given, plain, tmp_path / dtype, dtype=dtype, progress=ticks.append)
    assert len(ticks) == len(given)
    drafter = [n for n in values if n.startswith("mtp.")]
    recoded = [n for n in drafter if dtype == "fp8" and kind_of(n) in FORMATS]
    assert recoded or dtype == "bfloat16"
    assert sorted(export.carried) == sorted(set(drafter) - set(recoded))  # bf16: no scales
    _check_layout(tmp_path / dtype, dtype, rows=False)
    back = _values(tmp_path / dtype)
    assert set(back) == set(values)
    for name, value in values.items():
        assert torch.equal(back[name], _rounded(kind_of(name), value, dtype)), name
