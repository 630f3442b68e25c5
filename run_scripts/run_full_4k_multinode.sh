#!/usr/bin/env bash
# Full DeepSeek-V4-Flash SFT at 4k tokens per row, unpacked (bshd: one sample per padded row),
# 3 nodes x 8 GPUs: TP1 PP3 CP1 EP8 (DP8), optimizer offload 0.75. The base every other
# multi-node recipe execs into; the packed (thd) variant is run_full_4k_thd_multinode.sh.
#
# Run on every node (same command, own NODE_RANK):
#   MASTER_ADDR=<node 0 address> NODE_RANK=<0..2> bash run_scripts/run_full_4k_multinode.sh
# Check first, on any machine (validates the config for 24 ranks, prints JSON + command):
#   DRY_RUN=1 MASTER_ADDR=x NODE_RANK=0 bash run_scripts/run_full_4k_multinode.sh
# How long: the dry run takes seconds. A real run spends its first minutes on data preparation
# and model build, then TRAIN_STEPS steps (20 by default); the step time at this layout is not
# measured yet (see README_thd_packed.md, Results).
# Every knob below is ${VAR:-default}: export it (or prefix it) to change it.
set -euo pipefail
# shellcheck source=lib/int_knobs.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/int_knobs.sh" # integer knobs checked before any arithmetic
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# --- rendezvous: one torchrun agent per node -----------------------------------------------
NNODES="${NNODES:-3}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_PORT="${MASTER_PORT:-29710}"
primus_check_rendezvous # needs MASTER_ADDR and NODE_RANK when NNODES > 1
# Elastic (run_scripts/lib/launch.sh): PRIMUS_MAX_RESTARTS=N > 0 launches with torchrun's c10d
# rendezvous; a failed worker restarts the group, which resumes the newest checkpoint.
PRIMUS_MAX_RESTARTS="${PRIMUS_MAX_RESTARTS:-0}"
# A collective stuck this long fails (and restarts the group): keep it under the scheduler's
# limits. Empty = the config's parallel.collective_timeout_s (1800).
PRIMUS_COLLECTIVE_TIMEOUT_S="${PRIMUS_COLLECTIVE_TIMEOUT_S:-}"

# --- networking (RCCL/NCCL and gloo); empty = library autodetection ------------------------
SOCKET_IFNAME="${SOCKET_IFNAME:-}"         # e.g. ens50f0: NIC for bootstrap, gloo and sockets
NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}"    # 1 = no RDMA (RoCE/IB), sockets only
NCCL_IB_HCA="${NCCL_IB_HCA:-}"             # RoCE devices, e.g. mlx5_0:1,mlx5_1:1 or ionic_0:1,...
NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-}" # RoCE v2 GID index of the fabric (often 3 or 1)
primus_export_network

# --- parallel layout (world = PP x CP x DP; experts over EP) --------------------------------
PRIMUS_TP="${PRIMUS_TP:-1}"
PRIMUS_PP="${PRIMUS_PP:-3}"
PRIMUS_CP="${PRIMUS_CP:-1}"
PRIMUS_EP="${PRIMUS_EP:-8}"
PRIMUS_ETP="${PRIMUS_ETP:-1}"
PRIMUS_PP_LAYOUT="${PRIMUS_PP_LAYOUT:-}" # e.g. Et*14|t*14|t*15mL; empty = even split

