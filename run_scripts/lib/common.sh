#!/usr/bin/env bash
# Functions shared by the recipes in run_scripts/ (sourced, never run). A recipe sets its knobs
# with ${VAR:-default} so the caller's environment always wins, then calls, in order:
#   primus_check_rendezvous -> primus_probe_tokenizer -> primus_add_set ... -> primus_run
# (primus_run adds PRIMUS_PRETRAINED and PRIMUS_EXTRA_SETS last, so they win over the recipe's.)
# primus_run validates the whole config with the trainer's --dry-run (same world size as the real
# run), then either prints the resolved recipe (DRY_RUN=1) or launches torchrun.

PRIMUS_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# The recipe the user ran (wrappers export it before exec'ing the base), for messages and JSON.
PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"
PRIMUS_SCRIPT_NAME="$(basename "${PRIMUS_RECIPE}")"
PRIMUS_PYTHON="${PRIMUS_PYTHON:-python3}"
# The launcher: PRIMUS_TORCHRUN when set, else torchrun as a module of PRIMUS_PYTHON, so the
# validation and the launch always use one interpreter (no torchrun from another environment).
PRIMUS_TORCHRUN="${PRIMUS_TORCHRUN:-}"
# The --set overrides handed to the trainer, built up by primus_add_set.
PRIMUS_SETS=()
# Integer knobs of the environment checked before any arithmetic (a launcher sourcing only this).
# shellcheck source=int_knobs.sh
source "${PRIMUS_REPO_ROOT}/run_scripts/lib/int_knobs.sh"
# The rendezvous flags, elastic restarts, the scheduler mappings and the per-node pack build.
# shellcheck source=launch.sh
source "${PRIMUS_REPO_ROOT}/run_scripts/lib/launch.sh"

# Exit statuses, as primus-v4's (primus_v4/errors.py ExitCode): 3 a bad knob (config), 4 a
# tokenizer (data), 7 a release directory, 70 a failure of this script itself; a failed
# validation exits with the trainer's own status.
PRIMUS_EXIT_CONFIG=3
PRIMUS_EXIT_DATA=4
PRIMUS_EXIT_PRETRAINED=7
PRIMUS_EXIT_INTERNAL=70

# primus_die MESSAGE...: one line on stderr, exit 3 (a knob of the recipe is wrong).
primus_die() {
  primus_die_with "${PRIMUS_EXIT_CONFIG}" "$@"
}

# primus_die_with STATUS MESSAGE...: one line on stderr, exit STATUS.
primus_die_with() {
  local status="$1"
  shift
  echo "${PRIMUS_SCRIPT_NAME}: error: $*" >&2
  exit "${status}"
}

primus_log() {
  echo "${PRIMUS_SCRIPT_NAME}: $*" >&2
}

# A positive integer, or a clear error naming the variable.
primus_require_int() {
  local name="$1" value="$2"
  [[ "${value}" =~ ^[1-9][0-9]*$ ]] || primus_die "${name} must be a positive integer, got '${value}'"
}

# Multi-node runs need an explicit rendezvous: a guessed MASTER_ADDR or a defaulted NODE_RANK
# gives every node rank 0 (or a hang at rendezvous) instead of an error.
primus_check_rendezvous() {
  primus_require_int NNODES "${NNODES}"
  primus_require_int GPUS_PER_NODE "${GPUS_PER_NODE}"
  primus_require_int MASTER_PORT "${MASTER_PORT}"
  if ((NNODES > 1)); then
    [[ -n "${MASTER_ADDR:-}" ]] || primus_die "MASTER_ADDR is not set: a ${NNODES}-node run" \
      "needs the address of node 0, e.g. MASTER_ADDR=10.0.0.1 NODE_RANK=<this node> bash ${PRIMUS_RECIPE}"
    [[ -n "${NODE_RANK:-}" ]] || primus_die "NODE_RANK is not set: a ${NNODES}-node run" \
      "needs this node's rank in [0, $((NNODES - 1))], e.g. NODE_RANK=0 on the MASTER_ADDR node"
  fi
  primus_check_allocation
  NODE_RANK="${NODE_RANK:-0}"
  MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
  if ! [[ "${NODE_RANK}" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NNODES)); then
    primus_die "NODE_RANK=${NODE_RANK} must be an integer in [0, $((NNODES - 1))] (NNODES=${NNODES})"
  fi
}

