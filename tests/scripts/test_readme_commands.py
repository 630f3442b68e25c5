"""The READMEs' commands run as written. The Flash quick starts resolve under DRY_RUN=1 to a run
with a checkpoint dir, and their `export --run` is the run dir that recipe writes; the
fresh-machine command trains the documented default; every `primus-v4 pack` example of README.md's
CLI section runs on the in-repo demo corpora; every `train` example of both READMEs validates
(--dry-run) and writes an output dir of its own; every recipe launch resolves; and every command
of every bash block is run here or named with the reason it is not."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from recipe_runner import REPO, run_recipe, sparse_release

from primus_v4.cli import build_parser, main

FLASH_BLOCKS = [
    ("README.md", "Start from DeepSeek-V4-Flash"),
    ("README_thd_packed.md", "From DeepSeek-V4-Flash to a served fine-tune"),
]


def _section(readme: str, heading: str) -> str:
    """The text under the first heading (any level) that starts with `heading`, up to the next
    heading of the same or a higher level (`#` lines inside code blocks are not headings)."""
    lines = (REPO / readme).read_text(encoding="utf-8").splitlines()
    level, body, fenced = 0, [], False
    for line in lines:
        fenced ^= line.startswith("```")
        heading_level = len(line) - len(line.lstrip("#")) if not fenced else 0
        is_heading = heading_level and line[heading_level:].startswith(" ")
        if level and is_heading and heading_level <= level:
            break
        if level:
            body.append(line)
        elif is_heading and line[heading_level + 1 :].startswith(heading):
            level = heading_level
    assert level, f"{readme}: no section {heading!r}"
    return "\n".join(body) + "\n"


def _commands(readme: str, heading: str) -> list[list[str]]:
    """The words of each shell command in the section's ```bash blocks (continuation lines
    joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", _section(readme, heading), flags=re.DOTALL)
    assert blocks, f"{readme}, {heading!r}: no bash block"
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def _flash_release(tmp_path: Path) -> Path:
    """A stand-in for the released checkpoint: validation reads its config.json and the shard
    headers (over sparse data)."""
    from primus_v4.models.deepseek_v4 import DeepseekV4Config

    flash = tmp_path / "DeepSeek-V4-Flash"
    sparse_release(flash, DeepseekV4Config.preset("deepseek_v4_flash"))
    return flash


@pytest.mark.parametrize(("readme", "heading"), FLASH_BLOCKS, ids=[r for r, _ in FLASH_BLOCKS])
def test_flash_quick_start_exports_the_checkpoint_its_recipe_writes(
    readme: str, heading: str, tmp_path: Path
) -> None:
    commands = _commands(readme, heading)
    [launch] = [c for c in commands if "bash" in c]
    at = launch.index("bash")
    env = dict(word.split("=", 1) for word in launch[:at])
    script = Path(launch[at + 1])
    assert script.parent == Path("run_scripts") and (REPO / script).is_file()
    assert {"PRIMUS_PRETRAINED", "MASTER_ADDR", "NODE_RANK"} <= set(env)
    env["PRIMUS_PRETRAINED"] = str(_flash_release(tmp_path))
    # PRIMUS_OUTPUT_DIR empty: the recipe's own default run dir, as the README runs it.
    r = run_recipe(script.name, tmp_path, **env, PRIMUS_OUTPUT_DIR="").resolved
    assert r["pretrained"] == env["PRIMUS_PRETRAINED"] and r["model_preset"] is None
    assert r["nnodes"] * r["gpus_per_node"] == 24 and r["packed"] is True
    run_dir = Path(r["output_dir"])
    assert r["checkpoint_dir"] is not None, "the export below needs a checkpoint"
    assert Path(r["checkpoint_dir"]).is_relative_to(run_dir)
    exports = [c for c in commands if c[:2] == ["primus-v4", "export"]]
    assert exports
    for export in exports:
        args = build_parser().parse_args(export[1:])
        # The README's commands run from the repository root.
        assert REPO / args.run == run_dir, f"{readme}: export --run {args.run}, run dir {run_dir}"