# --- model, batch, optimizer -----------------------------------------------------------------
PRIMUS_CONFIG="${PRIMUS_CONFIG:-${PRIMUS_REPO_ROOT}/primus_v4/configs/runs/deepseek_v4_flash_sft.yaml}"
PRIMUS_MODEL_PRESET="${PRIMUS_MODEL_PRESET:-deepseek_v4_flash}"
PRIMUS_NUM_LAYERS="${PRIMUS_NUM_LAYERS:-}"         # empty = the preset's
PRIMUS_COMPRESS_RATIOS="${PRIMUS_COMPRESS_RATIOS:-}" # YAML list, e.g. [0,4,128]; empty = preset's
PRIMUS_NUM_EXPERTS="${PRIMUS_NUM_EXPERTS:-}"
PRIMUS_MOE_TOPK="${PRIMUS_MOE_TOPK:-}"
PRIMUS_MTP_NUM_LAYERS="${PRIMUS_MTP_NUM_LAYERS:-}"
PRIMUS_DTYPE="${PRIMUS_DTYPE:-bfloat16}"
PRIMUS_SEQ_LENGTH="${PRIMUS_SEQ_LENGTH:-4096}"
MBS="${MBS:-1}"
GBS="${GBS:-24}" # 3 rows per DP rank per step: one per pipeline stage keeps PP3 busy
TRAIN_STEPS="${TRAIN_STEPS:-20}"
PRIMUS_LR="${PRIMUS_LR:-1.0e-6}"
PRIMUS_SEED="${PRIMUS_SEED:-1234}"
PRIMUS_OPTIMIZER_OFFLOAD_FRACTION="${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION:-0.75}"
FUSED_LINEAR_CE="${FUSED_LINEAR_CE:-0}" # 1 = chunked LM head + CE (no [S, vocab] logits)
FUSED_CE_CHUNK="${FUSED_CE_CHUNK:-}"    # rows per CE chunk; empty = the preset's

# --- memory: activation recompute and gradient buffers, per device ---------------------------
# The plan (`primus-v4 inspect memory`; DRY_RUN=1 prints it and a real launch stops when a stage
# does not fit, PRIMUS_IGNORE_MEMORY_PLAN=1 overrides), GiB per GPU, pipeline stages 0 / 1 / 2,
# sparse attention counted as primus_turbo's saved set (the largest auto may pick on a GPU):
#   MI300X (192 GiB): recompute selective layernorm,mla_up_proj,core_attn, fp32 gradient
#     buckets: 163.3 / 143.9 / 160.4, 85% of 192 on stage 0; the recompute repeats 6.0-6.2% of
#     the layers' step FLOPs (no recompute: 221.5 GiB, 115%).
#   MI355X (288 GiB): no recompute, fp32 buckets: 221.5 / 182.2 / 181.7, 77% of 288.
PRIMUS_DEVICE_MEMORY="${PRIMUS_DEVICE_MEMORY:-MI300X}" # MI300X, MI308X, MI355X or GiB
recompute=selective modules=layernorm,mla_up_proj,core_attn
if [[ "${PRIMUS_DEVICE_MEMORY^^}" == "MI355X" ]]; then
  recompute=none modules=
fi
PRIMUS_RECOMPUTE="${PRIMUS_RECOMPUTE:-${recompute}}"                # none | selective | full
PRIMUS_RECOMPUTE_MODULES="${PRIMUS_RECOMPUTE_MODULES:-${modules}}" # selective: comma-separated
PRIMUS_GRAD_ACCUM_DTYPE="${PRIMUS_GRAD_ACCUM_DTYPE:-float32}"      # float32 | bfloat16 buckets

# --- LoRA: adapters on the release's modules, the base frozen (rank 0 = full fine-tuning) -----
PRIMUS_LORA_RANK="${PRIMUS_LORA_RANK:-0}"
PRIMUS_LORA_ALPHA="${PRIMUS_LORA_ALPHA:-16}"
PRIMUS_LORA_TARGETS="${PRIMUS_LORA_TARGETS:-}"                # comma-separated; empty = default
PRIMUS_LORA_EXPERTS="${PRIMUS_LORA_EXPERTS:-per_expert}"      # per_expert | shared
PRIMUS_LORA_BASE="${PRIMUS_LORA_BASE:-bfloat16}"              # bfloat16 | release (FP8/FP4 kept)
# Adapters on random weights (no PRIMUS_PRETRAINED) are refused unless this is 1.
PRIMUS_LORA_ALLOW_RANDOM_BASE="${PRIMUS_LORA_ALLOW_RANDOM_BASE:-0}"
# DeepSeek-V4.1's Engram tables (empty = the config's: frozen, replicated)
PRIMUS_ENGRAM_PLACEMENT="${PRIMUS_ENGRAM_PLACEMENT:-}" # replicated | sharded | host
PRIMUS_ENGRAM_TRAINABLE="${PRIMUS_ENGRAM_TRAINABLE:-}" # false | true

