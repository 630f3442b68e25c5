#!/usr/bin/env bash
# Full DeepSeek-V4-Flash SFT at 128k tokens per pack (thd), 3 nodes x 8 GPUs: TP1 PP3 CP8 EP8
# (DP1; each CP rank holds 16384 rows of every pack), GBS 3 (one pack per pipeline stage),
# optimizer offload 0.9, chunked LM head + cross-entropy. Sets the long-context knobs, then
# execs run_full_4k_thd_multinode.sh (which execs the base).
#
#   MASTER_ADDR=<node 0 address> NODE_RANK=<0..2> bash run_scripts/run_full_128k_thd_multinode.sh
#   DRY_RUN=1 MASTER_ADDR=x NODE_RANK=0 bash run_scripts/run_full_128k_thd_multinode.sh
# How long: as the 4k recipes plus a longer pack build; the 128k step time is not measured yet.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"

export PRIMUS_SEQ_LENGTH="${PRIMUS_SEQ_LENGTH:-131072}"
export PRIMUS_TP="${PRIMUS_TP:-1}"
export PRIMUS_PP="${PRIMUS_PP:-3}"
export PRIMUS_CP="${PRIMUS_CP:-8}"
export PRIMUS_EP="${PRIMUS_EP:-8}"
export PRIMUS_ETP="${PRIMUS_ETP:-1}"
export MBS="${MBS:-1}"
export GBS="${GBS:-3}"
export PRIMUS_OPTIMIZER_OFFLOAD_FRACTION="${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION:-0.9}"
# Unchunked, a rank's 16384 rows x 129280 vocab of bf16 logits are 4.2 GB (plus the loss's
# fp32 copy); chunks of FUSED_CE_CHUNK rows keep that at chunk x vocab.
export FUSED_LINEAR_CE="${FUSED_LINEAR_CE:-1}"
export FUSED_CE_CHUNK="${FUSED_CE_CHUNK:-4096}"
# Memory (`primus-v4 inspect memory`, printed by DRY_RUN=1), GiB per GPU, stages 0 / 1 / 2, sparse
# attention counted as primus_turbo's saved set (the largest auto may pick on a GPU):
#   MI300X (192 GiB): recompute selective layernorm,mla_up_proj,core_attn,moe, bf16 gradient
#     buckets: 156.7 / 129.2 / 133.9, 82% of 192; the recompute repeats 22.6-22.9% of the
#     layers' step FLOPs (and the MoE's all-to-all); no recompute plans 509.8 GiB on stage 0.
#   MI355X (288 GiB): the same recompute, fp32 buckets: 181.2 / 153.7 / 163.0, 63% of 288
#     (without core_attn, turbo's saved q, output and indices need 313 GiB on stage 0).
export PRIMUS_DEVICE_MEMORY="${PRIMUS_DEVICE_MEMORY:-MI300X}"
grad_buffers=bfloat16
if [[ "${PRIMUS_DEVICE_MEMORY^^}" == "MI355X" ]]; then
  grad_buffers=float32
fi
export PRIMUS_RECOMPUTE="${PRIMUS_RECOMPUTE:-selective}"
export PRIMUS_RECOMPUTE_MODULES="${PRIMUS_RECOMPUTE_MODULES:-layernorm,mla_up_proj,core_attn,moe}"
export PRIMUS_GRAD_ACCUM_DTYPE="${PRIMUS_GRAD_ACCUM_DTYPE:-${grad_buffers}}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv4_flash_128k_thd_${NNODES:-3}node}"

exec bash "$(dirname "${BASH_SOURCE[0]}")/run_full_4k_thd_multinode.sh" "$@"
