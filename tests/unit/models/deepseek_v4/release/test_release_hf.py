"""The released architecture, with HF transformers' DeepseekV4ForCausalLM as the oracle (it is
in the test extra, with accelerate for its FP8 loader: without them these tests fail).

A tiny random checkpoint in the RELEASE layout (release_checkpoint.py; three geometries and seeds)
is loaded by HF and by us: logits agree, a pack equals HF run on each sample alone, MTP equals
the release formula built from the raw tensors and HF's layer, and a bf16 export reloads in HF
and in ours. At the Flash geometry (meta device) our release names are what HF's conversion
mapping renames into its parameters. Tolerances: float32 everywhere; 1e-5 of the largest logit
covers summation-order differences (measured ~3e-6) and is far below what any architecture
difference gives (>1e-2).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
import transformers.models.deepseek_v4.modeling_deepseek_v4 as hf_v4
from megatron.core.packed_seq_params import PackedSeqParams
from release_checkpoint import FLASH_CONFIG, FLASH_RATIOS, make_checkpoint, write_checkpoint
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

from primus_v4 import load_pretrained, save_pretrained
from primus_v4.models.deepseek_v4.release import state_dict_adapter as rel

REL_TOL = 1e-5  # float32, different summation order (see the module docstring)
CASES = [("a", 0), ("b", 1), ("c", 2)]
LENGTHS = (261, 139, 57, 3)  # a pack: two HCA-window samples, a CSA-only one, a tiny one


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def load_hf(path: Path):
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # HF skips MTP tensors (it has no MTP); nothing else may be missing or left over.
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info
    return model.eval()


def _build_case(tmp_path_factory, geometry: str, seed: int) -> dict:
    path, config, tensors = make_checkpoint(tmp_path_factory.mktemp("ckpt"), geometry, seed)
    ours = load_pretrained(path, dtype=torch.float32, progress=False).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(2, config["vocab_size"], (sum(LENGTHS),), generator=gen)
    return dict(path=path, config=config, tensors=tensors, ours=ours, hf=load_hf(path), ids=ids)


@pytest.fixture(scope="module", params=CASES, ids=[f"{g}-seed{s}" for g, s in CASES])
def case(request, tmp_path_factory):
    return _build_case(tmp_path_factory, *request.param)


def _psp(cu: torch.Tensor) -> PackedSeqParams:
    m = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m
    )


@torch.no_grad()
def test_logits_equal_hf(case) -> None:
    ids = case["ids"][:300][None]
    want = case["hf"](input_ids=ids).logits
    got = case["ours"](ids).logits
    assert got.shape == want.shape
    assert rel_err(got, want) <= REL_TOL


@torch.no_grad()
def test_pack_equals_hf_on_each_sample_alone(case) -> None:
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    got = case["ours"](case["ids"][None], packed_seq_params=_psp(cu)).logits[0]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = case["hf"](input_ids=case["ids"][a:b][None]).logits[0]
        assert rel_err(got[a:b], want) <= REL_TOL, (a, b)


@torch.no_grad()
def test_pack_equals_hf_with_the_triton_attention(tmp_path_factory, monkeypatch) -> None:
    """HF parity with our Triton sparse attention (interpreted on CPU): geometry a, a shorter
    pack that still holds an HCA window (139 rows), a CSA-only sample and a tiny one (the
    interpreter runs one program per query row and layer)."""
    case = _build_case(tmp_path_factory, "a", 0)
    monkeypatch.setenv("PRIMUS_V4_KERNEL_BACKEND", "sparse_attention=triton")
    ours = load_pretrained(case["path"], dtype=torch.float32, progress=False).eval()
    assert all(layer.attn._attend.__name__ == "checked" for layer in ours.layers)  # triton's
    lengths = LENGTHS[1:]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = case["ids"][: int(cu[-1])]
    got = ours(ids[None], packed_seq_params=_psp(cu)).logits[0]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = case["hf"](input_ids=ids[a:b][None]).logits[0]
        assert rel_err(got[a:b], want) <= REL_TOL, (a, b)


def _mtp_layer_checkpoint(case, directory: Path) -> Path:
    """The release checkpoint with the MTP block appended as decoder layer n, so HF builds and
    loads that block as an ordinary DeepseekV4DecoderLayer (its layer kind from the MTP slot)."""
    config, tensors = copy.deepcopy(case["config"]), dict(case["tensors"])
    n = config["num_hidden_layers"]
    mtp_ratio = config["compress_ratios"][n]
    own = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")
    for name in [k for k in tensors if k.startswith("mtp.0.")]:
        rest = name.removeprefix("mtp.0.")
        value = tensors.pop(name)
        if not rest.startswith(own):
            tensors[f"layers.{n}.{rest}"] = value
    config.update(num_hidden_layers=n + 1, num_nextn_predict_layers=0)
    config["compress_ratios"] = [*config["compress_ratios"][:n], mtp_ratio]
    return write_checkpoint(directory, config, tensors)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def test_mtp_logits_equal_the_release_formula(case, tmp_path) -> None:
    """x = e_proj(enorm(emb(t+1))) + h_proj(hnorm(h)) per stream, h = the last decoder layer's
    streams before any HyperHead; one block (HF's layer); own hc_head + norm; shared head."""
    t, cfg, n = case["tensors"], case["config"], case["config"]["num_hidden_layers"]
    assert cfg["num_nextn_predict_layers"] == 1  # every geometry has one MTP depth
    eps, length = cfg["rms_norm_eps"], 300
    ids = case["ids"][:length][None]
    hf = load_hf(_mtp_layer_checkpoint(case, tmp_path / "mtp"))
    streams: dict[str, torch.Tensor] = {}

    def feed_mtp_input(_mod, args, kwargs):
        h = args[0]  # [1, L, K, D]: layer n-1's streams, no HyperHead collapse
        nxt = torch.cat([ids[0, 1:], ids.new_zeros(1)])  # token t+1 (the last row is not compared)
        e = _rms(F.embedding(nxt, t["embed.weight"]), t["mtp.0.enorm.weight"], eps)
        x = F.linear(e, t["mtp.0.e_proj.weight"])[None, :, None, :] + F.linear(
            _rms(h, t["mtp.0.hnorm.weight"], eps), t["mtp.0.h_proj.weight"]
        )
        return (x, *args[1:]), kwargs

    hf.model.layers[n].register_forward_pre_hook(feed_mtp_input, with_kwargs=True)
    hf.model.layers[n].register_forward_hook(lambda m, a, out: streams.update(out=out))
    hf(input_ids=ids)
    head = hf_v4.DeepseekV4HyperHead(hf.config)
    head.load_state_dict(
        {k: t[f"mtp.0.hc_head_{k.removeprefix('hc_')}"] for k in ("hc_fn", "hc_base", "hc_scale")}
    )
    want = F.linear(_rms(head(streams["out"]), t["mtp.0.norm.weight"], eps), t["head.weight"])
    got = case["ours"](ids).mtp_logits[0]
    assert rel_err(got[0, :-1], want[0, :-1]) <= REL_TOL


def _bf16_representable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in tensors.items()
    }


