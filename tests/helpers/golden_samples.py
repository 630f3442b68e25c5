"""Golden conversation files (tests/fixtures/dsv4_format, dsv41_format) against the pipeline."""

from __future__ import annotations

from primus_v4.data.packed_corpus import PackedCorpus


def targets(length: int, spans: list[list[int]]) -> list[bool]:
    """Per-position target flags of `[start, end)` spans."""
    flags = [False] * length
    for start, stop in spans:
        flags[start:stop] = [True] * (stop - start)
    return flags


def golden_samples(golden: dict) -> list[tuple[list[int], list[bool]]]:
    """A golden file's samples as sorted (ids, target flags)."""
    return sorted(
        (s["input_ids"], targets(len(s["input_ids"]), s["supervised_spans"]))
        for s in golden["samples"]
    )


def packed_samples(corpus: PackedCorpus) -> list[tuple[list[int], list[bool]]]:
    """A packed corpus's samples as sorted (ids, target flags)."""
    return sorted(
        (ids.tolist(), flags.tolist())
        for ids, flags in map(corpus.sample_tokens, range(corpus.num_samples))
    )
