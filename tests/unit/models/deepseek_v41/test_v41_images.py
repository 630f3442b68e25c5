"""DeepSeek-V4.1's language model on rows with images, against DeepSeek's official code in
float32 (tests/fixtures/dsv41_vision_golden): per document with image spans (an image at
position 0, two spans in one document, an image at the end) and one without, alone from
position 0, the Engram rows exactly, every layer's chosen experts and the logits on the
non-fragile tokens; and the same documents packed into one row equal each alone. The two
diagnostic variants of the golden set (no bias_vl; no token types) each differ, so both image
rules are in force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dsv41_model import pack
from safetensors.torch import load_file

from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.vision import load_image_encoder

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures/dsv41_vision_golden"
ATOL = 1e-3  # the golden set's advice for logits of non-fragile tokens (float32 port)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    golden = load_file(GOLDEN / "golden.safetensors")
    model = load_pretrained(GOLDEN / "checkpoint", dtype=torch.float32, progress=False,
                            token_map=golden["token_map"]).eval()  # fmt: skip
    model.set_image_encoder(load_image_encoder(GOLDEN / "checkpoint"))
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    docs = []
    for doc in manifest["docs"]:
        key = f"doc{doc['doc']}"
        images = [(golden[f"{key}.img{k}.patches"], tuple(im["vit_grid_hw"]))
                  for k, im in enumerate(doc["images"])]  # fmt: skip
        docs.append({"key": key, "ids": golden[f"{key}.input_ids"],
                     "types": golden[f"{key}.token_types"], "images": images})  # fmt: skip
    docs.append({"key": "text", "ids": golden["text.input_ids"],
                 "types": golden["text.token_types"], "images": []})  # fmt: skip
    return model, golden, docs


def _forward(model, docs: list[dict], experts: list | None = None) -> torch.Tensor:
    ids, pos, psp = pack([d["ids"] for d in docs])
    types = torch.cat([d["types"] for d in docs])[None]
    images = [im for d in docs for im in d["images"]]
    hooks = [block.moe.router.register_forward_hook(lambda m, i, out: experts.append(out[0]))
             for block in model.layers] if experts is not None else []  # fmt: skip
    try:
        with torch.no_grad():
            out = model(ids, pos, packed_seq_params=psp, token_types=types, images=images)
    finally:
        for hook in hooks:
            hook.remove()
    return out.logits[0]


def test_each_document_alone_equals_the_official_code(setup) -> None:
    model, golden, docs = setup
    worst = 0.0
    for doc in docs:
        key = doc["key"]
        experts: list[torch.Tensor] = []
        logits = _forward(model, [doc], experts)
        keep = ~golden[f"{key}.fragile"].bool()
        diff = (logits - golden[f"{key}.logits"]).abs()[keep].max()
        worst = max(worst, float(diff))
        chosen = torch.stack(experts).sort(-1).values  # [layers, T, K]
        want = golden[f"{key}.routed_experts"].sort(-1).values
        assert torch.equal(chosen[:, keep], want[:, keep]), key  # bias_vl picks them
        if key != "text":  # the diagnostic variants: each rule moves the logits
            for variant in ("no_bias_vl", "no_token_types"):
                far = (golden[f"{key}.logits_{variant}"] - golden[f"{key}.logits"]).abs().max()
                assert far > 100 * ATOL, (key, variant, float(far))
    print(f"logits vs the official code, non-fragile tokens: max |difference| {worst:.2e}")
    assert worst <= ATOL, worst


def test_engram_rows_of_image_spans_are_dead(setup) -> None:
    """Image positions hash pad in every slot; later text looks back only to the span's end."""
    from primus_v4.models.deepseek_v4.layout import RowLayout

    model, golden, docs = setup
    for doc in docs:
        layout = RowLayout.unpacked(doc["ids"].shape[0])
        rows = model.engram_row_ids(doc["ids"], layout, doc["types"] >= 0)
        assert torch.equal(rows, golden[f"{doc['key']}.engram_row_ids"]), doc["key"]
    plain = model.engram_row_ids(docs[0]["ids"], RowLayout.unpacked(docs[0]["ids"].shape[0]))
    assert not torch.equal(plain, golden["doc0.engram_row_ids"])  # the rule is in force


def test_packed_documents_equal_each_alone(setup) -> None:
    model, _, docs = setup
    alone = torch.cat([_forward(model, [d]) for d in docs])
    packed = _forward(model, docs)
    assert float((packed - alone).abs().max() / alone.abs().max()) <= 1e-5


def test_a_supervised_image_target_is_an_error(setup) -> None:
    """Training on a row with images: the loss counts text targets only; a loss_mask that
    supervises a position whose next token is in an image span is refused, not dropped."""
    model, _, docs = setup
    doc = docs[0]  # an 8-position span at 0 (rows 0-6 predict inside it), then text
    ids, pos, psp = pack([doc["ids"]])
    types = doc["types"][None]
    images = doc["images"]
    labels = torch.roll(ids, -1, 1)
    text_target = torch.roll(types < 0, -1, 1)
    text_target[0, -1] = False
    with torch.no_grad():
        out = model(ids, pos, packed_seq_params=psp, token_types=types, images=images,
                    labels=labels, loss_mask=text_target.float())  # fmt: skip
        assert torch.isfinite(out.loss_sum)
        everything = torch.ones_like(ids, dtype=torch.float32)
        with pytest.raises(ValueError, match=r"supervises 7 position\(s\) whose target is"):
            model(ids, pos, packed_seq_params=psp, token_types=types, images=images,
                  labels=labels, loss_mask=everything)  # fmt: skip


def test_bias_vl_is_the_release_s_and_zero_without_one(setup) -> None:
    """Every routed layer's bias_vl is the release's `ffn.gate.bias_vl`; a model materialized
    from meta without a release holds zeros there, never uninitialized memory."""
    from primus_v4.models.deepseek_v4.weight_init import init_buffers
    from primus_v4.models.deepseek_v41.model import DeepseekV41Model

    model, _, _ = setup
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted((GOLDEN / "checkpoint").glob("*.safetensors")):
        stored |= load_file(shard)
    routed = [b for b in model.layers if not b.moe.router.hashed]
    assert routed
    for block in routed:
        want = stored[f"layers.{block.layer_idx}.ffn.gate.bias_vl"].float()
        assert torch.equal(block.moe.router.bias_vl, want)
    with torch.device("meta"):
        empty = DeepseekV41Model(model.cfg)
    empty.to_empty(device="cpu")
    init_buffers(empty)
    assert all(not b.moe.router.bias_vl.any() for b in empty.layers if not b.moe.router.hashed)