@torch.no_grad()
def test_bf16_export_loads_in_hf_and_reloads_bit_identically(case, tmp_path) -> None:
    """Weights rounded to bf16 first (fp32-kind tensors stay fp32), so the bf16 export loses
    nothing: HF's logits from the export equal ours, and our reload equals the model exactly."""
    src = write_checkpoint(tmp_path / "src", case["config"], _bf16_representable(case["tensors"]))
    ours = load_pretrained(src, dtype=torch.float32, progress=False).eval()
    summary = save_pretrained(ours, tmp_path / "out", dtype="bfloat16", progress=False)
    assert summary.tensors == len(case["tensors"])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in written
    assert written["compress_ratios"] == case["config"]["compress_ratios"]
    ids = case["ids"][:300][None]
    want = load_hf(tmp_path / "out")(input_ids=ids).logits
    assert rel_err(ours(ids).logits, want) <= REL_TOL
    again = load_pretrained(tmp_path / "out", dtype=torch.float32, progress=False)
    before, after = ours.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k


def test_fp8_export_loads_in_hf_like_in_ours(case, tmp_path) -> None:
    """The release's FP8 + FP4 layout as we write it is what HF reads: on CPU HF dequantizes it
    (its FP8 quantizer, FP4 experts included) and its logits equal our reload of the same
    export. 3e-5: measured ~7e-6 (HF dequantizes and sums in another order than we do), far
    below the >1e-2 that a wrong scale, nibble order or layout gives."""
    if case["config"]["hidden_size"] % 32:  # FP4 packs 32 inputs per scale: refused, by name
        with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.* multiple of 32"):
            save_pretrained(case["ours"], tmp_path / "fp8", dtype="fp8", progress=False)
        return
    save_pretrained(case["ours"], tmp_path / "fp8", dtype="fp8", progress=False)
    back = load_pretrained(tmp_path / "fp8", dtype=torch.float32, progress=False)
    ids = case["ids"][:300][None]
    want = load_hf(tmp_path / "fp8")(input_ids=ids).logits
    err = rel_err(back.eval()(ids).logits, want)
    print(f"\nfp8 export: HF logits vs ours from the same files: {err:.2e}")
    assert err <= 3e-5
    # and the export is the quantization of the source, not a copy of it
    assert rel_err(back(ids).logits, case["ours"](ids).logits) > REL_TOL


