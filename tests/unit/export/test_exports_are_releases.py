"""Every export is a release: its config.json has the published release's keys of its family
(at every level, vision and DSpark keys where the model has them), its shards hold scales of
the blocks the config.json declares (none for bf16), and a run starts from it. A DeepSeek-V4.1
run from a preset (no release: its drafter trained, no vision tower) exports on its own, in
bf16 and fp8, and reads back as the trained model within the format's rounding; frozen Engram
tables it drew from its seed (in no checkpoint) are exported as the rows it held. An export
whose run's release is gone stops naming the missing file and `--release`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from image_corpus import tiny_image_script
from safetensors import safe_open
from train_fakes import FakeCorpus

from primus_v4.checkpoint_formats.fp8_fp4 import dequantize, quantize
from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.errors import CheckpointFormatError, ExitCode, UsageError
from primus_v4.export.run import (
    export_checkpoint,
    find_source,
    release_tensor_count,
    with_release,
)
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter
from primus_v4.models.deepseek_v41.release.load import load_pretrained, read_config
from primus_v4.models.deepseek_v41.release.tensors import FORMATS
from primus_v4.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
# DeepSeek-V4.1-Flash's config.json as published, key for key (the DSpark golden set keeps it)
V41_PUBLISHED = REPO / "tests/fixtures/dsv41_dspark_golden/checkpoint/config.json"
# DeepSeek-V4-Flash's config.json as published: its keys (`transformers_version` records the
# library that wrote a file, which an export is not)
V4_PUBLISHED = {
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
    "expert_dtype", "hc_eps", "hc_mult", "hc_sinkhorn_iters", "head_dim", "hidden_act",
    "hidden_size", "index_head_dim", "index_n_heads", "index_topk", "initializer_range",
    "max_position_embeddings", "model_type", "moe_intermediate_size", "n_routed_experts",
    "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
    "num_hidden_layers", "num_hash_layers", "num_key_value_heads", "num_nextn_predict_layers",
    "o_groups", "o_lora_rank", "q_lora_rank", "qk_rope_head_dim", "quantization_config",
    "quantization_config.activation_scheme", "quantization_config.fmt",
    "quantization_config.quant_method", "quantization_config.scale_fmt",
    "quantization_config.weight_block_size", "rms_norm_eps", "rope_scaling",
    "rope_scaling.beta_fast", "rope_scaling.beta_slow", "rope_scaling.factor",
    "rope_scaling.original_max_position_embeddings", "rope_scaling.type", "rope_theta",
    "routed_scaling_factor", "scoring_func", "sliding_window", "swiglu_limit",
    "tie_word_embeddings", "topk_method", "torch_dtype", "use_cache", "vocab_size",
    "compress_rope_theta", "compress_ratios",
}  # fmt: skip
SEQ = 128
PACKS = [[60, 50]]
QUIET = ("output.progress_bar=false", "output.plot=false", "train.shuffle=false")
V41 = ("model.preset=tiny_v41", f"data.seq_length={SEQ}", "model.draft.train=joint",
       "model.draft.anchor_rate=0.5")  # fmt: skip


def _trainer(tmp: Path, *items: str, saved: bool = True) -> Trainer:
    """A one-step run of `items` on the fake corpus, writing under `tmp` (checkpointed when
    `saved`)."""
    kept = f"checkpoint.dir={tmp / 'ckpt'}" if saved else "checkpoint.dir=null"
    items = (*QUIET, f"output.dir={tmp / 'run'}", "train.steps=1", "train.warmup_steps=0",
             "train.global_batch_size=1", "train.lr=0.01", kept, *items)  # fmt: skip
    run = resolve_run(load_config(overrides=list(items)), world=1)
    return Trainer(run, corpus=FakeCorpus(PACKS, seq_length=SEQ))


def _exports(run: Path, out: Path, dtypes: tuple[str, ...]) -> dict[str, Path]:
    """`primus-v4 export --run run --out out/<dtype> --dtype <dtype>` of each of `dtypes`."""
    for dtype in dtypes:
        code = main(["export", "--run", str(run), "--out", str(out / dtype), "--dtype", dtype,
                     "--no-progress"])  # fmt: skip
        assert code == 0
    return {dtype: out / dtype for dtype in dtypes}


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("v4")
    _trainer(tmp, "model.preset=tiny", f"data.seq_length={SEQ}").train()
    return _exports(tmp / "run", tmp, ("bfloat16", "fp8"))


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, torch.Tensor]]:
    """A DeepSeek-V4.1 run from the tiny preset (no release), its drafter trained: its bf16
    and fp8 exports and its trained state."""
    tmp = tmp_path_factory.mktemp("v41")
    trainer = _trainer(tmp, *V41)
    trainer.train()
    trained = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
    trained["engram_rows.token_map"] = trainer.model.engram_rows.token_map.clone()
    return _exports(tmp / "run", tmp, ("bfloat16", "fp8")), trained


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run from the tiny release with a vision tower of examples/images (its config.json has
    no quantization_config), the tower frozen: its fp8 export."""
    script = tiny_image_script()
    tmp = tmp_path_factory.mktemp("image")
    script.write_release(tmp / "release")
    # fused_linear_ce=false: the CPU step takes ~1 s instead of ~10 s (no test reads its loss)
    _trainer(tmp, "model.preset=null", f"model.pretrained={tmp / 'release'}",
             f"data.seq_length={SEQ}", "model.fused_linear_ce=false").train()  # fmt: skip
    return _exports(tmp / "run", tmp, ("fp8",)) | {"release": tmp / "release"}