# Sets PRIMUS_TOKENIZER_DIR (empty = the DeepSeek-V4 tokenizer bundled with the package).
# V4_TOKENIZER, when set, must hold tokenizer.json: an explicit choice never falls back silently.
# Otherwise the first dir of PRIMUS_TOKENIZER_PROBE_DIRS (colon-separated) with a tokenizer.json
# wins; with none, data.tokenizer is left to the config (null there = the DeepSeek-V4 tokenizer
# bundled with the package, same 129280 ids), unless PRIMUS_ALLOW_BUNDLED_TOKENIZER=0 makes that
# an error.
primus_probe_tokenizer() {
  PRIMUS_TOKENIZER_DIR=""
  if [[ -n "${V4_TOKENIZER:-}" ]]; then
    [[ -f "${V4_TOKENIZER}/tokenizer.json" ]] ||
      primus_die_with "${PRIMUS_EXIT_DATA}" "V4_TOKENIZER=${V4_TOKENIZER} has no tokenizer.json; point it at the" \
        "model directory that holds tokenizer.json, or unset it to probe"
    PRIMUS_TOKENIZER_DIR="${V4_TOKENIZER}"
    return 0
  fi
  local dir probe_dirs
  IFS=: read -r -a probe_dirs <<<"${PRIMUS_TOKENIZER_PROBE_DIRS}"
  for dir in "${probe_dirs[@]}"; do
    if [[ -n "${dir}" && -f "${dir}/tokenizer.json" ]]; then
      PRIMUS_TOKENIZER_DIR="${dir}"
      return 0
    fi
  done
  [[ "${PRIMUS_ALLOW_BUNDLED_TOKENIZER}" == "1" ]] ||
    primus_die_with "${PRIMUS_EXIT_DATA}" "no tokenizer.json in V4_TOKENIZER or any of PRIMUS_TOKENIZER_PROBE_DIRS" \
      "(${PRIMUS_TOKENIZER_PROBE_DIRS}); set V4_TOKENIZER=/path/to/DeepSeek-V4-Flash, or" \
      "PRIMUS_ALLOW_BUNDLED_TOKENIZER=1 to use the DeepSeek-V4 tokenizer shipped with the package"
  if [[ -n "${PRIMUS_TOKENIZER_PROBE_DIRS}" ]]; then
    primus_log "no tokenizer.json found in ${PRIMUS_TOKENIZER_PROBE_DIRS}; data.tokenizer is" \
      "left to the config (null = the bundled DeepSeek-V4 tokenizer)"
  fi
}

# primus_add_set KEY VALUE: one `--set KEY=VALUE` for the trainer.
primus_add_set() {
  PRIMUS_SETS+=(--set "$1=$2")
}

# primus_add_set_if KEY VALUE: only when VALUE is non-empty (empty = keep the config file's value).
primus_add_set_if() {
  if [[ -n "$2" ]]; then
    primus_add_set "$1" "$2"
  fi
}