# --- data: corpus, packing, node-local cache ---------------------------------------------------
PRIMUS_DATA_PATH="${PRIMUS_DATA_PATH:-tatsu-lab/alpaca}" # file, dir, hub name or `synthetic`
PRIMUS_DATA_FORMAT="${PRIMUS_DATA_FORMAT:-auto}" # messages, sharegpt, alpaca, prompt_completion
PRIMUS_CHAT_MODE="${PRIMUS_CHAT_MODE:-auto}"     # chat, thinking, auto (thinking if reasoning)
PRIMUS_DATA_LAYOUT="${PRIMUS_DATA_LAYOUT:-bshd}" # thd = packed (run_full_4k_thd_multinode.sh)
PRIMUS_PACK_ALGORITHM="${PRIMUS_PACK_ALGORITHM:-ffd}"
# Node-local scratch, per user: a shared filesystem here gives NFS lock errors (ESTALE) and
# cross-node cache races; a shared /tmp name collides between users.
PRIMUS_LOCAL_ROOT="${PRIMUS_LOCAL_ROOT:-${TMPDIR:-/tmp}/primus_v4-$(id -u)}"
PRIMUS_PACK_CACHE_DIR="${PRIMUS_PACK_CACHE_DIR:-${PRIMUS_LOCAL_ROOT}/packs}"
PRIMUS_PACK_LOCK_DIR="${PRIMUS_PACK_LOCK_DIR:-${PRIMUS_LOCAL_ROOT}/locks}"
export HF_DATASETS_CACHE="${HF_DATASETS_CACHE:-${PRIMUS_LOCAL_ROOT}/hf_datasets}"

# --- tokenizer: V4_TOKENIZER, else the first probe dir with tokenizer.json, else bundled ------
V4_TOKENIZER="${V4_TOKENIZER:-}"
PRIMUS_TOKENIZER_PROBE_DIRS="${PRIMUS_TOKENIZER_PROBE_DIRS:-/apps/DeepSeek-V4-Flash:/apps/DeepSeek-V4-Flash-FP8:/models/DeepSeek-V4-Flash}"
PRIMUS_ALLOW_BUNDLED_TOKENIZER="${PRIMUS_ALLOW_BUNDLED_TOKENIZER:-1}"
primus_probe_tokenizer

# --- outputs: run dir (shared filesystem, for checkpoints) and this node's log ---------------
PRIMUS_EXP_NAME="${PRIMUS_EXP_NAME:-dsv4_flash_4k_${NNODES}node}"
PRIMUS_OUTPUT_DIR="${PRIMUS_OUTPUT_DIR:-${PRIMUS_REPO_ROOT}/outputs/${PRIMUS_EXP_NAME}}"
PRIMUS_CKPT_DIR="${PRIMUS_CKPT_DIR:-${PRIMUS_OUTPUT_DIR}/checkpoints}"
PRIMUS_CKPT_INTERVAL="${PRIMUS_CKPT_INTERVAL:-0}" # 0 = only at the end
PRIMUS_NODE_LOG="${PRIMUS_NODE_LOG:-${PRIMUS_OUTPUT_DIR}/log_node${NODE_RANK}.txt}"

