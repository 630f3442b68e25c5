"""run_scripts/slurm/sbatch_recipe.sh without a cluster: SLURM's environment simulated on this
machine. The node list expands without scontrol; DRY_RUN=1 prints the plan and each node's
command; a one-node recipe on two nodes is refused; and two simulated nodes x 1 gloo process
(two concurrent task invocations on localhost, c10d rendezvous) train the tiny model like one
node of 2, even when one worker is killed after a checkpoint: torchrun restarts the group, which
resumes the newest checkpoint and finishes with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from ports import free_port
from recipe_runner import REPO, SCRIPTS, recipe_env, run_recipe

SBATCH = SCRIPTS / "slurm" / "sbatch_recipe.sh"


def _bash(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"source {SCRIPTS / 'lib' / 'common.sh'}; {script}"],
        env={**os.environ, "PATH": "/usr/bin:/bin", **env},  # no scontrol: the shell fallback
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_node_lists_expand_without_scontrol() -> None:
    got = _bash("primus_expand_hostlist 'gpu[07-09,12]-ib,login1,n[1-2]'")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["gpu07-ib", "gpu08-ib", "gpu09-ib", "gpu12-ib", "login1", "n1",
                                  "n2"]  # fmt: skip
    bad = _bash("primus_expand_hostlist 'a[1-2]b[3-4]'")
    assert bad.returncode == 3
    assert "cannot expand" in bad.stderr and "scontrol" in bad.stderr


# The tiny model through the multi-node base recipe: DP2, 3 steps, a checkpoint after each.
TINY = {
    "PRIMUS_CONFIG": str(REPO / "primus_v4" / "configs" / "runs" / "tiny_cpu_thd.yaml"),
    "PRIMUS_MODEL_PRESET": "tiny", "PRIMUS_DTYPE": "float32", "PRIMUS_SEQ_LENGTH": "512",
    "PRIMUS_PP": "1", "PRIMUS_EP": "1", "GBS": "2", "TRAIN_STEPS": "3", "PRIMUS_LR": "5e-3",
    "PRIMUS_OPTIMIZER_OFFLOAD_FRACTION": "0", "PRIMUS_RECOMPUTE": "none", "FUSED_LINEAR_CE": "1",
    "PRIMUS_DATA_PATH": "synthetic:rows=200", "PRIMUS_DATA_LAYOUT": "thd",
    "PRIMUS_CKPT_INTERVAL": "1", "PRIMUS_MAX_RESTARTS": "1", "PRIMUS_COLLECTIVE_TIMEOUT_S": "120",
    "PRIMUS_PREFLIGHT": "0", "SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "DRY_RUN": "0",
}  # fmt: skip
BASE = "run_scripts/run_full_4k_multinode.sh"


def test_torchrun_flags_static_without_restarts_c10d_with_them() -> None:
    flags = 'primus_torchrun_args; echo "${PRIMUS_TORCHRUN_ARGS[*]}"'
    knobs = {"NNODES": "3", "NODE_RANK": "2", "GPUS_PER_NODE": "8", "MASTER_ADDR": "n0",
             "MASTER_PORT": "29710"}  # fmt: skip
    static = _bash(flags, **knobs)
    assert static.stdout.split() == ["--nnodes", "3", "--node_rank", "2", "--nproc_per_node", "8",
                                     "--master_addr", "n0", "--master_port", "29710"]  # fmt: skip
    elastic = _bash(flags, **knobs, PRIMUS_MAX_RESTARTS="2", PRIMUS_MIN_NODES="2")
    assert elastic.stdout.split() == [
        "--nnodes", "2:3", "--nproc_per_node", "8", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "n0:29710", "--rdzv_id", "primus-v4-29710", "--max_restarts", "2",
    ]  # fmt: skip
    for bad, message in (
        ({"PRIMUS_RDZV_BACKEND": "static"}, "needs PRIMUS_RDZV_BACKEND=c10d"),
        ({"PRIMUS_MIN_NODES": "4"}, "PRIMUS_MIN_NODES=4 is more than NNODES=3"),
    ):
        got = _bash(flags, **knobs, PRIMUS_MAX_RESTARTS="2", **bad)
        assert got.returncode == 3 and message in got.stderr, got.stderr


def _slurm(nodes: int, node_id: int, gpus: int, job: str = "4242") -> dict[str, str]:
    hosts = ["localhost", "127.0.0.1"][:nodes]  # two names of this machine: two "nodes"
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": ",".join(hosts),
            "SLURM_NODEID": str(node_id), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_GPUS_ON_NODE": str(gpus)}  # fmt: skip


def test_dry_run_prints_the_plan_and_every_nodes_command(tmp_path: Path) -> None:
    # MASTER_PORT unset: the port derived from the job id (a dry run binds none)
    env = {**TINY, **_slurm(2, 0, 2), "SLURM_JOB_NODELIST": "gpu[07-08]", "DRY_RUN": "1",
           "GBS": "4", "MASTER_PORT": ""}  # fmt: skip
    run = run_recipe(str(SBATCH), tmp_path, timeout=180, args=(BASE,), **env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == ("# job 4242: 2 nodes (gpu07 gpu08), rendezvous gpu07:24242, GPUs per "
                        f"node 2, restarts 1, recipe {BASE}")  # fmt: skip
    assert [line for line in lines if line.startswith("# node")] == ["# node 0", "# node 1"]
    plans = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(p["node_rank"], p["nnodes"], p["world_size"], p["master_addr"]) for p in plans] == [
        (0, 2, 4, "gpu07"),
        (1, 2, 4, "gpu07"),
    ]
    commands = [line for line in lines if "torch.distributed.run" in line]
    assert len(commands) == 2
    for command in commands:  # the same on every node: ranks come from the rendezvous
        assert (
            "--nnodes 2:2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint "
            "gpu07:24242 --rdzv_id slurm-4242 --max_restarts 1 -m primus_v4 train"
        ) in command
    assert "building the pack cache" not in run.stderr  # a dry run builds nothing


def test_a_one_node_recipe_on_two_nodes_is_refused(tmp_path: Path) -> None:
    run = run_recipe(str(SBATCH), tmp_path, args=("--task", "run_scripts/run_local.sh"),
                     **_slurm(2, 1, 2))  # fmt: skip
    assert run.returncode == 3
    assert run.stderr.strip().endswith(
        "run_local.sh: error: run_local.sh runs NNODES=1 but the job has 2 nodes; use a "
        "multi-node recipe or allocate 1"
    )


def _start(tmp_path: Path, name: str, nodes: int, procs: int) -> list[subprocess.Popen[bytes]]:
    """One task invocation per simulated node, as srun starts them, concurrently."""
    port, started = str(free_port()), []
    for node in range(nodes):
        slurm = _slurm(nodes, node, procs, job=str(100 + nodes))
        env = recipe_env(tmp_path, **TINY, **slurm, MASTER_PORT=port,
                         PRIMUS_OUTPUT_DIR=str(tmp_path / name),
                         PRIMUS_LOCAL_ROOT=str(tmp_path / f"{name}-local{node}"))  # fmt: skip
        started.append(subprocess.Popen(["bash", str(SBATCH), "--task", BASE], cwd=REPO, env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True))  # fmt: skip
    return started


def _finish(tasks: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [t.wait(timeout=max(1.0, deadline - time.monotonic())) for t in tasks]
    finally:
        for t in tasks:
            if t.poll() is None:
                os.killpg(t.pid, signal.SIGKILL)


def _workers(agent: int) -> list[int]:
    """The training processes torchrun's agent `agent` started (its own pid after the execs)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == agent and b"\0primus_v4\0train\0" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _complete(ck: Path) -> list[str]:
    return sorted(p.parent.name for p in ck.glob("step_*/COMPLETE"))


