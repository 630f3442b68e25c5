#!/usr/bin/env bash
# Runs any multi-node recipe of run_scripts/ as a SLURM job: one task per node starts torchrun,
# with the node rank, the master address and port, the GPUs per node and the node list taken
# from SLURM's environment (run_scripts/lib/launch.sh, primus_env_from_slurm), each node's pack
# cache built before training, one log per node, and elastic restarts from the newest
# checkpoint when a worker fails (PRIMUS_MAX_RESTARTS, default 3).
#
#   sbatch --nodes=3 run_scripts/slurm/sbatch_recipe.sh run_scripts/run_full_4k_thd_multinode.sh
#   DRY_RUN=1 sbatch ... (or inside salloc: DRY_RUN=1 bash run_scripts/slurm/sbatch_recipe.sh R)
#   srun --nodes=3 --ntasks-per-node=1 --kill-on-bad-exit=0 \
#     bash run_scripts/slurm/sbatch_recipe.sh --task run_scripts/run_full_4k_thd_multinode.sh
# Recipe knobs pass through the environment (sbatch exports it), e.g. TRAIN_STEPS=100 sbatch ...
# How long: the recipe's own time; DRY_RUN=1 validates once per node (seconds each).
#SBATCH --job-name=primus-v4
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

PRIMUS_SLURM_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# sbatch copies the batch script to a spool dir: then SLURM_SUBMIT_DIR names the checkout.
if [[ ! -f "${PRIMUS_SLURM_DIR}/../lib/common.sh" && -n "${SLURM_SUBMIT_DIR:-}" ]]; then
  PRIMUS_SLURM_DIR="${SLURM_SUBMIT_DIR}/run_scripts/slurm"
fi
PRIMUS_RECIPE="${PRIMUS_SLURM_DIR}/sbatch_recipe.sh"
# shellcheck source=../lib/common.sh
source "${PRIMUS_SLURM_DIR}/../lib/common.sh"

task=0
if [[ "${1:-}" == "--task" ]]; then
  task=1
  shift
fi
(($# == 1)) || primus_die "usage: sbatch_recipe.sh [--task] RECIPE (e.g. run_scripts/run_full_4k_thd_multinode.sh)"
recipe="$1"
[[ -f "${recipe}" ]] || recipe="${PRIMUS_REPO_ROOT}/${1}"
[[ -f "${recipe}" ]] || primus_die "recipe $1: no such file"
recipe="$(cd "$(dirname "${recipe}")" && pwd)/$(basename "${recipe}")"

# Elastic by default: a failed worker restarts the group, which resumes the newest checkpoint.
export PRIMUS_MAX_RESTARTS="${PRIMUS_MAX_RESTARTS:-3}"
export PRIMUS_PREPACK="${PRIMUS_PREPACK:-1}"

# One node's task: SLURM's environment -> the recipe's rendezvous knobs, then the recipe.
run_task() {
  primus_env_from_slurm
  local out="${PRIMUS_OUTPUT_DIR:-}"
  if [[ -n "${out}" && -z "${PRIMUS_NODE_LOG:-}" ]]; then
    export PRIMUS_NODE_LOG="${out}/logs/slurm-${SLURM_JOB_ID}/node${NODE_RANK}.log"
  fi
  export PRIMUS_RECIPE="${recipe}"
  exec bash "${recipe}"
}

if ((task)); then
  run_task
fi

# The batch step (on the first node): the plan, then one task per node. The mapping runs in
# subshells so nothing it exports reaches the tasks, which map their own node.
(
  primus_env_from_slurm
  echo "# job ${SLURM_JOB_ID}: ${NNODES} nodes (${PRIMUS_NODE_HOSTS}), rendezvous" \
    "${MASTER_ADDR}:${MASTER_PORT}, GPUs per node ${GPUS_PER_NODE:-as the recipe sets}, restarts" \
    "${PRIMUS_MAX_RESTARTS}, recipe ${recipe#"${PRIMUS_REPO_ROOT}/"}"
)
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  # What each node's task would run: its resolved recipe (JSON) and its torchrun command.
  nodes="$(primus_env_from_slurm && echo "${NNODES}")"
  for ((i = 0; i < nodes; i++)); do
    echo "# node ${i}"
    memory_plan=1
    ((i == 0)) || memory_plan=0 # the memory plan is the same on every node: printed once
    (SLURM_NODEID="${i}" PRIMUS_MEMORY_PLAN="${PRIMUS_MEMORY_PLAN:-${memory_plan}}" run_task)
  done
  exit 0
fi
# One task per node with all of the node's CPUs (torchrun's workers share them); a node whose
# task fails does not take the others down at once: torchrun's elastic agents re-form the group
# (PRIMUS_MAX_RESTARTS) or stop the job.
cpus=()
[[ -n "${SLURM_CPUS_ON_NODE:-}" ]] && cpus=(--cpus-per-task "${SLURM_CPUS_ON_NODE}")
exec srun --ntasks-per-node=1 "${cpus[@]}" --kill-on-bad-exit=0 --export=ALL \
  bash "${PRIMUS_SLURM_DIR}/sbatch_recipe.sh" --task "${recipe}"