primus_add_set train.steps "${TRAIN_STEPS}"
primus_add_set train.seed "${PRIMUS_SEED}"
primus_add_set train.lr "${PRIMUS_LR}"
primus_add_set train.global_batch_size "${GBS}"
primus_add_set train.micro_batch_size "${MBS}"
primus_add_set data.path "${PRIMUS_DATA_PATH}"
primus_add_set data.format "${PRIMUS_DATA_FORMAT}"
primus_add_set data.chat_mode "${PRIMUS_CHAT_MODE}"
primus_add_set data.seq_length "${PRIMUS_SEQ_LENGTH}"
primus_add_set data.layout "${PRIMUS_DATA_LAYOUT}"
primus_add_set data.algorithm "${PRIMUS_PACK_ALGORITHM}"
primus_add_set data.cache_dir "${PRIMUS_PACK_CACHE_DIR}"
primus_add_set data.lock_dir "${PRIMUS_PACK_LOCK_DIR}"
primus_add_set_if data.tokenizer "${PRIMUS_TOKENIZER_DIR}"
primus_add_set model.preset "${PRIMUS_MODEL_PRESET}"
primus_add_set model.dtype "${PRIMUS_DTYPE}"
primus_add_set model.fused_linear_ce "$([[ "${FUSED_LINEAR_CE}" == "1" ]] && echo true || echo false)"
primus_add_set_if model.overrides.num_layers "${PRIMUS_NUM_LAYERS}"
primus_add_set_if model.overrides.compress_ratios "${PRIMUS_COMPRESS_RATIOS}"
primus_add_set_if model.overrides.num_moe_experts "${PRIMUS_NUM_EXPERTS}"
primus_add_set_if model.overrides.moe_router_topk "${PRIMUS_MOE_TOPK}"
primus_add_set_if model.overrides.mtp_num_layers "${PRIMUS_MTP_NUM_LAYERS}"
primus_add_set_if model.overrides.ce_chunk_size "${FUSED_CE_CHUNK}"
primus_add_set parallel.tp "${PRIMUS_TP}"
primus_add_set parallel.pp "${PRIMUS_PP}"
primus_add_set parallel.cp "${PRIMUS_CP}"
primus_add_set parallel.ep "${PRIMUS_EP}"
primus_add_set parallel.etp "${PRIMUS_ETP}"
primus_add_set_if parallel.pp_layout "${PRIMUS_PP_LAYOUT}"
primus_add_set_if parallel.collective_timeout_s "${PRIMUS_COLLECTIVE_TIMEOUT_S}"
primus_add_set optim.offload_fraction "${PRIMUS_OPTIMIZER_OFFLOAD_FRACTION}"
primus_add_set optim.grad_accum_dtype "${PRIMUS_GRAD_ACCUM_DTYPE}"
primus_add_set model.recompute "${PRIMUS_RECOMPUTE}"
if [[ "${PRIMUS_RECOMPUTE}" == "selective" && -n "${PRIMUS_RECOMPUTE_MODULES}" ]]; then
  primus_add_set model.recompute_modules "[${PRIMUS_RECOMPUTE_MODULES}]"
fi
if [[ "${PRIMUS_LORA_RANK}" != "0" ]]; then
  primus_add_set model.lora.rank "${PRIMUS_LORA_RANK}"
  primus_add_set model.lora.alpha "${PRIMUS_LORA_ALPHA}"
  primus_add_set model.lora.expert_adapters "${PRIMUS_LORA_EXPERTS}"
  primus_add_set model.lora.base "${PRIMUS_LORA_BASE}"
  if [[ "${PRIMUS_LORA_ALLOW_RANDOM_BASE}" == "1" ]]; then
    primus_add_set model.lora.allow_random_base true
  fi
  if [[ -n "${PRIMUS_LORA_TARGETS}" ]]; then
    primus_add_set model.lora.targets "[${PRIMUS_LORA_TARGETS}]"
  fi
fi
primus_add_set_if model.engram.placement "${PRIMUS_ENGRAM_PLACEMENT}"
primus_add_set_if model.engram.trainable "${PRIMUS_ENGRAM_TRAINABLE}"
primus_add_set output.dir "${PRIMUS_OUTPUT_DIR}"
primus_add_set checkpoint.dir "${PRIMUS_CKPT_DIR}"
primus_add_set checkpoint.interval "${PRIMUS_CKPT_INTERVAL}"

primus_run