# primus_add_pretrained: PRIMUS_PRETRAINED=/path/to/DeepSeek-V4-Flash (a released checkpoint dir:
# config.json + safetensors shards) starts the run from its weights: model.pretrained is set and
# model.preset cleared (the checkpoint's config.json is the model; model.overrides still apply).
# Its tokenizer is used unless V4_TOKENIZER or the probe set data.tokenizer. Empty = random init,
# said in one WARNING line. PRIMUS_RELEASE_EXAMPLE: the release directory the hints name (a
# recipe of another model sets its own).
primus_add_pretrained() {
  local example="${PRIMUS_RELEASE_EXAMPLE:-/apps/DeepSeek-V4-Flash}"
  if [[ -z "${PRIMUS_PRETRAINED:-}" ]]; then
    primus_log "WARNING: PRIMUS_PRETRAINED is not set: the model starts from random weights" \
      "(set it to a released checkpoint dir, e.g. ${example}, to fine-tune one)"
    return 0
  fi
  [[ -f "${PRIMUS_PRETRAINED}/config.json" ]] ||
    primus_die_with "${PRIMUS_EXIT_PRETRAINED}" "PRIMUS_PRETRAINED=${PRIMUS_PRETRAINED} has no config.json; point it at a released" \
      "checkpoint directory (config.json + model.safetensors.index.json + shards)," \
      "e.g. PRIMUS_PRETRAINED=${example}"
  # Absolute, because validation and launch run from the repository root.
  PRIMUS_PRETRAINED="$(cd "${PRIMUS_PRETRAINED}" && pwd)"
  primus_log "starting from the released checkpoint ${PRIMUS_PRETRAINED} (model.preset ignored)"
  primus_add_set model.preset null
  primus_add_set model.pretrained "${PRIMUS_PRETRAINED}"
}

# primus_add_extra_sets: PRIMUS_EXTRA_SETS="a.b=1 c.d=x" reaches any config key the recipe does
# not expose as a knob (values without spaces).
primus_add_extra_sets() {
  local item items
  read -r -a items <<<"${PRIMUS_EXTRA_SETS:-}"
  for item in "${items[@]}"; do
    [[ "${item}" == *=* ]] || primus_die "PRIMUS_EXTRA_SETS item '${item}' is not key=value"
    PRIMUS_SETS+=(--set "${item}")
  done
}

