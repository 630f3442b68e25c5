#!/usr/bin/env bash
# What each pod of run_scripts/k8s/pytorchjob.yaml runs: maps the environment the Kubeflow
# training operator gives a PyTorchJob replica onto the recipes' rendezvous knobs, then execs
# the recipe named by PRIMUS_K8S_RECIPE (a file of run_scripts/), which builds this node's pack
# cache and starts torchrun as on any other cluster.
#
#   operator (per pod)                       recipe knob
#   PET_NODE_RANK, else RANK (pod rank)  ->  NODE_RANK   (Master 0, Worker i -> i + 1)
#   PET_MASTER_ADDR, else MASTER_ADDR    ->  MASTER_ADDR (the Master pod's service)
#   PET_MASTER_PORT, else MASTER_PORT    ->  MASTER_PORT (the container port pytorchjob-port)
#   PET_NNODES, WORLD_SIZE               ->  checked against the manifest's NNODES
#   PET_NPROC_PER_NODE                   ->  checked against the manifest's GPUS_PER_NODE
#
# Check the command one pod would run (no cluster needed):
#   DRY_RUN=1 PRIMUS_K8S_RECIPE=run_full_4k_thd_multinode.sh NNODES=3 GPUS_PER_NODE=8 \
#     MASTER_ADDR=job-master-0 MASTER_PORT=29500 WORLD_SIZE=3 RANK=1 bash run_scripts/k8s/entrypoint.sh
set -euo pipefail
# shellcheck source=../lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"

PRIMUS_K8S_RECIPE="${PRIMUS_K8S_RECIPE:-}"
[[ -n "${PRIMUS_K8S_RECIPE}" ]] ||
  primus_die "PRIMUS_K8S_RECIPE is not set: name the recipe of run_scripts/ to run," \
    "e.g. run_full_4k_thd_multinode.sh"
recipe="${PRIMUS_REPO_ROOT}/run_scripts/${PRIMUS_K8S_RECIPE}"
[[ "${PRIMUS_K8S_RECIPE}" != */* && -f "${recipe}" ]] ||
  primus_die "PRIMUS_K8S_RECIPE=${PRIMUS_K8S_RECIPE} is not a recipe of run_scripts/" \
    "(e.g. run_full_4k_thd_multinode.sh)"

[[ -n "${NNODES:-}" ]] || primus_die "NNODES is not set: the manifest's env gives the node count"
[[ -n "${GPUS_PER_NODE:-}" ]] ||
  primus_die "GPUS_PER_NODE is not set: the manifest's env gives it (= the pod's GPU limit)"
primus_require_int NNODES "${NNODES}"
primus_require_int GPUS_PER_NODE "${GPUS_PER_NODE}"

NODE_RANK="${PET_NODE_RANK:-${RANK:-${NODE_RANK:-}}}"
MASTER_ADDR="${PET_MASTER_ADDR:-${MASTER_ADDR:-}}"
MASTER_PORT="${PET_MASTER_PORT:-${MASTER_PORT:-}}"
if [[ -n "${PET_NNODES:-}" && "${PET_NNODES}" != "${NNODES}" ]]; then
  primus_die "the operator runs ${PET_NNODES} pods (PET_NNODES) but NNODES=${NNODES};" \
    "make Master + Worker replicas equal NNODES in the manifest"
fi
if [[ -n "${PET_NPROC_PER_NODE:-}" && "${PET_NPROC_PER_NODE}" != "${GPUS_PER_NODE}" ]]; then
  primus_die "nprocPerNode is ${PET_NPROC_PER_NODE} (PET_NPROC_PER_NODE) but" \
    "GPUS_PER_NODE=${GPUS_PER_NODE}; make them and the GPU limit equal in the manifest"
fi
# The operator's WORLD_SIZE counts pods, or processes when spec.nprocPerNode is set.
if [[ -n "${WORLD_SIZE:-}" && "${WORLD_SIZE}" != "${NNODES}" &&
  "${WORLD_SIZE}" != "$((NNODES * GPUS_PER_NODE))" ]]; then
  primus_die "the operator's WORLD_SIZE=${WORLD_SIZE} is neither NNODES=${NNODES} pods nor" \
    "NNODES x GPUS_PER_NODE=$((NNODES * GPUS_PER_NODE)) processes; make Master + Worker" \
    "replicas equal NNODES in the manifest"
fi
# torchrun sets RANK and WORLD_SIZE for each process it starts and reads PET_* as defaults of
# its own flags: the operator's pod-level values must not reach it.
unset RANK WORLD_SIZE PET_NODE_RANK PET_MASTER_ADDR PET_MASTER_PORT PET_NNODES PET_NPROC_PER_NODE
export NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT
primus_log "pod ${NODE_RANK}/${NNODES}, ${GPUS_PER_NODE} GPUs, rendezvous" \
  "${MASTER_ADDR}:${MASTER_PORT}: ${PRIMUS_K8S_RECIPE}"
exec bash "${recipe}" "$@"
