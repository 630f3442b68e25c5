"""The embedded corpus: deterministic Alpaca-like instruction/response rows, no download.

Lengths are drawn so that the rendered samples (template included) have a token-length
distribution like Alpaca's under the DeepSeek-V4 tokenizer: median ~100-130 tokens, a long tail
to ~600. Only `random.Random.random()` is used: Python guarantees its sequence for a seed across
versions, so every node of a job generates byte-identical rows (the cache key relies on it).
"""

from __future__ import annotations

import math
import random

# Part of the cache key: bump when the generated rows change for a given (rows, seed).
GENERATOR_VERSION = "v1"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "system model garden river city teacher student window market engine budget planet "
    "language history recipe kitchen doctor patient network server database report customer "
    "product village forest ocean mountain library museum painting bridge station train "
    "computer program function variable experiment theory energy climate weather season "
    "festival company manager meeting schedule project answer question problem solution "
    "story chapter author reader letter message email phone camera picture music song "
    "instrument team player game score strategy habit health exercise breakfast dinner "
    "friend family neighbor community policy government election economy price value "
    "software hardware battery signal device sensor robot algorithm dataset article summary"
)
_VERBS = _words(
    "explain describe improve build design measure compare create reduce increase protect "
    "support analyze organize prepare deliver observe consider develop choose follow share "
    "replace update review test change connect collect discover predict encourage manage "
    "require provide include represent suggest solve combine balance translate summarize"
)
_ADJECTIVES = _words(
    "simple complex useful important common modern ancient quiet bright careful efficient "
    "reliable small large local global private public digital natural social practical "
    "healthy creative quick slow clear strong gentle typical rare basic advanced several"
)
_FUNCTION = _words("the a an this that each every some many most our their its")
_LINKS = _words("and but because so while although when if since unless")
_ADVERBS = _words("often usually quickly carefully rarely clearly easily always sometimes")
_TASKS = (
    "Explain how {a} {n} can {v} a {n2}.",
    "Describe the main features of {a} {n}.",
    "Write a short story about a {n} and a {n2}.",
    "Give three tips to {v} your {n}.",
    "Summarize the following text.",
    "Classify the following {n} as {a} or {a2}.",
    "Rewrite the sentence below in a {a} tone.",
    "Generate a list of ideas to {v} the {n}.",
    "What is the difference between a {n} and a {n2}?",
    "Compose a brief email to a {n} about the {n2}.",
)


class _Words:
    """Sentence and paragraph maker over the word lists, driven by `random()` only."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def uniform(self) -> float:
        return self._rng.random()

    def pick(self, words: tuple[str, ...]) -> str:
        return words[int(self._rng.random() * len(words))]

    def lognormal(self, median: float, sigma: float) -> float:
        # Box-Muller from two random() draws (avoids gauss(), whose state handling is internal).
        u1 = max(self._rng.random(), 1e-12)
        u2 = self._rng.random()
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        return median * math.exp(sigma * z)

    def sentence(self) -> str:
        words = [self.pick(_FUNCTION), self.pick(_ADJECTIVES), self.pick(_NOUNS)]
        words += [self.pick(_ADVERBS), self.pick(_VERBS) + "s", self.pick(_FUNCTION)]
        words.append(self.pick(_NOUNS))
        if self.uniform() < 0.5:
            words += [self.pick(_LINKS), self.pick(_FUNCTION), self.pick(_NOUNS)]
            words += [self.pick(_VERBS) + "s", self.pick(_FUNCTION), self.pick(_NOUNS)]
        text = " ".join(words)
        return text[0].upper() + text[1:] + ("." if self.uniform() < 0.9 else "!")

    def text(self, words: int) -> str:
        sentences: list[str] = []
        count = 0
        while count < words:
            s = self.sentence()
            sentences.append(s)
            count += s.count(" ") + 1
            if self.uniform() < 0.15:
                sentences.append("\n\n")
        return " ".join(sentences).replace(" \n\n ", "\n\n").strip()

    def task(self) -> str:
        return self.pick(_TASKS).format(
            a=self.pick(_ADJECTIVES),
            a2=self.pick(_ADJECTIVES),
            n=self.pick(_NOUNS),
            n2=self.pick(_NOUNS),
            v=self.pick(_VERBS),
        )


def synthetic_rows(*, rows: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """`rows` Alpaca-format dicts (instruction, input, output), identical for equal (rows, seed)."""
    w = _Words(seed)
    out: list[dict[str, str]] = []
    for _ in range(rows):
        instruction = w.task()
        # ~40% of Alpaca rows carry an input; it is short context, 10-60 words.
        context = w.text(int(10 + 50 * w.uniform())) if w.uniform() < 0.4 else ""
        # Response words: log-normal, median ~64 words (~85 tokens), capped for a ~600-token tail.
        words = int(min(max(w.lognormal(64.0, 0.9), 1.0), 450.0))
        out.append({"instruction": instruction, "input": context, "output": w.text(words)})
    return out
