"""A V4.1 release in: every text tensor consumed and decoded exactly, the non-text ones named and
left, an unknown or missing tensor an error, an expert shard reading only its experts, and the
model's weights back out under their release names (`to_release`, the inverse of the load)."""

from __future__ import annotations

import pytest
import torch
from dsv41_model import CHECKPOINT, load_model

import primus_v4
from primus_v4.checkpoint_formats.fp8_fp4 import FP4_VALUES
from primus_v4.checkpoint_formats.sharded import CheckpointReader
from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.model import DeepseekV41Model
from primus_v4.models.deepseek_v41.release import load, tensors
from primus_v4.models.deepseek_v41.release import state_dict_adapter as adapter


@pytest.fixture
def model(golden_model):
    return golden_model


def _by_hand(reader: CheckpointReader, name: str, kind: str) -> torch.Tensor:
    """An independent decode: codes x 2^(scale - 127) with torch's own e4m3 / e8m0 casts."""
    raw = reader._raw(name)
    if kind not in tensors.FORMATS:
        return raw.float()
    scale = reader._raw(reader._scale_of[name]).float()
    if kind == "fp4":
        b = raw.view(torch.uint8).long()
        table = torch.tensor(FP4_VALUES)
        codes = torch.stack((table[b & 15], table[b >> 4]), -1).flatten(-2)
        return codes * scale.repeat_interleave(32, dim=1)
    rows = 1 if kind == "fp8row" else 32
    full = scale.repeat_interleave(rows, 0).repeat_interleave(32, 1)
    return raw.float() * full[: raw.shape[0], : raw.shape[1]]


def test_every_text_tensor_is_decoded_exactly_and_given_back_by_name(model, caplog) -> None:
    out = adapter.to_release(model.cfg, model.state_dict())
    expected = adapter.release_tensors(model.cfg)
    assert set(out) == set(expected)
    stored_as = {"fp8": "fp8", "fp8row": "fp8", "fp4": "fp4", "bf16": "bf16", "fp32": "fp32"}
    with CheckpointReader(CHECKPOINT) as reader:
        text = [n for n in reader.names() if not tensors.not_text(n)]
        assert sorted(text) == sorted(expected)  # every text tensor of the release is consumed
        kinds = {}
        for name, (shape, kind) in expected.items():
            assert reader.storage(name) == stored_as[kind], name
            assert tuple(out[name].shape) == shape, name
            assert torch.equal(out[name], _by_hand(reader, name, kind)), name
            kinds[kind] = kinds.get(kind, 0) + 1
    # the golden set: 483 text tensors + 328 scales + 10 bias_vl = its manifest's 821
    assert set(kinds) == set(stored_as), kinds


def test_non_text_tensors_are_counted_by_part_in_one_line_and_left(caplog) -> None:
    caplog.set_level("INFO")
    load_model()
    lines = [
        r.getMessage() for r in caplog.records if "not part of the text model" in r.getMessage()
    ]
    assert len(lines) == 1
    # the image-token routing bias of every layer, counted rather than named one by one
    n = load.read_config(CHECKPOINT).num_layers
    assert lines[0].endswith(f": {n} tensors (ffn.gate.bias_vl {n})"), lines[0]


def test_an_unknown_or_missing_tensor_is_an_error(model, monkeypatch) -> None:
    full = adapter.release_tensors
    fewer = lambda cfg: {k: v for k, v in full(cfg).items() if k != "layers.3.attn.wkv.weight"}
    monkeypatch.setattr(adapter, "release_tensors", fewer)
    with pytest.raises(
        CheckpointFormatError, match=r"unknown tensors \['layers.3.attn.wkv.weight'"
    ):
        load.check(CHECKPOINT, model.cfg)
    more = lambda cfg: {**full(cfg), "layers.0.attn.extra.weight": ((1,), "bf16")}
    monkeypatch.setattr(adapter, "release_tensors", more)
    with pytest.raises(CheckpointFormatError, match=r"missing tensors \['layers.0.attn.extra"):
        load.check(CHECKPOINT, model.cfg)


def test_an_expert_shard_reads_only_its_experts(model, monkeypatch) -> None:
    readers: list[CheckpointReader] = []
    opened = load.open_release

    def counting(path):
        readers.append(opened(path))
        return readers[-1]

    monkeypatch.setattr(load, "open_release", counting)
    token_map = model.engram_rows.token_map

    def build(lo: int, hi: int) -> DeepseekV41Model:
        with torch.device("meta"):
            m = DeepseekV41Model(model.cfg)
        for block in m.layers:  # what expert parallelism keeps of each MoE layer
            for name in ("w_gate_up", "w_down"):
                w = getattr(block.moe, name)
                setattr(block.moe, name, torch.nn.Parameter(torch.empty_like(w[lo:hi])))
            block.moe.expert_offset = lo
        m.to_empty(device="cpu")
        load.load_rank_weights(m, CHECKPOINT, token_map=token_map)
        return m

    half = build(4, 8)
    whole = readers[-1].bytes_read
    build(0, 8)
    full = readers[-1].bytes_read
    expert_bytes = sum(readers[-1].nbytes(n) for n in readers[-1].names() if ".experts." in n)
    assert full - whole == expert_bytes // 2  # experts 0-3 of every layer were never read
    for a, b in zip(half.layers, model.layers, strict=True):
        assert torch.equal(a.moe.w_gate_up, b.moe.w_gate_up[4:8])
        assert torch.equal(a.moe.w_down, b.moe.w_down[4:8])


def test_an_export_needs_the_release_it_came_from(model) -> None:
    assert model.release_source == CHECKPOINT  # load_pretrained remembers it
    fresh = DeepseekV41Model(model.cfg)
    with pytest.raises(CheckpointFormatError, match="beside the release it came from"):
        primus_v4.save_pretrained(fresh, "unused", dtype="fp8")
    with pytest.raises(CheckpointFormatError, match="'bfloat16' or 'fp8'"):
        primus_v4.save_pretrained(model, "unused", dtype="float32")
