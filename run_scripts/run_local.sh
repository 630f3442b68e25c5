#!/usr/bin/env bash
# One machine, NPROC processes through the same torchrun path as the cluster recipes: gloo on
# CPU, or one process per GPU. Defaults train the tiny DeepSeek-V4 (primus_v4/configs/runs/tiny_cpu_thd.yaml)
# for 3 steps with 2 processes (DP2); the config's global batch follows dp unless GBS is set.
#
#   NPROC=2 bash run_scripts/run_local.sh                      # CPU: well under a minute
#   NPROC=2 PRIMUS_CP=2 PRIMUS_SEQ_LENGTH=512 PRIMUS_OUTPUT_DIR=outputs/run_local_cp2 \
#     bash run_scripts/run_local.sh
#   PRIMUS_DEVICE=gpu NPROC=8 PRIMUS_CONFIG=... bash run_scripts/run_local.sh
#   DRY_RUN=1 bash run_scripts/run_local.sh                    # validate, print JSON + command
# Knobs left empty keep the config file's value.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

NPROC="${NPROC:-2}"
NNODES=1
GPUS_PER_NODE="${NPROC}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK=0
primus_check_rendezvous

# auto: the trainer uses GPUs when torch sees them; cpu hides them so gloo runs on CPU even on
# a GPU machine; gpu requires them.
PRIMUS_DEVICE="${PRIMUS_DEVICE:-auto}"
case "${PRIMUS_DEVICE}" in
  auto) ;;
  cpu) export CUDA_VISIBLE_DEVICES=-1 HIP_VISIBLE_DEVICES=-1 ;; # an invalid index hides all
  gpu)
    "${PRIMUS_PYTHON}" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' ||
      primus_die "PRIMUS_DEVICE=gpu but torch sees no GPU (torch.cuda.is_available() is False)"
    ;;
  *) primus_die "PRIMUS_DEVICE must be auto, cpu or gpu, got '${PRIMUS_DEVICE}'" ;;
esac
# Each gloo process gets one thread unless asked: NPROC processes share the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
SOCKET_IFNAME="${SOCKET_IFNAME:-}"
primus_export_network
# The config is validated before torchrun starts (PRIMUS_PREFLIGHT=0 skips it): a bad value is
# then one line and its exit status, not NPROC tracebacks and torchrun's own.
PRIMUS_PREFLIGHT="${PRIMUS_PREFLIGHT:-1}"

PRIMUS_CONFIG="${PRIMUS_CONFIG:-${PRIMUS_REPO_ROOT}/primus_v4/configs/runs/tiny_cpu_thd.yaml}"
TRAIN_STEPS="${TRAIN_STEPS:-3}"
PRIMUS_SEQ_LENGTH="${PRIMUS_SEQ_LENGTH:-}"
PRIMUS_DATA_PATH="${PRIMUS_DATA_PATH:-}"
PRIMUS_DATA_LAYOUT="${PRIMUS_DATA_LAYOUT:-}"
PRIMUS_MODEL_PRESET="${PRIMUS_MODEL_PRESET:-}"
GBS="${GBS:-}"
MBS="${MBS:-}"
PRIMUS_TP="${PRIMUS_TP:-}"
PRIMUS_PP="${PRIMUS_PP:-}"
PRIMUS_CP="${PRIMUS_CP:-}"
PRIMUS_EP="${PRIMUS_EP:-}"
PRIMUS_ETP="${PRIMUS_ETP:-}"
PRIMUS_PACK_CACHE_DIR="${PRIMUS_PACK_CACHE_DIR:-}"
PRIMUS_PACK_LOCK_DIR="${PRIMUS_PACK_LOCK_DIR:-}"
PRIMUS_OUTPUT_DIR="${PRIMUS_OUTPUT_DIR:-${PRIMUS_REPO_ROOT}/outputs/run_local}"
PRIMUS_NODE_LOG="${PRIMUS_NODE_LOG:-${PRIMUS_OUTPUT_DIR}/log_node0.txt}"
# A dir with tokenizer.json (checked), else the first probe dir holding one; none = the config's.
V4_TOKENIZER="${V4_TOKENIZER:-}"
PRIMUS_TOKENIZER_PROBE_DIRS="${PRIMUS_TOKENIZER_PROBE_DIRS:-}"
PRIMUS_ALLOW_BUNDLED_TOKENIZER="${PRIMUS_ALLOW_BUNDLED_TOKENIZER:-1}"
primus_probe_tokenizer

primus_add_set train.steps "${TRAIN_STEPS}"
primus_add_set_if train.global_batch_size "${GBS}"
primus_add_set_if train.micro_batch_size "${MBS}"
primus_add_set_if data.path "${PRIMUS_DATA_PATH}"
primus_add_set_if data.seq_length "${PRIMUS_SEQ_LENGTH}"
primus_add_set_if data.layout "${PRIMUS_DATA_LAYOUT}"
primus_add_set_if data.cache_dir "${PRIMUS_PACK_CACHE_DIR}"
primus_add_set_if data.lock_dir "${PRIMUS_PACK_LOCK_DIR}"
primus_add_set_if data.tokenizer "${PRIMUS_TOKENIZER_DIR}"
primus_add_set_if model.preset "${PRIMUS_MODEL_PRESET}"
primus_add_set_if parallel.tp "${PRIMUS_TP}"
primus_add_set_if parallel.pp "${PRIMUS_PP}"
primus_add_set_if parallel.cp "${PRIMUS_CP}"
primus_add_set_if parallel.ep "${PRIMUS_EP}"
primus_add_set_if parallel.etp "${PRIMUS_ETP}"
primus_add_set output.dir "${PRIMUS_OUTPUT_DIR}"

# GBS empty: the config's global batch follows dp (raised to a multiple of micro batch x dp), so
# a config written for one process runs on NPROC; a GBS you set is checked as given.
if [[ -z "${GBS}" ]]; then
  fitted_gbs="$(cd "${PRIMUS_REPO_ROOT}" && "${PRIMUS_PYTHON}" \
    "${PRIMUS_REPO_ROOT}/run_scripts/lib/fit_global_batch.py" "${NPROC}" "${PRIMUS_CONFIG}" \
    "${PRIMUS_SETS[@]}")" || primus_die_with "${PRIMUS_EXIT_INTERNAL}" "could not read the global batch of ${PRIMUS_CONFIG}"
  if [[ -n "${fitted_gbs}" ]]; then
    primus_log "train.global_batch_size follows dp: ${fitted_gbs} for NPROC=${NPROC} (set GBS to choose)"
    primus_add_set train.global_batch_size "${fitted_gbs}"
  fi
fi

primus_run
