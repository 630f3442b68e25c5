#!/usr/bin/env bash
# Three DeepSeek-V4 layers (dense, CSA, HCA; preset deepseek_v4_3layer) at 128k tokens per pack,
# packed (thd), on ONE node of 8 GPUs: TP1 PP1 CP8 EP8, chunked LM head + CE. Every attention
# kind and the context-parallel THD path at full length, without the full model's memory.
# Sets the single-node knobs, then execs run_full_4k_thd_multinode.sh (shared networking,
# tokenizer probing, cache dirs, validation and torchrun line).
#
#   bash run_scripts/run_128k_thd_packed.sh
#   DRY_RUN=1 bash run_scripts/run_128k_thd_packed.sh
# How long: the dry run takes seconds; a real run builds the 128k packs once per node, then runs
# TRAIN_STEPS steps (10 by default); its step time is not measured yet.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
export PRIMUS_RECIPE="${PRIMUS_RECIPE:-$0}"

export NNODES="${NNODES:-1}"
export NODE_RANK="${NODE_RANK:-0}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
export MASTER_PORT="${MASTER_PORT:-29518}"
# One node: keep bootstrap and gloo on loopback (RCCL still uses the GPUs' own links).
export SOCKET_IFNAME="${SOCKET_IFNAME:-lo}"
export PRIMUS_CONFIG="${PRIMUS_CONFIG:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/primus_v4/configs/runs/deepseek_v4_3layer_128k.yaml}"
export PRIMUS_MODEL_PRESET="${PRIMUS_MODEL_PRESET:-deepseek_v4_3layer}"
export PRIMUS_SEQ_LENGTH="${PRIMUS_SEQ_LENGTH:-131072}"
export PRIMUS_TP="${PRIMUS_TP:-1}"
export PRIMUS_PP="${PRIMUS_PP:-1}"
export PRIMUS_CP="${PRIMUS_CP:-8}"
export PRIMUS_EP="${PRIMUS_EP:-8}"
export PRIMUS_ETP="${PRIMUS_ETP:-1}"
export MBS="${MBS:-1}"
export GBS="${GBS:-1}"
export TRAIN_STEPS="${TRAIN_STEPS:-10}"
# Three layers' optimizer state fits on the GPUs; nothing to offload.
export PRIMUS_OPTIMIZER_OFFLOAD_FRACTION="${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION:-0.0}"
# Memory (`primus-v4 inspect memory`, printed by DRY_RUN=1): 55.4 GiB per GPU without recompute,
# 29% of an MI300X (192 GiB), 19% of an MI355X (288 GiB): no recompute on either.
export PRIMUS_RECOMPUTE="${PRIMUS_RECOMPUTE:-none}"
export FUSED_LINEAR_CE="${FUSED_LINEAR_CE:-1}"
export FUSED_CE_CHUNK="${FUSED_CE_CHUNK:-4096}"
export PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv4_3layer_128k_thd_cp8}"

exec bash "$(dirname "${BASH_SOURCE[0]}")/run_full_4k_thd_multinode.sh" "$@"
