"""run_scripts/k8s/pytorchjob.yaml: the fields the Kubeflow training operator requires, the
node-local pack cache and the shared checkpoint volume, and the torchrun command each replica
renders through the entrypoint and the recipe base (DRY_RUN=1) from the operator's env."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from recipe_runner import SCRIPTS, run_recipe

MANIFEST = SCRIPTS / "k8s" / "pytorchjob.yaml"
ENTRYPOINT = "k8s/entrypoint.sh"
PORT_NAME = "pytorchjob-port"  # the operator's MASTER_PORT is this container port


def _documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _job() -> dict:
    return _documents()["PyTorchJob"]


def _container(replica: dict) -> dict:
    (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"]
    return container


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def _volume_at(replica: dict, path: str) -> dict:
    """The pod volume whose mount holds `path`."""
    container = _container(replica)
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in replica["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume


def test_entrypoint_is_strict_and_shellcheck_clean():
    script = SCRIPTS / ENTRYPOINT
    assert "set -euo pipefail" in script.read_text().splitlines()
    shellcheck = Path(sys.executable).parent / "shellcheck"
    proc = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True,
                          cwd=script.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stdout


def test_the_operator_finds_what_it_requires():
    job = _job()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    for replica in specs.values():
        assert replica["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
        container = _container(replica)
        assert container["image"]
        assert [p["containerPort"] for p in container["ports"] if p["name"] == PORT_NAME]
        assert container["command"] == ["bash", f"run_scripts/{ENTRYPOINT}"]
        env = _env(container)
        assert (SCRIPTS / env["PRIMUS_K8S_RECIPE"]).is_file()
        # One pod per node: NNODES pods in all, each holding GPUS_PER_NODE GPUs.
        assert int(env["NNODES"]) == sum(r["replicas"] for r in specs.values())
        assert container["resources"]["limits"]["amd.com/gpu"] == int(env["GPUS_PER_NODE"])


def test_pack_cache_is_node_local_and_checkpoints_are_shared():
    docs = _documents()
    for replica in _job()["spec"]["pytorchReplicaSpecs"].values():
        env = _env(_container(replica))
        local = _volume_at(replica, env["PRIMUS_LOCAL_ROOT"])
        assert "emptyDir" in local or "hostPath" in local
        shared = _volume_at(replica, env["PRIMUS_OUTPUT_DIR"])  # checkpoints: <dir>/checkpoints
        claim = shared["persistentVolumeClaim"]["claimName"]
        pvc = docs["PersistentVolumeClaim"]
        assert pvc["metadata"]["name"] == claim
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def _render(tmp_path: Path, operator_env: dict[str, str]):
    """The entrypoint's DRY_RUN in one pod: the manifest's env (mount paths moved under
    tmp_path) plus what the operator sets."""
    master = _job()["spec"]["pytorchReplicaSpecs"]["Master"]
    env = _env(_container(master))
    for key in ("PRIMUS_LOCAL_ROOT", "PRIMUS_OUTPUT_DIR"):
        env[key] = f"{tmp_path}{env[key]}"
    return run_recipe(ENTRYPOINT, tmp_path, **{**env, **operator_env}), env


def _operator_env(rank: int, *, per_process: bool) -> dict[str, str]:
    """What the training operator sets in pod `rank` (Master 0, Worker i -> i + 1); with
    spec.nprocPerNode it adds PET_* and counts WORLD_SIZE in processes."""
    job = _job()
    container = _container(job["spec"]["pytorchReplicaSpecs"]["Master"])
    nnodes, gpus = int(_env(container)["NNODES"]), int(_env(container)["GPUS_PER_NODE"])
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == PORT_NAME]
    addr = f"{job['metadata']['name']}-master-0"
    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank),
           "WORLD_SIZE": str(nnodes * gpus if per_process else nnodes)}  # fmt: skip
    if per_process:
        env |= {"PET_NODE_RANK": str(rank), "PET_NNODES": str(nnodes), "PET_MASTER_ADDR": addr,
                "PET_MASTER_PORT": str(port), "PET_NPROC_PER_NODE": str(gpus)}  # fmt: skip
    return env


@pytest.mark.parametrize(("rank", "per_process"), [(0, False), (2, True)], ids=["master", "worker"])
def test_each_replica_renders_its_torchrun_command(tmp_path, rank, per_process):
    run, env = _render(tmp_path, _operator_env(rank, per_process=per_process))
    r = run.resolved
    assert (r["nnodes"], r["gpus_per_node"], r["node_rank"]) == (3, 8, rank)
    assert (r["master_addr"], r["master_port"]) == ("primus-v4-sft-master-0", 29500)
    assert r["pack_cache_dir"] == f"{env['PRIMUS_LOCAL_ROOT']}/packs"
    assert r["checkpoint_dir"] == f"{env['PRIMUS_OUTPUT_DIR']}/checkpoints"
    assert r["packed"] is True and r["world_size"] == 24
    launcher = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
    assert run.command.startswith(
        f"{launcher} --nnodes 3 --node_rank {rank} --nproc_per_node 8 "
        "--master_addr primus-v4-sft-master-0 --master_port 29500 -m primus_v4 train --config "
    )
    assert f"--set data.cache_dir={env['PRIMUS_LOCAL_ROOT']}/packs" in run.command
    assert f"--set checkpoint.dir={env['PRIMUS_OUTPUT_DIR']}/checkpoints" in run.command
    assert f"entrypoint.sh: pod {rank}/3, 8 GPUs" in run.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"WORLD_SIZE": "5"}, "the operator's WORLD_SIZE=5 is neither NNODES=3 pods nor"),
        ({"PET_NNODES": "2"}, "the operator runs 2 pods (PET_NNODES) but NNODES=3"),
        ({"PET_NPROC_PER_NODE": "4"}, "nprocPerNode is 4 (PET_NPROC_PER_NODE) but"),
        ({"PRIMUS_K8S_RECIPE": "../x.sh"}, "PRIMUS_K8S_RECIPE=../x.sh is not a recipe of"),
    ],
)
def test_a_manifest_that_disagrees_with_the_operator_is_one_line(tmp_path, change, message):
    run, _ = _render(tmp_path, {**_operator_env(1, per_process=False), **change})
    assert run.returncode == 3
    assert run.stderr.startswith(f"entrypoint.sh: error: {message}")
    assert len(run.stderr.splitlines()) == 1