def _rows(out: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def test_two_simulated_nodes_match_one_node_and_survive_a_killed_worker(tmp_path: Path) -> None:
    assert _finish(_start(tmp_path, "one", nodes=1, procs=2), timeout=400) == [0]
    two = _start(tmp_path, "two", nodes=2, procs=1)
    ck, deadline = tmp_path / "two" / "checkpoints", time.monotonic() + 300
    while not _complete(ck) and time.monotonic() < deadline and two[1].poll() is None:
        time.sleep(0.05)
    newest = _complete(ck)
    victims = _workers(two[1].pid)
    assert newest == ["step_00000001"] and len(victims) == 1, (newest, victims)
    os.kill(victims[0], signal.SIGKILL)  # node 1's worker lost after the step-1 checkpoint
    assert _finish(two, timeout=400) == [0, 0]

    logs = "".join(p.read_text() for p in sorted((tmp_path / "two" / "logs").rglob("*.log")))
    restarts = set(re.findall(r"elastic restart (\d+) \(TORCHELASTIC_RESTART_COUNT\): resumed at "
                              r"step (\d+)", logs))  # fmt: skip
    assert restarts == {("1", "1")}, logs[-3000:]
    one, two_rows = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    print("one node x 2:", one, "\ntwo nodes x 1, worker killed after step 1:", two_rows)
    # Exact: the same 2 ranks, the same gloo reductions in the same order, and a resume that
    # restores every state bit for bit (tests/unit/training/test_preemption.py).
    assert two_rows == one and [r[0] for r in one] == [1, 2, 3]
