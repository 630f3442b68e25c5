"""How well a DeepSeek-V4.1 release's DSpark drafter speculates: greedy speculative decoding of
held-out prompts (`DeepseekV41Model.speculative_decode`: the backbone generates greedily, each
block drafted and accepted up to the first mismatch), reported as the mean accepted draft tokens
per block and the drafter's share of the generated tokens: the decode speed-up a server gets
from it at temperature 0. `primus-v4 inspect draft` and benchmarks/bench_drafter.py call it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from primus_v4.errors import CheckpointFormatError
from primus_v4.models.deepseek_v41.model import DeepseekV41Model, SpecResult


@dataclass(kw_only=True)
class SpeculationReport:
    """Greedy speculative decoding of `prompts` prompts, `max_new_tokens` each."""

    prompts: int
    max_new_tokens: int
    block_size: int
    per_prompt: list[SpecResult] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return sum(len(r.accepted) for r in self.per_prompt)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per block, over every block of every prompt."""
        return sum(sum(r.accepted) for r in self.per_prompt) / max(self.blocks, 1)

    @property
    def draft_share(self) -> float:
        """The share of all generated tokens the drafter proposed and the backbone kept."""
        drafted = sum(min(sum(r.accepted), len(r.tokens)) for r in self.per_prompt)
        return drafted / max(sum(len(r.tokens) for r in self.per_prompt), 1)

    def as_dict(self) -> dict[str, float | int]:
        return {"prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
                "block_size": self.block_size, "blocks": self.blocks,
                "mean_accepted": self.mean_accepted, "draft_share": self.draft_share,
                "tokens_per_block": 1 + self.mean_accepted}  # fmt: skip


def speculate_model(
    model: DeepseekV41Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    progress: bool = False,
) -> SpeculationReport:
    """Greedy speculative decoding of each prompt with `model` (built with its drafter)."""
    from tqdm import tqdm

    report = SpeculationReport(prompts=len(prompts), max_new_tokens=max_new_tokens,
                               block_size=model.cfg.dspark_block_size)  # fmt: skip
    was_training = model.training
    model.eval()
    try:
        for prompt in tqdm(prompts, desc="speculative decoding", unit="prompt",
                           disable=not progress):  # fmt: skip
            report.per_prompt.append(model.speculative_decode(torch.tensor(prompt),
                                                              max_new_tokens))  # fmt: skip
    finally:
        model.train(was_training)
    return report


def speculate(
    directory: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    progress: bool = False,
) -> SpeculationReport:
    """`speculate_model` on the release at `directory` (its drafter loaded, float32, CPU)."""
    from primus_v4.models.deepseek_v41.release.load import load_pretrained, read_config

    if not read_config(directory).dspark_stages:
        raise CheckpointFormatError(
            f"{directory}: this DeepSeek-V4.1 release has no DSpark draft stages "
            "(config.json num_nextn_predict_layers 0): nothing speculates"
        )
    model = load_pretrained(Path(directory), dtype=torch.float32, progress=progress,
                            drafter=True)  # fmt: skip
    return speculate_model(model, prompts, max_new_tokens=max_new_tokens, progress=progress)