def _paths(d: dict, prefix: str = "") -> list[str]:
    """Every key path of a config.json in file order ("text_config.rope_scaling.factor", ...)."""
    out = []
    for key, value in d.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += _paths(value, f"{prefix}{key}.")
    return out


def _v41_keys(config: dict, *, fp8: bool, vision: bool) -> tuple[list[str], list[str]]:
    """(the key paths of `config`, the published V4.1 config.json's), each in file order, less
    the quantization keys (bf16), the vision keys (a model without an image encoder) and the
    keys inside `vision_config` (the image encoder's own, as its release states them)."""
    left = ("quantization_config",) if not fp8 else ()
    left += ("vision_config", "image_token_id") if not vision else ("vision_config.",)
    published = _paths(json.loads(V41_PUBLISHED.read_text()))
    return [k for k in _paths(config) if not k.startswith(("vision_config.",))], [
        k for k in published if not k.startswith(left)
    ]


def _v4_keys(*, fp8: bool) -> set[str]:
    quantized = ("quantization_config", "expert_dtype")
    return V4_PUBLISHED if fp8 else {k for k in V4_PUBLISHED if not k.startswith(quantized)}


def _headers(directory: Path) -> dict[str, dict]:
    """{stored name: its safetensors header entry (dtype, shape)} of every shard of a release."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with shard.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            out.update(json.loads(f.read(length)))
    out.pop("__metadata__", None)
    return out


def _scales(directory: Path) -> dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]]:
    """{scale name: (its shape, its weight's stored dtype, its weight's stored shape)}."""
    stored = _headers(directory)
    out = {}
    for name, entry in stored.items():
        if name.endswith(".scale"):
            weight = stored[name.removesuffix(".scale") + ".weight"]
            out[name] = (tuple(entry["shape"]), weight["dtype"], tuple(weight["shape"]))
    return out


def _check_scales(directory: Path, *, rows: tuple[str, ...] = ()) -> int:
    """Every scale of `directory` is one per block the config.json declares: FP8 weights per
    `weight_block_size`, FP4 experts (`expert_dtype` fp4: two codes a byte) per 32 inputs; the
    Engram tables (`rows`: FP8 rows) per 32 values of a row. Returns how many were checked."""
    config = json.loads((directory / "config.json").read_text())
    quant = config.get("quantization_config")
    scales = _scales(directory)
    if quant is None:  # bf16: no quantized weight, but the rows a model held as FP8
        assert all(n.startswith(rows) for n in scales), sorted(scales)[:4]
    for name, (shape, dtype, (n, k)) in scales.items():
        if name.startswith(rows) or ".engram.embed." in name:
            want = (n, math.ceil(k / 32))
        elif dtype == "I8":
            assert quant.get("expert_dtype", config.get("expert_dtype")) == "fp4", name
            want = (n, 2 * k // 32)
        else:
            assert dtype == "F8_E4M3", (name, dtype)
            b0, b1 = quant["weight_block_size"]
            want = (math.ceil(n / b0), math.ceil(k / b1))
        assert shape == want, (name, shape, want, (n, k))
    return len(scales)


def _starts_a_run(release: Path, tmp: Path, *items: str) -> float:
    """One training step of a run from `release`; its loss."""
    trainer = _trainer(tmp, "model.preset=null", f"model.pretrained={release}",
                       f"data.seq_length={SEQ}", *items, saved=False)  # fmt: skip
    (row,) = trainer.train().rows
    assert math.isfinite(row.loss), row.loss
    return row.loss


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_v4_export_is_a_v4_release(v4: dict[str, Path], dtype: str, tmp_path: Path) -> None:
    config = json.loads((v4[dtype] / "config.json").read_text())
    assert set(_paths(config)) == _v4_keys(fp8=dtype == "fp8")
    if dtype == "fp8":
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
        assert config["quantization_config"]["scale_fmt"] == "ue8m0"
        assert _check_scales(v4[dtype]) > 0
    else:
        assert _check_scales(v4[dtype]) == 0
    _starts_a_run(v4[dtype], tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_v41_preset_run_exports_a_v41_release(preset, dtype: str, tmp_path: Path) -> None:
    exports, _ = preset
    config = json.loads((exports[dtype] / "config.json").read_text())
    got, published = _v41_keys(config, fp8=dtype == "fp8", vision=False)
    assert got == published
    if dtype == "fp8":
        published = json.loads(V41_PUBLISHED.read_text())["quantization_config"]
        assert config["quantization_config"] == published
        assert list(config["quantization_config"]) == list(published)
    assert config["text_config"]["num_nextn_predict_layers"] == 3  # the trained drafter
    checked = _check_scales(exports[dtype])
    assert (checked > 0) == (dtype == "fp8")
    _starts_a_run(exports[dtype], tmp_path, "model.draft.train=joint")


def _release_rounding(entry: adapter.Entry, value: torch.Tensor) -> torch.Tensor:
    """`value` (ours) as an fp8 export stores it: each release part quantized in its kind's
    blocks, decoded."""
    fmt = FORMATS[entry.kind]
    parts = [dequantize(*quantize(p.float().contiguous(), fmt=fmt), torch.float32, fmt=fmt)
             for p in adapter.split(entry, value)]  # fmt: skip
    return adapter.join(entry, parts)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_v41_preset_export_reads_back_as_the_trained_model(preset, dtype: str) -> None:
    exports, trained = preset
    loaded = load_pretrained(exports[dtype], drafter=True, progress=False)
    # The run hashed its Engram rows through its tokenizer's map, as the export is read.
    assert torch.equal(loaded.engram_rows.token_map, trained["engram_rows.token_map"])
    assert not torch.equal(trained["engram_rows.token_map"], torch.arange(129280) % 99092)
    back = loaded.state_dict()
    table = adapter.name_table(read_config(exports[dtype]), drafter=True)
    assert set(table) <= set(trained), sorted(set(table) - set(trained))[:4]
    worst = {}
    for name, entry in table.items():
        want, have = trained[name].float(), back[name].float()
        if entry.kind == "fp32":
            expected = want
        elif dtype == "bfloat16":
            expected = want.bfloat16().float()
        elif entry.kind in FORMATS:
            expected = _release_rounding(entry, want)
        else:
            expected = want.bfloat16().float()
        assert torch.equal(have, expected), name
        err = float((have - want).abs().max() / want.abs().max().clamp_min(1e-30))
        worst[entry.kind] = max(worst.get(entry.kind, 0.0), err)
    print(f"{dtype}: {len(table)} tensors equal the trained ones' {dtype} rounding; largest "
          f"|export - trained| / max |trained| by kind: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))  # fmt: skip


def test_a_v41_release_run_exports_fp8_in_the_releases_blocks(image, tmp_path: Path) -> None:
    """The tiny image release's config.json has no quantization_config: the fp8 export
    declares the 32 x 32 blocks its shards hold, `expert_dtype` inside it."""
    config = json.loads((image["fp8"] / "config.json").read_text())
    source = json.loads((image["release"] / "config.json").read_text())
    assert "quantization_config" not in source
    got, published = _v41_keys(config, fp8=True, vision=True)
    assert got == published
    assert config["vision_config"] == source["vision_config"]  # the tower's, as released
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    assert "expert_dtype" not in config
    assert _check_scales(image["fp8"]) > 0
    _starts_a_run(image["fp8"], tmp_path, "model.fused_linear_ce=false")  # its loss only finite


def test_frozen_engram_tables_drawn_from_the_seed_are_exported_as_held(tmp_path: Path) -> None:
    """Engram rows 32 wide are held frozen as FP8 rows, drawn from the run's seed and in no
    checkpoint: the export (bf16 and fp8) writes the rows the run held, byte for byte."""
    trainer = _trainer(tmp_path, "model.preset=tiny_v41", f"data.seq_length={SEQ}",
                       "model.overrides.engram_head_dim=32",
                       "model.overrides.vocab_size=512")  # fmt: skip
    trainer.train()
    held = {}
    for name, module in trainer.model.named_modules():
        store = getattr(module, "placed", None)
        if name.endswith(".engram") and store is not None:
            held[f"{name}.embed"] = [t.clone() for t in store.stored()]
    assert len(held) == 2
    source = find_source(tmp_path / "run")
    for dtype in ("bfloat16", "fp8"):
        out, written = tmp_path / dtype, []
        export_checkpoint(source, out, dtype=dtype, progress=written.append)
        assert len(written) == release_tensor_count(source)  # the progress bar's total
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        for prefix, (codes, scales) in held.items():
            for part, want in ((".weight", codes), (".scale", scales)):
                with safe_open(str(out / index[prefix + part]), "pt") as f:
                    got = f.get_tensor(prefix + part).view(torch.uint8)
                assert torch.equal(got, want), (dtype, prefix + part)
        _check_scales(out, rows=tuple(held))


def test_inspect_draft_measures_a_preset_runs_drafter(preset, tmp_path: Path, capsys) -> None:
    """`inspect draft --model <run>` exports the run (no release) and decodes with its drafter."""
    exports, _ = preset
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[5, 17, 300, 41, 9, 77, 120, 3]\n[11, 400, 23, 19, 8]\n")
    capsys.readouterr()
    code = main(["inspect", "draft", "--model", str(exports["fp8"].parent / "run"),
                 "--prompt-ids", str(prompts), "--max-new-tokens", "3", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    got = json.loads(captured.out.splitlines()[-1])
    assert got["prompts"] == 2 and got["block_size"] == 5 and got["blocks"] >= 2
    assert got["prompts_from"] == f"--prompt-ids {prompts}"
    # no prompts named: the run's held-out rows, and this run held none out
    code = main(["inspect", "draft", "--model", str(exports["fp8"].parent / "run")])
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.CONFIG and len(err.splitlines()) == 1, err
    assert (
        "the run held out no rows (data.eval_fraction is 0 and data.eval_path is unset): pass "
        "--data or --prompt-ids" in err
    )


def test_an_export_whose_release_is_gone_names_it_and_the_option(
    image, preset, tmp_path: Path, capsys
) -> None:
    run = image["fp8"].parent / "run"
    moved = tmp_path / "moved"
    shutil.copytree(image["release"], moved)
    shard = "model-vision.safetensors"
    (moved / shard).unlink()
    with pytest.raises(CheckpointFormatError) as err:
        export_checkpoint(with_release(find_source(run), moved), tmp_path / "out")
    message = str(err.value)
    assert str(moved / shard) in message and "--release DIR" in message, message
    assert "\n" not in message and "source=" not in message and not (tmp_path / "out").exists()
    shutil.copy(image["release"] / shard, moved / shard)
    code = main(["export", "--run", str(run), "--out", str(tmp_path / "out"), "--release",
                 str(moved), "--no-progress", "--dtype", "fp8"])  # fmt: skip
    assert code == 0 and (tmp_path / "out" / "config.json").is_file()
    capsys.readouterr()
    from_preset = preset[0]["fp8"].parent / "run"
    code = main(["export", "--run", str(from_preset), "--out", str(tmp_path / "again"),
                 "--release", str(moved)])  # fmt: skip
    message = capsys.readouterr().err.strip()
    assert code == UsageError.exit_code and "started from no release" in message, message
    assert not (tmp_path / "again").exists()
