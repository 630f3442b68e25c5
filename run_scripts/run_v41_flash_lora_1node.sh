#!/usr/bin/env bash
# LoRA fine-tuning of DeepSeek-V4.1-Flash on ONE node of 8 GPUs, packed (thd): TP1 PP1 EP8, the
# base frozen as released (FP8 / FP4 bytes + ue8m0 scales, decoded one weight at a time), the
# Engram tables frozen in their FP8 encoding and sharded by rows over the 8 GPUs (a step fetches
# only the rows its packs hash to; PRIMUS_ENGRAM_PLACEMENT=host keeps them in host memory),
# rank-16 adapters on the attention projections and the shared and routed experts (one per
# expert). 4k packs (CP1, DP8) by default. Sets the V4.1 model, LoRA and Engram knobs, then execs
# run_lora_flash_1node.sh (which execs the base). The release: PRIMUS_PRETRAINED=<dir>.
#
#   PRIMUS_PRETRAINED=/apps/DeepSeek-V4.1-Flash bash run_scripts/run_v41_flash_lora_1node.sh
#   DRY_RUN=1 bash run_scripts/run_v41_flash_lora_1node.sh      # validate, print the memory plan
# How long: the dry run takes about a minute; the step time is not measured yet.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"
export PRIMUS_RELEASE_EXAMPLE="${PRIMUS_RELEASE_EXAMPLE:-/apps/DeepSeek-V4.1-Flash}"
export PRIMUS_TOKENIZER_PROBE_DIRS="${PRIMUS_TOKENIZER_PROBE_DIRS:-/apps/DeepSeek-V4.1-Flash:/models/DeepSeek-V4.1-Flash}"
here="$(dirname "${BASH_SOURCE[0]}")"

export PRIMUS_CONFIG="${PRIMUS_CONFIG:-$(cd "${here}/.." && pwd)/primus_v4/configs/runs/deepseek_v41_flash_sft.yaml}"
export PRIMUS_MODEL_PRESET="${PRIMUS_MODEL_PRESET:-deepseek_v41_flash}"
export PRIMUS_LORA_BASE="${PRIMUS_LORA_BASE:-release}"
export PRIMUS_ENGRAM_PLACEMENT="${PRIMUS_ENGRAM_PLACEMENT:-sharded}" # sharded | host
export PRIMUS_ENGRAM_TRAINABLE="${PRIMUS_ENGRAM_TRAINABLE:-false}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv41_flash_lora_$((${PRIMUS_SEQ_LENGTH:-4096} / 1024))k_1node}"

exec bash "${here}/run_lora_flash_1node.sh" "$@"
