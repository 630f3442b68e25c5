#!/usr/bin/env bash
# LoRA fine-tuning of DeepSeek-V4-Flash on ONE node of 8 GPUs, packed (thd): TP1 PP1 EP8, the
# base frozen as released (FP8 / FP4 bytes, decoded one weight at a time; PRIMUS_LORA_BASE=bfloat16
# decodes it once into bf16 instead), rank-16 adapters on the attention projections and the shared
# and routed experts (one per expert). 4k packs (CP1, DP8) by default; PRIMUS_SEQ_LENGTH=32768
# switches to 32k packs over CP8 (DP1). Sets the LoRA and single-node knobs, then execs
# run_full_4k_thd_multinode.sh (which execs the base). The release: PRIMUS_PRETRAINED=<dir>.
#
#   PRIMUS_PRETRAINED=/apps/DeepSeek-V4-Flash bash run_scripts/run_lora_flash_1node.sh
#   PRIMUS_SEQ_LENGTH=32768 bash run_scripts/run_lora_flash_1node.sh
#   DRY_RUN=1 bash run_scripts/run_lora_flash_1node.sh      # validate, print the memory plan
# How long: the dry run takes seconds; the step time is not measured yet.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"

export NNODES="${NNODES:-1}"
export PRIMUS_SEQ_LENGTH="${PRIMUS_SEQ_LENGTH:-4096}"
long=0
if ((PRIMUS_SEQ_LENGTH > 8192)); then long=1; fi
export PRIMUS_PP="${PRIMUS_PP:-1}"
export PRIMUS_EP="${PRIMUS_EP:-8}"
export PRIMUS_CP="${PRIMUS_CP:-$((long ? 8 : 1))}"
export GBS="${GBS:-$((long ? 4 : 8))}" # 4k: one pack per DP rank; 32k: 4 micro-batches
export PRIMUS_LORA_RANK="${PRIMUS_LORA_RANK:-16}"
export PRIMUS_LORA_ALPHA="${PRIMUS_LORA_ALPHA:-32}"
export PRIMUS_LORA_BASE="${PRIMUS_LORA_BASE:-release}"
export PRIMUS_LR="${PRIMUS_LR:-1.0e-4}"
# Adapter state is small: no optimizer offload.
export PRIMUS_OPTIMIZER_OFFLOAD_FRACTION="${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION:-0}"
export FUSED_LINEAR_CE="${FUSED_LINEAR_CE:-1}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv4_flash_lora_$((PRIMUS_SEQ_LENGTH / 1024))k_1node}"

exec bash "$(dirname "${BASH_SOURCE[0]}")/run_full_4k_thd_multinode.sh" "$@"
