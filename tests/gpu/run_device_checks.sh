#!/usr/bin/env bash
# The device check for a machine with one GPU (AMD gfx942 / gfx950, or NVIDIA): the gpu-marked
# suite (tests/gpu), benchmarks/bench_kernels.py (every kernel backend vs the torch reference)
# and a 20-step training run of the tiny model on the device; then one summary file, by default
# outputs/device_check/summary.json (pass/fail counts, TFLOP/s per kernel and backend vs torch,
# tokens/s), also printed.
#
#   bash tests/gpu/run_device_checks.sh                 # from the repository root
#   DEVICE_CHECK_DIR=/tmp/dc bash tests/gpu/run_device_checks.sh
#
# How long: under 8 minutes; each part has its own limit (DEVICE_CHECK_SUITE_S 220,
# DEVICE_CHECK_BENCH_S 120, DEVICE_CHECK_TRAIN_S 90 seconds), and a part that runs past it is
# reported as timed out while the others still run. Without a GPU it prints one line saying so
# and exits 0 in seconds. Exit status: 0 when every part passed, 1 otherwise.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NAME="$(basename "$0")"
PYTHON="${PRIMUS_PYTHON:-python3}"
OUT="${DEVICE_CHECK_DIR:-${REPO}/outputs/device_check}"
SUITE_S="${DEVICE_CHECK_SUITE_S:-220}"
BENCH_S="${DEVICE_CHECK_BENCH_S:-120}"
TRAIN_S="${DEVICE_CHECK_TRAIN_S:-90}"
TRAIN_STEPS="${DEVICE_CHECK_TRAIN_STEPS:-20}"

# gfx942 / gfx950 from gcnArchName on ROCm, sm_XY on NVIDIA; nothing without a GPU.
if ! ARCH="$(cd "${REPO}" && "${PYTHON}" -c 'from tests.conftest import accelerator_arch
print(accelerator_arch() or "")')"; then
  echo "${NAME}: error: ${PYTHON} could not import torch to probe the device (traceback above)" >&2
  exit 1
fi
ARCH="$(tail -n 1 <<<"${ARCH}")"
if [[ -z "${ARCH}" ]]; then
  echo "${NAME}: skipped: no GPU (torch.cuda.is_available() is False); run it on a gfx942/gfx950 or NVIDIA machine"
  exit 0
fi

mkdir -p "${OUT}"
cd "${REPO}"
export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
PARTS=()

# run_part NAME LIMIT_S LOG COMMAND...: runs it under `timeout`, records passed / failed /
# timed_out and the seconds it took; never stops the script.
run_part() {
  local part="$1" limit="$2" log="$3" start status rc=0
  shift 3
  echo "${NAME}: ${part} (limit ${limit} s, log ${log})"
  start="${SECONDS}"
  timeout --kill-after=10 "${limit}" "$@" >"${log}" 2>&1 || rc=$?
  case "${rc}" in
    0) status=passed ;;
    124 | 137) status=timed_out ;;
    *) status=failed ;;
  esac
  PARTS+=(--part "${part}=${status}:$((SECONDS - start))")
  echo "${NAME}: ${part} ${status} in $((SECONDS - start)) s"
}

run_part gpu_suite "${SUITE_S}" "${OUT}/gpu_suite.log" \
  "${PYTHON}" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml "${OUT}/gpu_suite.xml"
run_part bench_kernels "${BENCH_S}" "${OUT}/bench_kernels.log" \
  "${PYTHON}" benchmarks/bench_kernels.py --rows 4096 --json "${OUT}/bench_kernels.json"
run_part train "${TRAIN_S}" "${OUT}/train.log" \
  "${PYTHON}" -m primus_v4 train --config tiny_cpu_thd --set train.steps="${TRAIN_STEPS}" \
  --set output.dir="${OUT}/train" --set output.overwrite=true \
  --set output.progress_bar=false --set data.cache_dir="${OUT}/pack_cache" \
  --set data.lock_dir="${OUT}/locks"

"${PYTHON}" tests/gpu/device_summary.py --out "${OUT}/summary.json" --arch "${ARCH}" \
  --junit "${OUT}/gpu_suite.xml" --bench "${OUT}/bench_kernels.json" \
  --metrics "${OUT}/train/metrics.jsonl" "${PARTS[@]}"
