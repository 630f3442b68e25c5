"""THD invariants of every pack of the demo corpus, and supervision checked by decoding against the
source rows (what the model learns is exactly each row's response followed by EOS)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from primus_v4.data.packed_corpus import IGNORE_LABEL, PackedCorpus
from primus_v4.data.packing import segment_cap
from primus_v4.data.thd import IGNORE_LABEL as THD_IGNORE_LABEL
from primus_v4.data.thd import ThdBatch
from primus_v4.data.tokenizer import EOS_TEXT, TextTokenizer


def test_every_pack_satisfies_the_thd_contract(demo_corpus: PackedCorpus) -> None:
    s = demo_corpus.seq_length
    assert s == 512 and len(demo_corpus) > 100  # 1000 rows of ~134 tokens at 512 per pack
    for i in range(len(demo_corpus)):
        a = demo_corpus.pack_arrays(i)
        first, stop = demo_corpus.pack_sample_range(i)
        cu = a["cu_seqlens"]
        assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == s
        assert (np.diff(cu) > 0).all()
        assert len(cu) - 1 <= segment_cap(s)
        real = int((~a["padding_mask"]).sum())
        # Samples are the first stop-first segments; padding, if any, is exactly one more.
        assert len(cu) - 1 == (stop - first) + (real < s)
        assert cu[stop - first] == real
        assert not a["padding_mask"][:real].any() and a["padding_mask"][real:].all()
        # Positions restart at every segment start, including the padding segment.
        starts = np.repeat(cu[:-1], np.diff(cu))
        assert np.array_equal(a["position_ids"], np.arange(s) - starts)
        # Labels: the next token inside the segment, never across a boundary.
        ends = cu[1:] - 1
        inner = np.setdiff1d(np.arange(real), ends)
        assert np.array_equal(a["labels"][inner], a["input_ids"][inner + 1])
        assert (a["labels"][ends] == IGNORE_LABEL).all()
        assert (a["labels"][real:] == IGNORE_LABEL).all()
        assert (a["loss_mask"][ends] == 0).all()
        assert (a["loss_mask"][a["padding_mask"]] == 0).all()
        assert a["loss_mask"].sum() > 0


def test_each_sample_in_exactly_one_pack(demo_corpus: PackedCorpus, alpaca_demo: Path) -> None:
    ranges = [demo_corpus.pack_sample_range(i) for i in range(len(demo_corpus))]
    assert ranges[0][0] == 0 and ranges[-1][1] == demo_corpus.num_samples
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))
    rows = [demo_corpus.sample_row(j) for j in range(demo_corpus.num_samples)]
    source_rows = len(json.loads(alpaca_demo.read_text()))
    # One sample per Alpaca row: the demo has no bad rows and nothing is dropped.
    assert sorted(rows) == list(range(source_rows))
    assert demo_corpus.stats["truncated"] > 0  # some demo rows exceed 512 tokens


def test_loss_mask_covers_exactly_response_and_eos(
    demo_corpus: PackedCorpus, tokenizer: TextTokenizer, alpaca_demo: Path
) -> None:
    source = json.loads(alpaca_demo.read_text())
    truncated = 0
    for i in range(len(demo_corpus)):
        a = demo_corpus.pack_arrays(i)
        cu = a["cu_seqlens"]
        first, stop = demo_corpus.pack_sample_range(i)
        for k, j in enumerate(range(first, stop)):
            lo, hi = int(cu[k]), int(cu[k + 1])
            mask = a["loss_mask"][lo:hi].astype(bool)
            # loss_mask[t] supervises label t = token t+1, so the targets are the tokens after.
            targets = a["input_ids"][lo + 1 : hi][mask[:-1]]
            assert np.array_equal(targets, a["labels"][lo:hi][mask])
            response = source[demo_corpus.sample_row(j)]["output"]
            if hi - lo < demo_corpus.seq_length:
                assert tokenizer.decode(targets) == response + EOS_TEXT
            else:  # may be truncated: then the targets are a strict prefix of response + EOS
                full = np.append(tokenizer.encode_texts([response])[0], tokenizer.special.eos)
                assert np.array_equal(targets, full[: len(targets)]) and len(targets) > 0
                truncated += len(targets) < len(full)
    assert truncated == demo_corpus.stats["truncated"]


def test_thd_batch_and_unpacked_baseline_agree(demo_corpus: PackedCorpus) -> None:
    i = len(demo_corpus) // 2
    packed = demo_corpus.thd_batch(i)
    assert isinstance(packed, ThdBatch) and packed.seq_length == demo_corpus.seq_length
    assert IGNORE_LABEL == THD_IGNORE_LABEL  # loader keeps its own copy to stay torch-free
    a = demo_corpus.pack_arrays(i)
    assert packed.num_supervised == int(a["loss_mask"].sum())
    first, stop = demo_corpus.pack_sample_range(i)
    cu = a["cu_seqlens"]
    for k, j in enumerate(range(first, stop)):
        alone = demo_corpus.bshd_batch(j)
        n = int(cu[k + 1] - cu[k])
        assert alone.num_real == n
        lo, hi = int(cu[k]), int(cu[k + 1])
        for name in ("input_ids_S", "labels_S", "loss_mask_S", "position_ids_S"):
            assert np.array_equal(
                getattr(alone, name)[:n].numpy(), getattr(packed, name)[lo:hi].numpy()
            )
        expected_cu = [0, n] if n == demo_corpus.seq_length else [0, n, demo_corpus.seq_length]
        assert alone.cu_seqlens_N1.tolist() == expected_cu


def test_stats_match_the_packs(demo_corpus: PackedCorpus) -> None:
    stats = demo_corpus.stats
    packs = [demo_corpus.pack_arrays(i) for i in range(len(demo_corpus))]
    real = sum(int((~a["padding_mask"]).sum()) for a in packs)
    supervised = sum(int(a["loss_mask"].sum()) for a in packs)
    assert stats["num_packs"] == len(packs) and stats["num_samples"] == demo_corpus.num_samples
    assert stats["total_tokens"] == len(packs) * demo_corpus.seq_length
    assert stats["real_tokens"] == real and stats["supervised_tokens"] == supervised
    assert abs(stats["real_fraction"] - real / stats["total_tokens"]) < 1e-6
    assert stats["num_packs"] <= stats["lower_bound_packs"] + 1
    no_window = sum(1 for a in packs if np.diff(a["cu_seqlens"])[~_pad_segment(a)].max() < 128)
    assert stats["packs_without_128_window"] == no_window


def _pad_segment(a: dict[str, np.ndarray]) -> np.ndarray:
    is_pad = np.zeros(len(a["cu_seqlens"]) - 1, dtype=bool)
    is_pad[-1] = bool(a["padding_mask"][-1])
    return is_pad


def test_messages_corpus_through_the_pipeline(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    from primus_v4.data.pipeline import PackSpec, build_or_load

    rows = [
        {
            "messages": [
                {"role": "system", "content": f"System note {k}."},
                {"role": "user", "content": f"Question {k}?"},
                {"role": "assistant", "content": f"Answer {k}."},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": f"Yes, {k} more."},
            ]
        }
        for k in range(40)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = PackSpec(data=str(path), seq_length=256, cache_dir=tmp_path / "c", lock_dir=tmp_path)
    corpus = build_or_load(spec)
    assert corpus.stats["format"] == "messages" and corpus.num_samples == 40
    for i in range(len(corpus)):
        a = corpus.pack_arrays(i)
        cu = a["cu_seqlens"]
        first, stop = corpus.pack_sample_range(i)
        for k, j in enumerate(range(first, stop)):
            lo, hi = int(cu[k]), int(cu[k + 1])
            mask = a["loss_mask"][lo:hi].astype(bool)
            targets = a["input_ids"][lo + 1 : hi][mask[:-1]]
            n = corpus.sample_row(j)
            assert tokenizer.decode(targets) == f"Answer {n}.{EOS_TEXT}Yes, {n} more.{EOS_TEXT}"