def test_fresh_machine_command_trains_the_documented_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    [command] = _commands("README.md", "Fresh machine")[:1]
    steps = " ".join(command).split(" && ")
    assert steps[-1] == "primus-v4 train"
    assert "pip install torch==2.13.0" in steps and "pip install ." in steps
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run"]) == 0
    cfg = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # What the README says this command does: the tiny model, 30 steps, the embedded synthetic
    # corpus packed into 4096-token rows, written to outputs/tiny_cpu_thd/.
    assert cfg["model"]["preset"] == "tiny" and cfg["train"]["steps"] == 30
    assert cfg["data"]["path"] == "synthetic" and cfg["data"]["layout"] == "thd"
    assert cfg["data"]["seq_length"] == 4096 and cfg["output"]["dir"] == "outputs/tiny_cpu_thd"


def _cli_examples(subcommand: str) -> list[list[str]]:
    commands = _commands("README.md", "Using the CLI")
    found = [c[1:] for c in commands if c[:2] == ["primus-v4", subcommand]]
    assert found, f"README.md, Using the CLI: no primus-v4 {subcommand} example"
    return found


def test_cli_pack_examples_pack_the_demo_corpora(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    for argv in _cli_examples("pack"):
        paths = [argv[i + 1].split("::")[0] for i, w in enumerate(argv) if w == "--data"]
        assert all(p.startswith("examples/data/") and (REPO / p).is_file() for p in paths), paths
        stats = tmp_path / "stats.json"
        extra = ["--cache-dir", str(tmp_path / "c"), "--lock-dir", str(tmp_path / "l")]
        assert main([*argv, *extra, "--no-progress", "--stats-json", str(stats)]) == 0, argv
        capsys.readouterr()
        got = json.loads(stats.read_text())
        assert got["bad_rows"] == {} and got["dropped"] == 0 and got["num_packs"] > 0, argv


def test_benchmarks_default_to_the_demo_corpus() -> None:
    # `python benchmarks/bench_layouts.py` (README.md, Using the CLI) reads no data outside REPO.
    for name, attr in (("bench_layouts", "DEFAULT_DATA"), ("bench_packing", "DEMO")):
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        data = Path(getattr(module, attr))
        assert data.is_file() and data.is_relative_to(REPO), f"{name}.{attr} = {data}"


def test_lora_section_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README.md, LoRA: the CPU command resolves with adapters; each recipe line resolves (as
    DRY_RUN=1, on a stand-in release) to one node of 8 GPUs training rank-16 adapters."""
    commands = _commands("README.md", "LoRA")
    [train] = [c for c in commands if c[:2] == ["primus-v4", "train"]]
    assert main([*train[1:], "--dry-run"]) == 0
    cfg = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cfg["model"]["lora"]["rank"] == 16 and cfg["model"]["lora"]["alpha"] == 32
    assert cfg["model"]["lora"]["base"] == "release"
    launches = [c for c in commands if "bash" in c]
    assert len(launches) == 2
    release = _flash_release(tmp_path)
    run_dirs = []
    for launch in launches:
        at = launch.index("bash")
        env = dict(word.split("=", 1) for word in launch[:at])
        env["PRIMUS_PRETRAINED"] = str(release)
        r = run_recipe(Path(launch[at + 1]).name, tmp_path, **env, PRIMUS_OUTPUT_DIR="").resolved
        assert (r["nnodes"], r["world_size"], r["ep"]) == (1, 8, 8)
        assert r["lora"]["rank"] == 16 and r["pretrained"] == str(release)
        assert r["seq_length"] == int(env.get("PRIMUS_SEQ_LENGTH", 4096))
        run_dirs.append(Path(r["output_dir"]))
    exports = [
        build_parser().parse_args(c[1:]) for c in commands if c[:2] == ["primus-v4", "export"]
    ]
    assert sorted(e.format for e in exports) == ["peft", "release"]
    assert all(REPO / e.run == run_dirs[0] for e in exports)  # the 4k run


DRAFTER = ("README.md", "The V4.1 drafter")


def _accepted(out: str) -> float:
    """The mean accepted draft tokens per block `inspect draft` printed."""
    [value] = re.findall(r"mean accepted draft tokens per block\s+([0-9.]+)", out)
    return float(value)


def test_drafter_refresh_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README.md, the V4.1 drafter: its commands run for real, in order, from a copy of the
    repository's examples: the tiny V4.1 trains with its drafter (joint), its drafter is measured
    on the run's held-out conversations, the run exports as a release, the drafter alone trains
    from that export (the backbone frozen) and is measured on the same held-out
    conversations."""
    import shutil

    commands = _commands(*DRAFTER)
    kinds = [" ".join(c[:3]) if c[1] == "inspect" else " ".join(c[:2]) for c in commands]
    assert kinds == ["primus-v4 train", "primus-v4 inspect draft", "primus-v4 export",
                     "primus-v4 train", "primus-v4 inspect draft"], kinds  # fmt: skip
    work = tmp_path / "repo"
    shutil.copytree(REPO / "examples", work / "examples")
    monkeypatch.chdir(work)
    monkeypatch.setenv("PRIMUS_PACK_CACHE_DIR", str(tmp_path / "packs"))
    monkeypatch.setenv("PRIMUS_PACK_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("PRIMUS_OUTPUT_DIR", raising=False)
    accepted = []
    for words in commands:
        capsys.readouterr()
        code = main(words[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"`{shlex.join(words)}`: {err[-2000:]}"
        if words[1] == "inspect":
            assert "6 prompts (the run's held-out rows of examples/data/chat_demo.jsonl)" in out
            accepted.append(_accepted(out))
    export = work / "outputs" / "v41_draft_export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["text_config"]["dspark_block_size"]
    refresh = work / "outputs" / "v41_draft_refresh"
    rows = [json.loads(line) for line in (refresh / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["draft_loss"] is not None for r in rows)
    assert all(0.0 <= a <= 5.0 for a in accepted), accepted
    print(f"accepted draft tokens per block of 5: joint run {accepted[0]:.3f}, "
          f"refreshed {accepted[1]:.3f}")  # fmt: skip


# Every command of every ```bash block in both READMEs is run by a test of this file (train as
# --dry-run, a recipe as DRY_RUN=1, pack on the demo corpora, export against the run dir its
# recipe writes), or is one of these, which need what a test machine does not have.
READMES = ("README.md", "README_thd_packed.md")
NOT_RUN = {
    "pip install": "installs packages (the fresh-machine test runs its `primus-v4 train`)",
    "bash tests/run.sh": "the test suite itself",
    "vllm serve": "an inference server (the export tests load the result in transformers)",
    "docker": "a container build (tests/scripts/test_script_lint.py lints the Dockerfile)",
    "primus-v4 inspect checkpoint": "reads the checkpoint the train command above it writes",
    "primus-v4 eval": "reads the run the train command above it writes "
    "(tests/unit/commands/test_eval_command.py evaluates such a run)",
    "sbatch": "submits to a SLURM cluster (tests/scripts/test_slurm_launch.py simulates one)",
    "srun": "starts a SLURM job step (tests/scripts/test_slurm_launch.py simulates its tasks)",
}


def _all_commands() -> list[tuple[str, list[str]]]:
    """(readme, words) of every command in every ```bash block, continuation lines joined."""
    found = []
    for readme in READMES:
        text = (REPO / readme).read_text(encoding="utf-8")
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    found.append((readme, words))
    return found


def _launch(words: list[str]) -> tuple[dict[str, str], str] | None:
    """A recipe launch (`VAR=value ... bash run_scripts/X.sh`): its environment and script."""
    if "bash" not in words or not words[words.index("bash") + 1 :][:1] or "srun" in words:
        return None  # srun: a SLURM job step (NOT_RUN)
    at = words.index("bash")
    script = words[at + 1]
    if not script.startswith("run_scripts/"):
        return None
    return dict(w.split("=", 1) for w in words[:at]), Path(script).name


def _not_run(words: list[str]) -> str | None:
    line = " ".join(words)
    return next((why for start, why in NOT_RUN.items() if start in line), None)


def test_every_readme_command_is_run_by_a_test() -> None:
    runs = {"primus-v4 train", "primus-v4 pack", "primus-v4 export", "python benchmarks/"}
    drafter = [("README.md", words) for words in _commands(*DRAFTER)]  # run for real above
    for readme, words in _all_commands():
        line = " ".join(words)
        covered = (_launch(words) or _not_run(words) or (readme, words) in drafter
                   or any(line.startswith(r) for r in runs))  # fmt: skip
        assert covered, f"{readme}: `{line}` is run by no test; run it in this file"


def _train_commands() -> list[tuple[str, list[str]]]:
    """Every `primus-v4 train` of both READMEs but the drafter path's (run for real above: its
    refresh trains from the export its earlier command writes)."""
    drafter = [("README.md", words) for words in _commands(*DRAFTER)]
    return [
        (readme, words[words.index("primus-v4") + 1 :])
        for readme, words in _all_commands()
        if "primus-v4" in words
        and words[words.index("primus-v4") + 1 :][:1] == ["train"]
        and (readme, words) not in drafter
    ]


def test_readme_train_examples_validate_and_write_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every `primus-v4 train` of both READMEs passes --dry-run as written (my_run.yaml: a copy
    of the shipped tiny config with its own output.dir, as the README suggests starting one;
    /mnt/nfs: a directory here), and no two
    write one output dir: run one after the other, none is refused for, or clobbers, another's
    metrics."""
    import shutil

    from primus_v4.config.loader import DEFAULT_CONFIG

    work = tmp_path / "repo"
    shutil.copytree(REPO / "examples", work / "examples")
    own = DEFAULT_CONFIG.read_text().replace(
        "${PRIMUS_OUTPUT_DIR:outputs/tiny_cpu_thd}", "outputs/my_run"
    )
    (work / "my_run.yaml").write_text(own)
    monkeypatch.chdir(work)
    monkeypatch.delenv("PRIMUS_OUTPUT_DIR", raising=False)
    written: dict[str, str] = {}
    for readme, argv in _train_commands():
        argv = [w.replace("/mnt/nfs", str(tmp_path / "nfs")) for w in argv]
        dry = argv if "--dry-run" in argv else [*argv, "--dry-run"]
        assert main(dry) == 0, f"{readme}: primus-v4 {shlex.join(argv)}: {capsys.readouterr().err}"
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["output"]["dir"]
        if "--dry-run" not in argv:
            assert out not in written, f"{readme}: `{shlex.join(argv)}` writes {out} as " + (
                f"`{written.get(out)}` does"
            )
            written[out] = shlex.join(argv)
    assert len(written) >= 7, written


def test_readme_recipe_launches_run_as_written(tmp_path: Path) -> None:
    """Each recipe launch of the READMEs resolves (DRY_RUN=1): the cluster recipes as they would
    start on node 0, run_local.sh as validated before its torchrun (tests/scripts/test_run_local.py
    trains it for real); the Flash and LoRA sections' launches run in the tests above. run_local.sh
    commands name output dirs of their own (no output dir given: the default, once)."""
    above = [*FLASH_BLOCKS, ("README.md", "LoRA")]
    done = [_launch(words) for r, h in above for words in _commands(r, h)]
    launches = [(r, _launch(w)) for r, w in _all_commands() if _launch(w) not in (None, *done)]
    assert len(launches) >= 5, launches
    local_dirs = []
    for k, (readme, (env, script)) in enumerate(launches):
        env = {**env, "DRY_RUN": "1"}
        assert "PRIMUS_PRETRAINED" not in env, "a release launch: run it beside the Flash ones"
        if script == "run_local.sh":
            local_dirs.append(env.get("PRIMUS_OUTPUT_DIR", "default"))
        env["PRIMUS_OUTPUT_DIR"] = str(tmp_path / f"out{k}")
        run = run_recipe(script, tmp_path, **env)
        assert run.returncode == 0, f"{readme}: {script} {env}: {run.stderr[-2000:]}"
        assert run.resolved["output_dir"] == env["PRIMUS_OUTPUT_DIR"]
    assert len(local_dirs) == len(set(local_dirs)) >= 2, local_dirs
