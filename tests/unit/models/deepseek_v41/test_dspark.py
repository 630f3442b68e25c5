"""The DSpark drafter (models/deepseek_v41/dspark.py) against DeepSeek's official V4.1 code
(tests/fixtures/dsv41_dspark_golden, float32): every golden anchor's draft logits and confidence,
each document alone; the same anchors with the documents packed in one row, in any order and
with padding after them, give the same numbers; the packing metadata is required and anchors are
checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from primus_v4.errors import ConfigError
from primus_v4.models.deepseek_v41.release.load import read_config

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "dsv41_dspark_golden"
DOCS = 3
# the official float32 code against our float32 port, per document: of the largest |draft logit|
# (|confidence|); its README measures correct float32 evaluations agreeing to 2e-5 absolute
TOL = 1e-5
FRAGILE_TOL = 0.5  # anchors whose routing / top-k flips under a 1e-6 weight change
PACKED_TOL = 1e-5  # the same math over other row counts (matrix products round differently)


@pytest.fixture
def golden(dspark_golden):
    return dspark_golden


@pytest.fixture
def model(dspark_model):
    return dspark_model


def _packed(lengths: list[int], pad: int = 0) -> PackedSeqParams:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if pad:
        cu = torch.cat([cu, cu[-1:] + pad])
    n = int(cu[-1])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=n, max_seqlen_kv=n)  # fmt: skip


def _alone(model, golden, doc: int, **kwargs):
    ids = golden[f"doc{doc}.input_ids"]
    with torch.no_grad():
        return model.draft(ids[None], torch.arange(len(ids))[None],
                           packed_seq_params=_packed([len(ids)]),
                           anchors=golden[f"doc{doc}.anchors"], **kwargs)  # fmt: skip


def _fed(golden, doc: int) -> torch.Tensor:
    """The golden Markov inputs: t_a, then the reference's own argmax chain."""
    return golden[f"doc{doc}.draft_output_ids"][:, :-1]


@pytest.mark.parametrize("doc", range(DOCS))
def test_drafts_equal_the_official_code(model, golden, doc: int) -> None:
    out = _alone(model, golden, doc, block_ids=_fed(golden, doc))
    ref, conf = golden[f"doc{doc}.draft_logits"], golden[f"doc{doc}.confidence"]
    fragile = golden[f"doc{doc}.draft_fragile"].bool()
    assert out.logits.shape == ref.shape and out.confidence.shape == conf.shape
    err = (out.logits - ref).abs().amax((1, 2)) / ref.abs().max()
    cerr = (out.confidence - conf).abs().amax(1) / conf.abs().max()
    print(f"doc{doc}: {len(fragile)} anchors, worst draft logit {err[~fragile].max():.2e}, "
          f"confidence {cerr[~fragile].max():.2e} of the document's largest")  # fmt: skip
    assert err[~fragile].max() <= TOL and cerr[~fragile].max() <= TOL
    assert not fragile.any() or err[fragile].max() <= FRAGILE_TOL


@pytest.mark.parametrize("order", [(2, 0, 1), (1, 2, 0)])
def test_packed_drafts_equal_each_document_alone(model, golden, order) -> None:
    ids = [golden[f"doc{d}.input_ids"] for d in order]
    lengths, pad = [len(x) for x in ids], 7
    row = torch.cat([*ids, torch.full((pad,), 2)])
    pos = torch.cat([torch.arange(n) for n in [*lengths, pad]])
    offsets = torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist()
    anchors = torch.cat(
        [golden[f"doc{d}.anchors"] + off for d, off in zip(order, offsets, strict=True)]
    )
    fed = torch.cat([_fed(golden, d) for d in order])
    padding = torch.zeros(len(row), dtype=torch.bool)
    padding[-pad:] = True
    with torch.no_grad():
        packed = model.draft(
            row[None], pos[None], packed_seq_params=_packed(lengths, pad), anchors=anchors,
            block_ids=fed, padding_mask=padding[None],
        )  # fmt: skip
    alone = [_alone(model, golden, d, block_ids=_fed(golden, d)) for d in order]
    logits = torch.cat([a.logits for a in alone])
    conf = torch.cat([a.confidence for a in alone])
    err = (packed.logits - logits).abs().max() / logits.abs().max()
    cerr = (packed.confidence - conf).abs().max() / conf.abs().max()
    print(f"packed {order}: {len(anchors)} anchors, {err:.1e} / {cerr:.1e} of the largest")
    assert err <= PACKED_TOL and cerr <= PACKED_TOL


