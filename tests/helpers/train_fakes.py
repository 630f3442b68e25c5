"""Small in-memory corpus (random tokens, Alpaca-like prompt/response split) for trainer tests:
the same accessors as the packed cache, without tokenizer or disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from primus_v4.config import ResolvedRun, load_config, resolve_run
from primus_v4.data.mtp_shift import mtp_streams
from primus_v4.data.packed_corpus import SampleCorpus
from primus_v4.models.deepseek_v4.model import ModelOutput

TEST_VOCAB = 512  # the tiny model with a small vocab: same layers, ~20x faster LM head
SEQ = 256  # two HCA windows and two sliding windows per row


class FakeCorpus(SampleCorpus):
    """Packs given as lists of sample lengths; samples numbered in pack order."""

    def __init__(self, packs: list[list[int]], *, seq_length: int = SEQ, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.seq_length = seq_length
        self.samples: list[tuple[np.ndarray, np.ndarray]] = []
        self.offsets = [0]
        for lengths in packs:
            assert sum(lengths) <= seq_length
            for n in lengths:
                tokens = rng.integers(1, TEST_VOCAB, size=n)
                targets = np.zeros(n, dtype=bool)
                targets[n // 3 :] = True  # the response: the last two thirds of the sample
                self.samples.append((tokens, targets))
            self.offsets.append(len(self.samples))
        self.stats = {"packs": len(packs), "samples": len(self.samples)}


RAGGED_PACKS = [[100, 70, 60], [200, 40], [33, 150, 60], [90, 90, 60], [250], [120, 111]]


def tiny_run(tmp_path: Path, *overrides: str, world: int = 1) -> ResolvedRun:
    """The default config on the test vocab and sequence length, writing under tmp_path."""
    base = [
        f"data.seq_length={SEQ}",
        f"model.overrides.vocab_size={TEST_VOCAB}",
        f"output.dir={tmp_path / 'run'}",
        "output.progress_bar=false",
        "train.shuffle=false",
    ]
    return resolve_run(load_config(overrides=[*base, *overrides]), world=world)


class FakeLM(torch.nn.Module):
    """Embedding -> linear head with the DeepseekV4Model output contract (main + one MTP depth,
    a small aux term): exercises the trainer's mechanics in milliseconds."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(TEST_VOCAB, 16)
        self.head = torch.nn.Linear(16, TEST_VOCAB, bias=False)

    def _ce_sum(self, h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(self.head(h), labels.clamp(min=0), reduction="none")
        return torch.where(mask > 0, ce * mask, 0.0).sum()

    def forward(self, input_ids, position_ids, *, packed_seq_params, labels, loss_mask,
                padding_mask, comm=None, mtp_inputs=None) -> ModelOutput:  # fmt: skip
        h = self.embedding(input_ids[0])
        cu = (
            packed_seq_params.cu_seqlens_q
            if packed_seq_params is not None
            else torch.tensor([0, h.shape[0]], dtype=torch.int32)
        )
        mask = torch.where(padding_mask[0], 0.0, loss_mask[0].float())
        s = mtp_streams(input_ids_S=input_ids[0], cu_seqlens=cu, depth=1, labels_S=labels[0],
                        loss_mask_S=mask, padding_mask_S=padding_mask[0])  # fmt: skip
        out = ModelOutput(loss_sum=self._ce_sum(h, labels[0], mask), num_tokens=mask.sum())
        out.mtp_loss_sums = [self._ce_sum(h * 0.5, s.labels, s.loss_mask)]
        out.mtp_num_tokens = [s.loss_mask.sum()]
        out.aux_loss = 1e-2 * self.head.weight.square().sum()  # big enough to show in grads
        return out


def fake_trainer(tmp_path: Path, *overrides: str, packs: list[list[int]] | None = None):
    from primus_v4.training.trainer import Trainer

    run = tiny_run(tmp_path, *overrides)
    return Trainer(run, corpus=FakeCorpus(packs or RAGGED_PACKS[:4]), model=FakeLM())
