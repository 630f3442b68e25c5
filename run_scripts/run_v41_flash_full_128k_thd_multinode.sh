#!/usr/bin/env bash
# Full DeepSeek-V4.1-Flash SFT at 128k tokens per pack (thd) with context parallelism: CP8 (each
# CP rank holds 16384 rows of every pack), the whole MoE, norms and q up-projection recomputed,
# chunked LM head + cross-entropy, Engram frozen and sharded. From the memory plan:
#   MI300X (192 GiB): 8 nodes x 8 GPUs, TP1 PP4 CP8 EP16 (DP2), bf16 gradient buckets, offload 0.9
#   MI355X (288 GiB): 4 nodes x 8 GPUs, TP1 PP4 CP8 EP8 (DP1), fp32 gradient buckets, offload 0.9
# Memory (DRY_RUN=1), GiB per GPU, stages 0 / 1 / 2 / 3 (layout Et*8|t*9|t*11|t*12L):
#   MI300X: 145.1 / 135.3 / 114.5 / 111.8, 76% of 192
#   MI355X: 214.6 / 212.1 / 199.5 / 206.7, 75% of 288
# PRIMUS_SEQ_LENGTH=65536 runs 64k packs on the same layout. Sets the long-context knobs, then
# execs run_v41_flash_full_thd_multinode.sh.
#
#   MASTER_ADDR=<node 0> NODE_RANK=<n> bash run_scripts/run_v41_flash_full_128k_thd_multinode.sh
#   DRY_RUN=1 MASTER_ADDR=x NODE_RANK=0 bash run_scripts/run_v41_flash_full_128k_thd_multinode.sh
# How long: the dry run takes about a minute; the 128k step time is not measured yet.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"

export PRIMUS_DEVICE_MEMORY="${PRIMUS_DEVICE_MEMORY:-MI300X}"
big=0
grad_buffers=bfloat16
if [[ "${PRIMUS_DEVICE_MEMORY^^}" == "MI355X" ]]; then
  big=1
  grad_buffers=float32
fi
export PRIMUS_SEQ_LENGTH="${PRIMUS_SEQ_LENGTH:-131072}"
export NNODES="${NNODES:-$((big ? 4 : 8))}"
export PRIMUS_PP="${PRIMUS_PP:-4}"
export PRIMUS_CP="${PRIMUS_CP:-8}"
export PRIMUS_EP="${PRIMUS_EP:-$((big ? 8 : 16))}"
# Stage 0 holds 4 micro-batches in flight (1F1B), the last one 1: fewer layers up front.
export PRIMUS_PP_LAYOUT="${PRIMUS_PP_LAYOUT:-Et*8|t*9|t*11|t*12L}"
export GBS="${GBS:-$((NNODES * 8 * 4 / PRIMUS_PP / PRIMUS_CP))}" # 4 micro-batches per DP rank
export PRIMUS_OPTIMIZER_OFFLOAD_FRACTION="${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION:-0.9}"
export FUSED_LINEAR_CE="${FUSED_LINEAR_CE:-1}"
export FUSED_CE_CHUNK="${FUSED_CE_CHUNK:-4096}"
export PRIMUS_RECOMPUTE="${PRIMUS_RECOMPUTE:-selective}"
export PRIMUS_RECOMPUTE_MODULES="${PRIMUS_RECOMPUTE_MODULES:-layernorm,mla_up_proj,core_attn,moe}"
export PRIMUS_GRAD_ACCUM_DTYPE="${PRIMUS_GRAD_ACCUM_DTYPE:-${grad_buffers}}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv41_flash_$((PRIMUS_SEQ_LENGTH / 1024))k_thd_${NNODES}node}"

exec bash "$(dirname "${BASH_SOURCE[0]}")/run_v41_flash_full_thd_multinode.sh" "$@"