# Exports the networking environment. Empty knobs are left unset so RCCL/gloo keep their own
# detection; set SOCKET_IFNAME on hosts with several NICs (gloo otherwise picks one that may not
# route between nodes, which shows up as a rendezvous or first-collective hang).
primus_export_network() {
  local var
  if [[ -n "${SOCKET_IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-${SOCKET_IFNAME}}"
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-${SOCKET_IFNAME}}"
  fi
  for var in NCCL_IB_HCA NCCL_IB_GID_INDEX NCCL_IB_TC NCCL_IB_SL NCCL_NET_GDR_LEVEL NCCL_ALGO; do
    if [[ -n "${!var:-}" ]]; then
      export "${var?}"
    fi
  done
  export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"
  if [[ "${NCCL_IB_DISABLE}" == "1" && -z "${NCCL_ALGO:-}" ]]; then
    # Socket transport only: small all-reduces over Tree-on-TCP have been seen to deadlock;
    # Ring is the safe choice there.
    export NCCL_ALGO=Ring
  fi
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  # Fail a stuck collective with an error (and a flight-recorder dump) instead of hanging.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
  # Long-context activations vary in size per step; expandable segments avoid fragmentation OOMs.
  export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
}

# The trainer's own validation with the real world size. On success PRIMUS_RESOLVED_JSON holds
# its single-line resolved config; on failure the trainer's one-line message (what and where) is
# the error, and the recipe exits with the trainer's status. With
# PRIMUS_MEMORY_PLAN=1 (the default) it also prints the per-rank memory plan for
# PRIMUS_DEVICE_MEMORY (MI300X, MI308X, MI355X or GiB; default MI300X) on stderr and, when a
# pipeline stage does not fit, stops with the trainer's one-line reason (exit 3; the override
# PRIMUS_IGNORE_MEMORY_PLAN=1 is named in it). The plan builds the model on the meta device
# (~10 s for Flash); PRIMUS_MEMORY_PLAN=0 skips it.
primus_validate() {
  local world=$((NNODES * GPUS_PER_NODE)) out rc=0 plan=()
  if [[ "${PRIMUS_MEMORY_PLAN:-1}" == "1" ]]; then
    plan=(--device-memory "${PRIMUS_DEVICE_MEMORY:-MI300X}")
  fi
  out="$(cd "${PRIMUS_REPO_ROOT}" && env -u RANK -u LOCAL_RANK WORLD_SIZE="${world}" \
    "${PRIMUS_PYTHON}" -m primus_v4 train --config "${PRIMUS_CONFIG}" "${PRIMUS_SETS[@]}" \
    --dry-run "${plan[@]}")" || rc=$?
  if ((rc == 3)); then
    exit 3 # the memory gate said why, in one line
  fi
  if ((rc != 0)); then
    exit "${rc}"
  fi
  PRIMUS_RESOLVED_JSON="$(printf '%s\n' "${out}" | grep -E '^\{.*\}$' | tail -n 1 || true)"
  [[ -n "${PRIMUS_RESOLVED_JSON}" ]] ||
    primus_die_with "${PRIMUS_EXIT_INTERNAL}" "the trainer's --dry-run printed no JSON config" \
      "line; got: ${out//$'\n'/ }"
}

# The torchrun command line, as an array (PRIMUS_COMMAND).
primus_build_command() {
  local launcher=("${PRIMUS_PYTHON}" -m torch.distributed.run)
  [[ -n "${PRIMUS_TORCHRUN}" ]] && launcher=("${PRIMUS_TORCHRUN}")
  primus_torchrun_args
  PRIMUS_COMMAND=(
    "${launcher[@]}" "${PRIMUS_TORCHRUN_ARGS[@]}"
    -m primus_v4 train --config "${PRIMUS_CONFIG}" "${PRIMUS_SETS[@]}"
  )
}

# DRY_RUN=1: the recipe's resolved configuration as one JSON line, then the command; exit 0.
primus_print_dry_run() {
  printf '%s\n' "${PRIMUS_RESOLVED_JSON}" |
    "${PRIMUS_PYTHON}" "${PRIMUS_REPO_ROOT}/run_scripts/lib/recipe_summary.py" \
      --nnodes "${NNODES}" --gpus-per-node "${GPUS_PER_NODE}" --node-rank "${NODE_RANK}" \
      --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
      --tokenizer "${PRIMUS_TOKENIZER_DIR:-}" --recipe "${PRIMUS_SCRIPT_NAME}" ||
    primus_die_with "${PRIMUS_EXIT_INTERNAL}" "could not summarize the resolved config"
  (
    printf '%q' "${PRIMUS_COMMAND[0]}"
    printf ' %q' "${PRIMUS_COMMAND[@]:1}"
    printf '\n'
  )
}

# Validate, then print (DRY_RUN=1) or launch with this node's output teed to PRIMUS_NODE_LOG.
# PRIMUS_PREFLIGHT=0 skips the validation before a real launch (the trainer validates again at
# start); a dry run always validates.
primus_run() {
  [[ -f "${PRIMUS_CONFIG}" ]] || primus_die "PRIMUS_CONFIG=${PRIMUS_CONFIG}: no such file"
  # Absolute, because validation and launch run from the repository root.
  PRIMUS_CONFIG="$(cd "$(dirname "${PRIMUS_CONFIG}")" && pwd)/$(basename "${PRIMUS_CONFIG}")"
  primus_add_pretrained
  if [[ "${PRIMUS_IGNORE_MEMORY_PLAN:-0}" == "1" ]]; then
    primus_add_set train.ignore_memory_plan true
  fi
  primus_add_extra_sets
  if [[ "${DRY_RUN:-0}" == "1" || "${PRIMUS_PREFLIGHT:-1}" == "1" ]]; then
    primus_validate
  fi
  primus_build_command
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    primus_print_dry_run
    exit 0
  fi
  mkdir -p "$(dirname "${PRIMUS_NODE_LOG}")"
  primus_log "node ${NODE_RANK}/${NNODES}: logging to ${PRIMUS_NODE_LOG}"
  exec > >(tee -a "${PRIMUS_NODE_LOG}") 2>&1
  primus_prepack
  cd "${PRIMUS_REPO_ROOT}" || exit 1
  exec "${PRIMUS_COMMAND[@]}"
}