def test_teacher_forcing_reads_the_data_tokens_and_stops_at_the_sample_end(model, golden):
    ids = golden["doc0.input_ids"]
    n, b = len(ids), model.cfg.dspark_block_size
    anchors = torch.tensor([2, 9, n - 2])  # the last block runs past the document's end
    forced = torch.stack([torch.cat([ids, torch.full((b,), -1)])[a : a + b] for a in anchors])
    forced[forced < 0] = model.cfg.dspark_noise_token_id
    with torch.no_grad():
        psp = _packed([n])
        got = model.draft(ids[None], packed_seq_params=psp, anchors=anchors)
        want = model.draft(ids[None], packed_seq_params=psp, anchors=anchors, block_ids=forced)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.confidence, want.confidence)


def test_the_packing_metadata_and_sound_anchors_are_required(model, golden) -> None:
    ids = golden["doc1.input_ids"][None]
    with pytest.raises(ValueError, match="packed_seq_params with cu_seqlens_q is required"):
        model.draft(ids, packed_seq_params=None, anchors=[5])
    psp = _packed([30, 40])
    for anchors, message in (([30], "anchor row 30 is its sample's first token"),
                             ([70], r"anchors must be rows of the pack in \[0, 70\)"),
                             ([], "no anchors given")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model.draft(ids, packed_seq_params=psp, anchors=anchors)


def test_the_drafter_is_built_only_when_asked_and_only_where_it_exists() -> None:
    from primus_v4.models.deepseek_v41.model import DeepseekV41Model

    cfg = read_config(GOLDEN / "checkpoint")
    assert (cfg.dspark_stages, cfg.dspark_block_size, cfg.dspark_target_layer_ids) == (
        3,
        5,
        [5, 6, 7],
    )
    with torch.device("meta"):
        plain = DeepseekV41Model(cfg)
        drafting = DeepseekV41Model(cfg, drafter=True)
    assert plain.dspark is None and not any(
        n.startswith("dspark") for n, _ in plain.named_parameters()
    )
    assert {n.split(".")[2] for n, _ in drafting.named_parameters() if n.startswith("dspark")} == {
        "0",
        "1",
        "2",
    }
    with pytest.raises(ConfigError, match="draft: this model was built without its DSpark drafter"):
        plain.draft(
            torch.zeros(1, 4, dtype=torch.long), packed_seq_params=_packed([4]), anchors=[2]
        )
    no_stages = read_config(
        Path(__file__).resolve().parents[3] / "fixtures" / "dsv41_golden" / "checkpoint"
    )
    with pytest.raises(ConfigError, match="no DSpark stages"), torch.device("meta"):
        DeepseekV41Model(no_stages, drafter=True)


def test_the_dspark_keys_round_trip_through_config_json() -> None:
    from primus_v4.models.deepseek_v41.release import config_json

    cfg = read_config(GOLDEN / "checkpoint")
    text = config_json.config_to_release(cfg)
    assert text["num_nextn_predict_layers"] == 3 and text["dspark_target_layer_ids"] == [5, 6, 7]
    assert text["compress_ratios"] == [*cfg.compress_ratios, 0, 0, 0]  # the stages' tail
    back = config_json.fields_from_release(text, source="out")
    assert {k: v for k, v in back.items() if k.startswith("dspark")} == {
        f: getattr(cfg, f) for f in config_json.DSPARK.values()
    }


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """The backbone's plain greedy continuation (one full forward per token)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor(tokens)
            tokens.append(
                int(model(ids[None], packed_seq_params=_packed([len(ids)])).logits[0, -1].argmax())
            )
    return tokens[len(prompt) :]


def test_speculative_decoding_is_the_backbones_greedy_text(model, golden, monkeypatch) -> None:
    prompt = golden["doc1.input_ids"][:20].tolist()
    b = model.cfg.dspark_block_size
    spec = model.speculative_decode(torch.tensor(prompt), max_new_tokens=12)
    want = _greedy(model, prompt, 12)
    assert spec.tokens == want  # lossless whatever the drafter proposes
    assert spec.accepted and all(0 <= n <= b for n in spec.accepted)
    assert len(spec.accepted) + sum(spec.accepted) >= 12
    print(f"released drafter: accepted {spec.accepted}, mean {spec.mean_accepted:.2f}")
    # a drafter that proposes the backbone's own continuation: every block is accepted whole
    oracle = _greedy(model, prompt, 12 + 2 * b)

    rounds = iter(range(100))

    def perfect(h, first, head_weight):  # round r starts after r whole blocks and their bonus
        r = next(rounds)
        return oracle[r * (b + 1) : r * (b + 1) + b]

    monkeypatch.setattr(model.dspark, "greedy_chain", perfect)
    ideal = model.speculative_decode(torch.tensor(prompt), max_new_tokens=12)
    assert ideal.tokens == want and ideal.accepted == [b, b]
    assert ideal.mean_accepted == b and ideal.draft_share == pytest.approx(2 * b / 12)
