#!/usr/bin/env bash
# Full DeepSeek-V4-Flash SFT at 4k tokens per pack, packed (thd: many samples per row with
# cu_seqlens), 3 nodes x 8 GPUs, TP1 PP3 CP1 EP8, offload 0.75. Sets only the packing knobs,
# then execs run_full_4k_multinode.sh (every other knob and its default lives there).
#
#   MASTER_ADDR=<node 0 address> NODE_RANK=<0..2> bash run_scripts/run_full_4k_thd_multinode.sh
#   DRY_RUN=1 MASTER_ADDR=x NODE_RANK=0 bash run_scripts/run_full_4k_thd_multinode.sh
# How long: as the base recipe, plus a one-time pack build per node (seconds to minutes with the
# corpus size; later runs load the node-local cache).
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"

export PRIMUS_DATA_LAYOUT="${PRIMUS_DATA_LAYOUT:-thd}"
export PRIMUS_PACK_ALGORITHM="${PRIMUS_PACK_ALGORITHM:-ffd}" # ffd | bfd
# thd rows are packs: micro-batch 1 always (a pack already holds many samples).
export MBS="${MBS:-1}"
# Node-local (per user) cache and lock dirs; see run_full_4k_multinode.sh for why not shared.
export PRIMUS_LOCAL_ROOT="${PRIMUS_LOCAL_ROOT:-${TMPDIR:-/tmp}/primus_v4-$(id -u)}"
export PRIMUS_PACK_CACHE_DIR="${PRIMUS_PACK_CACHE_DIR:-${PRIMUS_LOCAL_ROOT}/packs}"
export PRIMUS_PACK_LOCK_DIR="${PRIMUS_PACK_LOCK_DIR:-${PRIMUS_LOCAL_ROOT}/locks}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv4_flash_4k_thd_${NNODES:-3}node}"

exec bash "$(dirname "${BASH_SOURCE[0]}")/run_full_4k_multinode.sh" "$@"