@torch.no_grad()
def test_a_transformers_saved_checkpoint_reads_as_the_release(case, tmp_path) -> None:
    """transformers' save_pretrained writes its own config keys (layer_types, compress_rates,
    rope_parameters, ...), the release's names under "model." with a few of its own
    (embed_tokens, hc_head.*, attn.norm), and no MTP (its model has none). It loads as the
    release without MTP: every other weight as from the release checkpoint, HF's logits."""
    case["hf"].save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {"layer_types", "rope_parameters"} <= set(saved) and "compress_ratios" not in saved
    ours = load_pretrained(tmp_path / "hf", dtype=torch.float32, progress=False)
    assert ours.cfg.mtp_num_layers == 0
    ref = case["ours"].state_dict()
    state = ours.state_dict()
    assert state and all(torch.equal(t, ref[n]) for n, t in state.items())
    assert any(n.startswith("mtp.") for n in ref) and not any(n.startswith("mtp.") for n in state)
    ids = case["ids"][:300][None]
    assert rel_err(ours.eval()(ids).logits, case["hf"](input_ids=ids).logits) <= REL_TOL


def _hf_names(config: dict) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config))
    return {k.removeprefix("model."): tuple(v.shape) for k, v in hf.state_dict().items()}


def _hf_rename(name: str, transforms: list) -> str:
    for transform in transforms:
        name, _ = transform.rename_source_key(name)
    return name


def test_release_names_are_what_hf_conversion_mapping_expects() -> None:
    """Our release names, renamed by HF's deepseek_v4 conversion mapping, are exactly HF's
    parameters (experts merged); the MTP block is checked as an extra decoder layer."""
    flash = rel.config_from_release(FLASH_CONFIG)
    n = flash.num_layers
    # a deep copy: HF's config class writes into the nested rope_scaling dict it is given
    config = copy.deepcopy(FLASH_CONFIG) | {
        "num_hidden_layers": n + 1,
        "num_nextn_predict_layers": 0,
    }
    config["compress_ratios"] = FLASH_RATIOS[: n + 1]
    hf = _hf_names(config)
    transforms = get_checkpoint_conversion_mapping("deepseek_v4")
    own = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")
    renamed: dict[str, list[rel.ReleaseTensor]] = {}
    for name, t in rel.release_tensors(flash).items():
        if name.startswith("mtp.0."):
            if name.removeprefix("mtp.0.").startswith(own):
                continue
            name = f"layers.{n}." + name.removeprefix("mtp.0.")
        renamed.setdefault(_hf_rename(name, transforms), []).append(t)
    assert set(renamed) == set(hf)
    for hf_name, parts in renamed.items():
        if len(parts) == 1:
            assert parts[0].shape == hf[hf_name], hf_name
        else:  # experts merged: E x (w1, w3) -> [E, 2F, D]; E x w2 -> [E, D, F]
            assert len(parts) in (256, 512) and hf[hf_name][0] == 256, hf_name
