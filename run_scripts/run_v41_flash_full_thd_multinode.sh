#!/usr/bin/env bash
# Full DeepSeek-V4.1-Flash SFT at 4k tokens per pack, packed (thd), Engram frozen in its FP8
# release encoding and sharded by rows over each pipeline stage's ranks. The layout follows the
# device (PRIMUS_DEVICE_MEMORY), from the memory plan:
#   MI300X (192 GiB): 8 nodes x 8 GPUs, TP1 PP4 CP1 EP16 (DP16), optimizer offload 0.75
#   MI355X (288 GiB): 4 nodes x 8 GPUs, TP1 PP4 CP1 EP8 (DP8), optimizer offload 0.75
# Sets the V4.1 model, layout and Engram knobs, then execs run_full_4k_thd_multinode.sh (which
# execs the base). The release: PRIMUS_PRETRAINED=<dir>. 64k-128k packs with CP:
# run_v41_flash_full_128k_thd_multinode.sh.
#
#   MASTER_ADDR=<node 0> NODE_RANK=<0..7> bash run_scripts/run_v41_flash_full_thd_multinode.sh
#   DRY_RUN=1 MASTER_ADDR=x NODE_RANK=0 PRIMUS_DEVICE_MEMORY=MI355X bash run_scripts/run_v41_flash_full_thd_multinode.sh
# Memory (`primus-v4 inspect memory`, printed by DRY_RUN=1), GiB per GPU, stages 0 / 1 / 2 / 3,
# recompute selective layernorm,mla_up_proj,core_attn, fp32 gradient buckets, Engram ~6 GiB per
# GPU on the stages holding layers 1 and 14 (sharded; replicated it would be ~100 GB a table):
#   MI300X: 156.4 / 137.5 / 113.4 / 110.9, 81% of 192
#   MI355X: 236.5 / 217.6 / 187.7 / 185.1, 82% of 288
# How long: the dry run takes about a minute; the step time is not measured yet.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"
export PRIMUS_RELEASE_EXAMPLE="${PRIMUS_RELEASE_EXAMPLE:-/apps/DeepSeek-V4.1-Flash}"
export PRIMUS_TOKENIZER_PROBE_DIRS="${PRIMUS_TOKENIZER_PROBE_DIRS:-/apps/DeepSeek-V4.1-Flash:/models/DeepSeek-V4.1-Flash}"
here="$(dirname "${BASH_SOURCE[0]}")"

export PRIMUS_DEVICE_MEMORY="${PRIMUS_DEVICE_MEMORY:-MI300X}"
big=0
if [[ "${PRIMUS_DEVICE_MEMORY^^}" == "MI355X" ]]; then big=1; fi
export PRIMUS_CONFIG="${PRIMUS_CONFIG:-$(cd "${here}/.." && pwd)/primus_v4/configs/runs/deepseek_v41_flash_sft.yaml}"
export PRIMUS_MODEL_PRESET="${PRIMUS_MODEL_PRESET:-deepseek_v41_flash}"
export NNODES="${NNODES:-$((big ? 4 : 8))}"
export PRIMUS_TP="${PRIMUS_TP:-1}"
export PRIMUS_PP="${PRIMUS_PP:-4}"
export PRIMUS_CP="${PRIMUS_CP:-1}"
export PRIMUS_EP="${PRIMUS_EP:-$((big ? 8 : 16))}"
export GBS="${GBS:-$((NNODES * 8 * 4 / PRIMUS_PP / PRIMUS_CP))}" # 4 micro-batches per DP rank
export PRIMUS_OPTIMIZER_OFFLOAD_FRACTION="${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION:-0.75}"
export PRIMUS_RECOMPUTE="${PRIMUS_RECOMPUTE:-selective}"
export PRIMUS_RECOMPUTE_MODULES="${PRIMUS_RECOMPUTE_MODULES:-layernorm,mla_up_proj,core_attn}"
export PRIMUS_ENGRAM_PLACEMENT="${PRIMUS_ENGRAM_PLACEMENT:-sharded}" # replicated | sharded | host
export PRIMUS_ENGRAM_TRAINABLE="${PRIMUS_ENGRAM_TRAINABLE:-false}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv41_flash_$((${PRIMUS_SEQ_LENGTH:-4096} / 1024))k_thd_${NNODES}node}"

exec bash "${here}/run_full_4k_thd_multinode.sh" "$@"
