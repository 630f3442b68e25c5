#!/usr/bin/env bash
# How a recipe becomes torchrun processes (sourced by common.sh, never run). One place maps a
# scheduler's environment to the recipe's rendezvous knobs, and one place turns those knobs into
# torchrun's flags, for the manual launch, run_scripts/slurm/ and the Kubernetes manifests alike:
#   primus_env_from_slurm   SLURM_* -> NNODES NODE_RANK GPUS_PER_NODE MASTER_ADDR MASTER_PORT
#                           PRIMUS_RDZV_ID (a knob you exported first wins)
#   primus_torchrun_args    NNODES NODE_RANK GPUS_PER_NODE MASTER_ADDR MASTER_PORT + the elastic
#                           knobs below -> PRIMUS_TORCHRUN_ARGS (torchrun's rendezvous flags)
#   primus_check_allocation the recipe's NNODES is the allocation's (primus_check_rendezvous)
#   primus_expand_hostlist  a SLURM node list (node[01-03],gpu7) -> one host per line
#   primus_prepack          PRIMUS_PREPACK=1: build (or verify) this node's pack cache before
#                           torchrun starts, with the trainer's own data config
#
# Elastic knobs (torchrun's own rendezvous; see README_thd_packed.md, "Surviving a lost worker"):
#   PRIMUS_MAX_RESTARTS   restarts of the whole worker group after a worker fails (default 0)
#   PRIMUS_RDZV_BACKEND   static (fixed NODE_RANK, the default without restarts) or c10d (the
#                         default with restarts: ranks assigned at each rendezvous, so a group
#                         can re-form after a failure)
#   PRIMUS_MIN_NODES      c10d: the fewest nodes the job continues with (default NNODES)
#   PRIMUS_RDZV_ID        c10d: the job's rendezvous id (default primus-v4-<MASTER_PORT>)

