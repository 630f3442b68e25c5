"""Token corpora of simple rules for the benchmarks that need learnable data on tiny models
(bench_drafter.py, bench_quant_aware.py): samples follow `next = (mult * t + add) mod 509` with
10% random tokens; the first quarter of each sample is the prompt, the rest the response."""

from __future__ import annotations

import numpy as np

from primus_v4.data.packed_corpus import SampleCorpus

SEQ = 256
MOD = 509
RULES = {"A": (5, 11), "B": (7, 3)}


class RuleCorpus(SampleCorpus):
    """Packs of samples of rule A or B (the module docstring), as the trainer reads a corpus."""

    def __init__(self, rule: str, *, packs: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        mult, add = RULES[rule]
        self.seq_length = SEQ
        self.samples: list[tuple[np.ndarray, np.ndarray]] = []
        self.offsets = [0]
        for _ in range(packs):
            left = SEQ
            while left >= 40:
                n = int(rng.integers(40, min(120, left) + 1))
                tokens = np.empty(n, dtype=np.int64)
                tokens[0] = rng.integers(1, MOD)
                for i in range(1, n):
                    rule_next = (mult * tokens[i - 1] + add) % MOD
                    tokens[i] = rng.integers(1, MOD) if rng.random() < 0.1 else rule_next
                targets = np.zeros(n, dtype=bool)
                targets[n // 4 :] = True
                self.samples.append((tokens, targets))
                left -= n
            self.offsets.append(len(self.samples))
        self.stats = {"packs": packs, "samples": len(self.samples)}

    def prompts(self, count: int) -> list[list[int]]:
        return [t[: len(t) // 4].tolist() for t, _ in self.samples[:count]]
