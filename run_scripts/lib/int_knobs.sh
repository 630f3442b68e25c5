#!/usr/bin/env bash
# Sourced first by every recipe and launcher, before any arithmetic. Bash arithmetic evaluates a
# variable's value as an expression, so a value like 'HOME[$(cmd)]' in NNODES would run cmd in
# $((NNODES * 8)). Every integer knob that arithmetic may read is checked by pattern first
# (indirect expansion never evaluates), and a bad one stops the script in one line, exit 3.

PRIMUS_INT_KNOBS=(
  NNODES NODE_RANK GPUS_PER_NODE MASTER_PORT WORLD_SIZE GBS
  PRIMUS_SEQ_LENGTH PRIMUS_PP PRIMUS_CP PRIMUS_EP PRIMUS_MAX_RESTARTS PRIMUS_MIN_NODES
  SLURM_JOB_ID SLURM_JOB_NUM_NODES SLURM_NNODES SLURM_NODEID SLURM_PROCID SLURM_GPUS_ON_NODE
  SLURM_RESTART_COUNT TORCHELASTIC_RESTART_COUNT PET_NODE_RANK PET_MASTER_PORT
)

# primus_check_int_knobs: each knob above that is set is a non-negative decimal integer, with no
# leading zero (bash arithmetic reads 010 as octal 8 and fails on 09).
primus_check_int_knobs() {
  local name value
  for name in "${PRIMUS_INT_KNOBS[@]}"; do
    value="${!name-}"
    if [[ -n "${value}" && ! "${value}" =~ ^(0|[1-9][0-9]{0,17})$ ]]; then
      echo "$(basename "${PRIMUS_RECIPE:-$0}"): error: ${name} must be a non-negative integer" \
        "(decimal, no leading zero), got '${value}'" >&2
      exit 3
    fi
  done
}

primus_check_int_knobs
