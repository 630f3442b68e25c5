"""`primus-v4 export` trusts a training checkpoint only as resume does: the one integrity check
(checkpoint_integrity.problems), a damaged newest checkpoint refused by name as a damaged named
step is (an older one only by --step), a run dir's checkpoints found from where the run dir is,
and the model config stored in the step itself, never a config.yaml beside it that a later (even
a refused) start may have rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_fakes import RAGGED_PACKS, FakeCorpus, tiny_run

from primus_v4.cli import main
from primus_v4.errors import ExitCode
from primus_v4.training.checkpoint.store import step_dir

SETTINGS = (
    "train.steps=2",
    "train.warmup_steps=1",
    "train.global_batch_size=1",
    "checkpoint.interval=1",
    "output.plot=false",
)


def _train(tmp: Path, *settings: str):
    """The real tiny model (vocab 512) for two steps on the fake corpus, a checkpoint per step."""
    from primus_v4.training.trainer import Trainer

    run = tiny_run(tmp, *SETTINGS, f"checkpoint.dir={tmp / 'ck'}", *settings)
    return Trainer(run, corpus=FakeCorpus(RAGGED_PACKS[:2])).train()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("export_verified")
    _train(tmp)
    return tmp


def _embedding(checkpoint: Path) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    ours = {"embedding.weight": torch.empty(meta["model.embedding.weight"].size)}
    dcp.load({"model": ours}, checkpoint_id=checkpoint, no_dist=True)
    return ours["embedding.weight"]


def _exported_embedding(out: Path) -> torch.Tensor:
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / index["embed.weight"]), "pt") as f:
        return f.get_tensor("embed.weight").float()


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_refused_by_name_and_an_older_one_exported_by_step(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(trained / "ck", ck)
    shard = next(step_dir(ck, 2).glob("*.distcp"))
    _flip(shard, shard.stat().st_size // 2)
    out = tmp_path / "out"
    assert (
        main(["export", "--run", str(ck), "--step", "1", "--out", str(out), "--no-progress"]) == 0
    )
    exported = json.loads(capsys.readouterr().out)
    assert exported["checkpoint"] == str(step_dir(ck, 1))
    want = _embedding(step_dir(trained / "ck", 1)).to(torch.bfloat16).float()
    assert torch.equal(_exported_embedding(out), want)
    newest = ["--run", str(ck)]
    for named in (newest, ["--run", str(step_dir(ck, 2))], ["--run", str(ck), "--step", "2"]):
        other = tmp_path / f"refused{len(named)}"
        assert main(["export", *named, "--out", str(other), "--no-progress"]) == ExitCode.CHECKPOINT
        err = capsys.readouterr().err
        assert f"cannot export {step_dir(ck, 2)}: {shard}: corrupt" in err
        assert len(err.strip().splitlines()) == 1 and not other.exists()


def test_export_reads_the_config_stored_in_the_step(trained: Path, tmp_path: Path) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(trained / "ck", ck)
    # A config beside the checkpoints that describes another model (what a refused start used
    # to leave there) must not be read: the step holds its own, checksummed.
    beside = (
        (step_dir(ck, 2) / "config.yaml")
        .read_text()
        .replace("overrides:\n", "overrides:\n    attn_sliding_window: 64\n")
    )
    (ck / "config.yaml").write_text(beside)
    out = tmp_path / "out"
    assert main(["export", "--run", str(step_dir(ck, 2)), "--out", str(out), "--no-progress"]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["sliding_window"] == 128 and written["routed_scaling_factor"] == 1.5


def test_a_refused_start_changes_nothing_export_reads(trained: Path, tmp_path: Path) -> None:
    import shutil

    from primus_v4.errors import ResumeError

    shutil.copytree(trained / "ck", tmp_path / "ck")
    before = {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    changed = ("model.overrides.attn_sliding_window=64",
               "model.overrides.moe_router_topk_scaling_factor=2.5")  # fmt: skip
    with pytest.raises(ResumeError, match="attn_sliding_window: None -> 64"):
        _train(tmp_path, *changed)
    after = {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert after == before and not (tmp_path / "run").exists()
    out = tmp_path / "out"
    assert main(["export", "--run", str(tmp_path / "ck"), "--out", str(out), "--no-progress"]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["sliding_window"] == 128 and written["routed_scaling_factor"] == 1.5


def test_export_run_finds_the_checkpoints_from_the_run_dir_not_from_here(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from primus_v4.export.run import ExportError, find_source

    # An older run, started in `work`, that recorded its dirs relative to there.
    run = tmp_path / "work" / "outputs" / "r"
    shutil.copytree(trained / "ck", run / "ck")
    (run / "config.yaml").write_text(
        "output:\n  dir: outputs/r\ncheckpoint:\n  dir: outputs/r/ck\n"
    )
    monkeypatch.chdir(tmp_path)  # export runs elsewhere
    assert find_source(run).checkpoint == step_dir(run / "ck", 2)
    # Its copy exports its own checkpoints: the copy's damaged newest is refused, not replaced
    # by the original's step 2 or by the copy's step 1.
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    _flip(next(step_dir(copy / "ck", 2).glob("*.distcp")), 100)
    with pytest.raises(ExportError, match=rf"cannot export {step_dir(copy / 'ck', 2)}: .*corrupt"):
        find_source(copy)
    assert find_source(copy, 1).checkpoint == step_dir(copy / "ck", 1)
    # A checkpoint.dir outside the run dir, recorded absolute, is that path.
    (copy / "config.yaml").write_text(
        f"output:\n  dir: /gone/r\ncheckpoint:\n  dir: {run / 'ck'}\n"
    )
    assert find_source(copy).checkpoint == step_dir(run / "ck", 2)
    (copy / "config.yaml").write_text("output:\n  dir: elsewhere\ncheckpoint:\n  dir: ck2\n")
    with pytest.raises(ExportError, match=r"checkpoint.dir ck2 is relative to where that run"):
        find_source(copy)