# primus_expand_hostlist LIST: the hosts of a SLURM node list, one per line. `scontrol show
# hostnames` when SLURM's tools are here; otherwise plain shell for lists of names and one
# bracket group per name (node[01-03,7]-ib), which is what SLURM writes for most clusters.
primus_expand_hostlist() {
  local list="$1"
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "${list}"
    return
  fi
  local item prefix body suffix range lo hi n
  # Commas inside brackets separate ranges, outside they separate names.
  while [[ -n "${list}" ]]; do
    if [[ "${list}" =~ ^([^,\[]*)\[([^]]*)\]([^,\[]*)(,|$) ]]; then
      prefix="${BASH_REMATCH[1]}" body="${BASH_REMATCH[2]}" suffix="${BASH_REMATCH[3]}"
      list="${list:${#BASH_REMATCH[0]}}"
      IFS=, read -r -a ranges <<<"${body}"
      for range in "${ranges[@]}"; do
        if [[ "${range}" =~ ^([0-9]+)-([0-9]+)$ ]]; then
          lo="${BASH_REMATCH[1]}" hi="${BASH_REMATCH[2]}"
          for ((n = 10#${lo}; n <= 10#${hi}; n++)); do
            printf '%s%0*d%s\n' "${prefix}" "${#lo}" "${n}" "${suffix}"
          done
        elif [[ "${range}" =~ ^[0-9]+$ ]]; then
          printf '%s%s%s\n' "${prefix}" "${range}" "${suffix}"
        else
          primus_die "SLURM node list '$1': cannot expand '[${body}]' without scontrol"
        fi
      done
    elif [[ "${list}" =~ ^([^],\[]+)(,|$) ]]; then
      item="${BASH_REMATCH[1]}"
      list="${list:${#BASH_REMATCH[0]}}"
      printf '%s\n' "${item}"
    else
      primus_die "SLURM node list '$1': cannot expand '${list}' without scontrol" \
        "(one bracket group per name is understood; run where scontrol is installed)"
    fi
  done
}

# primus_env_from_slurm: this node's rendezvous from SLURM's environment, for one task per node
# (srun --ntasks-per-node=1) running torchrun. The node count and rank are always SLURM's; an
# exported MASTER_ADDR, MASTER_PORT or GPUS_PER_NODE wins (run this before the recipe, whose
# defaults would otherwise win).
primus_env_from_slurm() {
  [[ -n "${SLURM_JOB_ID:-}" ]] || primus_die "SLURM_JOB_ID is not set: not inside a SLURM job"
  local nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" hosts=()
  [[ -n "${nodelist}" ]] || primus_die "SLURM_JOB_NODELIST is not set: SLURM names no nodes"
  mapfile -t hosts < <(primus_expand_hostlist "${nodelist}")
  ((${#hosts[@]} > 0)) || primus_die "SLURM_JOB_NODELIST=${nodelist} expands to no host"
  NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${#hosts[@]}}}"
  NODE_RANK="${SLURM_NODEID:-${SLURM_PROCID:-}}"
  [[ -n "${NODE_RANK}" ]] || primus_die "SLURM_NODEID is not set: run one task per node with" \
    "srun --ntasks-per-node=1"
  MASTER_ADDR="${MASTER_ADDR:-${hosts[0]}}"
  # One port per job: two jobs sharing a node do not collide.
  MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  # GPUs this task sees; SLURM_GPUS_PER_NODE may carry a type (gpu:mi300x:8).
  local gpus="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-${gpus##*:}}"
  PRIMUS_RDZV_ID="${PRIMUS_RDZV_ID:-slurm-${SLURM_JOB_ID}}"
  PRIMUS_NODE_HOSTS="${hosts[*]}"
  export NNODES NODE_RANK MASTER_ADDR MASTER_PORT PRIMUS_RDZV_ID PRIMUS_NODE_HOSTS
  if [[ -n "${GPUS_PER_NODE}" ]]; then
    export GPUS_PER_NODE
  else
    unset GPUS_PER_NODE # the recipe's default
  fi
  export PRIMUS_ALLOCATED_NODES="${NNODES}"
}

# primus_check_allocation: under a scheduler, the recipe runs the allocation's node count (a
# one-node recipe on two nodes would start two independent runs writing one output dir).
primus_check_allocation() {
  if [[ -n "${PRIMUS_ALLOCATED_NODES:-}" && "${PRIMUS_ALLOCATED_NODES}" != "${NNODES}" ]]; then
    primus_die "${PRIMUS_SCRIPT_NAME} runs NNODES=${NNODES} but the job has" \
      "${PRIMUS_ALLOCATED_NODES} nodes; use a multi-node recipe or allocate ${NNODES}"
  fi
}

# primus_torchrun_args: torchrun's rendezvous flags for this node as PRIMUS_TORCHRUN_ARGS (read
# by primus_build_command in common.sh).
# shellcheck disable=SC2034
primus_torchrun_args() {
  PRIMUS_MAX_RESTARTS="${PRIMUS_MAX_RESTARTS:-0}"
  [[ "${PRIMUS_MAX_RESTARTS}" =~ ^[0-9]+$ ]] ||
    primus_die "PRIMUS_MAX_RESTARTS must be an integer >= 0, got '${PRIMUS_MAX_RESTARTS}'"
  local default_backend=static
  ((PRIMUS_MAX_RESTARTS > 0)) && default_backend=c10d
  PRIMUS_RDZV_BACKEND="${PRIMUS_RDZV_BACKEND:-${default_backend}}"
  case "${PRIMUS_RDZV_BACKEND}" in
    static)
      ((PRIMUS_MAX_RESTARTS == 0)) || primus_die "PRIMUS_MAX_RESTARTS=${PRIMUS_MAX_RESTARTS}" \
        "needs PRIMUS_RDZV_BACKEND=c10d (a static rendezvous cannot re-form the group)"
      PRIMUS_TORCHRUN_ARGS=(
        --nnodes "${NNODES}" --node_rank "${NODE_RANK}" --nproc_per_node "${GPUS_PER_NODE}"
        --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT}"
      )
      ;;
    c10d)
      PRIMUS_MIN_NODES="${PRIMUS_MIN_NODES:-${NNODES}}"
      primus_require_int PRIMUS_MIN_NODES "${PRIMUS_MIN_NODES}"
      ((PRIMUS_MIN_NODES <= NNODES)) ||
        primus_die "PRIMUS_MIN_NODES=${PRIMUS_MIN_NODES} is more than NNODES=${NNODES}"
      PRIMUS_RDZV_ID="${PRIMUS_RDZV_ID:-primus-v4-${MASTER_PORT}}"
      # The agents' shared TCP store keeps the previous attempt's keys, and a restarted group
      # then connects to dead ports (pytorch/pytorch#135712): one store per attempt instead.
      export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
      # Ranks come from the rendezvous (torchrun ignores --node_rank here); node 0's address
      # hosts the rendezvous store, so losing that node ends the job.
      PRIMUS_TORCHRUN_ARGS=(
        --nnodes "${PRIMUS_MIN_NODES}:${NNODES}" --nproc_per_node "${GPUS_PER_NODE}"
        --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR}:${MASTER_PORT}"
        --rdzv_id "${PRIMUS_RDZV_ID}" --max_restarts "${PRIMUS_MAX_RESTARTS}"
      )
      ;;
    *) primus_die "PRIMUS_RDZV_BACKEND must be static or c10d, got '${PRIMUS_RDZV_BACKEND}'" ;;
  esac
}

# primus_prepack: PRIMUS_PREPACK=1 builds this node's pack cache (or finds it there) before
# torchrun, so no rank spends the rendezvous or collective timeouts on tokenizing. The trainer's
# data config decides the cache key, so training then loads exactly what was built.
primus_prepack() {
  [[ "${PRIMUS_PREPACK:-0}" == "1" ]] || return 0
  primus_log "node ${NODE_RANK}: building the pack cache before training (PRIMUS_PREPACK=1)"
  local rc=0
  (cd "${PRIMUS_REPO_ROOT}" && env -u RANK -u LOCAL_RANK "${PRIMUS_PYTHON}" \
    "${PRIMUS_REPO_ROOT}/run_scripts/lib/prepack.py" --config "${PRIMUS_CONFIG}" \
    "${PRIMUS_SETS[@]}") || rc=$?
  ((rc == 0)) || exit "${rc}" # prepack.py said what and where, in one line
}
