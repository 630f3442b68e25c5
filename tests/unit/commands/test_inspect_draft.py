"""`primus-v4 inspect draft`: greedy speculative decoding of held-out prompts with a release's
DSpark drafter, or a training run's (exported as released first), reported as the mean accepted
draft tokens per block and the draft share; the numbers are the model's own
`speculative_decode`; a family without a drafter and bad prompt files are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pretrained_runs import write_pretrained
from safetensors.torch import load_file
from train_fakes import RAGGED_PACKS, SEQ, FakeCorpus

from primus_v4.cli import main
from primus_v4.config import load_config, resolve_run
from primus_v4.models.deepseek_v41.release.load import load_pretrained
from primus_v4.models.deepseek_v41.speculate import speculate_model
from primus_v4.training.trainer import Trainer

GOLDEN = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "dsv41_dspark_golden"
RELEASE = GOLDEN / "checkpoint"
NEW = 6


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    docs = load_file(GOLDEN / "golden.safetensors")
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps(docs[f"doc{i}.input_ids"][: 10 + 5 * i].tolist()) for i in range(3)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _inspect(capsys, model: Path, prompts: Path, *extra: str) -> dict:
    code = main(["inspect", "draft", "--model", str(model), "--prompt-ids", str(prompts),
                 "--max-new-tokens", str(NEW), "--json", *extra])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _direct(release: Path, prompts: Path) -> dict:
    model = load_pretrained(release, drafter=True, progress=False)
    ids = [json.loads(line) for line in prompts.read_text().splitlines()]
    return speculate_model(model, ids, max_new_tokens=NEW).as_dict()


def test_a_release_is_measured_by_its_own_speculative_decoding(capsys, prompt_file) -> None:
    got = _inspect(capsys, RELEASE, prompt_file)
    want = _direct(RELEASE, prompt_file)
    assert {k: got[k] for k in want} == want
    assert got["prompts"] == 3 and got["block_size"] == 5 and got["blocks"] >= 3
    assert got["tokens_per_block"] == 1 + got["mean_accepted"]
    two = _inspect(capsys, RELEASE, prompt_file, "--num-prompts", "2")
    assert two["prompts"] == 2


def test_a_training_run_is_exported_as_released_then_measured(
    capsys, prompt_file, tmp_path: Path
) -> None:
    items = [
        "model.preset=null", f"model.pretrained={RELEASE}", f"data.seq_length={SEQ}",
        f"output.dir={tmp_path / 'run'}", "output.progress_bar=false", "train.shuffle=false",
        "train.steps=1", "train.global_batch_size=1", "train.warmup_steps=0", "train.lr=0.05",
        "model.draft.train=only", "model.draft.anchor_rate=0.5",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=1",
    ]  # fmt: skip
    Trainer(resolve_run(load_config(overrides=items), world=1),
            corpus=FakeCorpus(RAGGED_PACKS)).train()  # fmt: skip
    got = _inspect(capsys, tmp_path / "ckpt", prompt_file)
    assert main(["export", "--run", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                 "--dtype", "fp8"]) == 0  # fmt: skip
    capsys.readouterr()
    source = {"model": str(tmp_path / "ckpt"), "prompts_from": f"--prompt-ids {prompt_file}"}
    assert got == {**_direct(tmp_path / "out", prompt_file), **source}


def test_a_release_without_a_drafter_is_refused(capsys, prompt_file, tmp_path: Path) -> None:
    v4 = write_pretrained(tmp_path / "v4")
    code = main(["inspect", "draft", "--model", str(v4), "--prompt-ids", str(prompt_file)])
    err = capsys.readouterr().err
    assert code == 3 and "DeepSeek-V4 releases carry no drafter this measures" in err, err


def test_a_bad_prompt_line_is_refused_naming_it(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 3]\n[7]\n")
    code = main(["inspect", "draft", "--model", str(RELEASE), "--prompt-ids", str(bad)])
    err = capsys.readouterr().err
    assert code == 4 and f"{bad} line 2: expected a JSON list of at least 2 token ids" in err, err


def test_prompts_of_a_corpus_end_before_the_first_response_token() -> None:
    from primus_v4.commands.inspect import _prompts

    corpus = FakeCorpus(RAGGED_PACKS)  # each sample's response: its last two thirds
    want = [tokens[: len(tokens) // 3].tolist() for tokens, _ in corpus.samples[:4]]
    assert _prompts(corpus, 4) == want
