#!/usr/bin/env bash
# Several CPU ranks on one machine (gloo), tiny random-weight model, synthetic long-tail data.
# `accelerate launch --cpu --num_processes 4` starts ONE process; torchrun starts one per rank, and
# TrainingArguments(use_cpu=True) makes Trainer use gloo.
#
#   bash recipes/cpu_torchrun.sh [ranks] [family]        e.g.  bash recipes/cpu_torchrun.sh 4 qwen2_vl
set -euo pipefail
RANKS=${1:-4}
FAMILY=${2:-qwen2_vl}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# Balancing settings travel as environment variables too (they reach every rank):
export HF_DP_BALANCE_WARMUP_STEPS=${HF_DP_BALANCE_WARMUP_STEPS:-5}
exec torchrun --standalone --nproc_per_node "$RANKS" "$(dirname "$0")/sft_vlm.py" \
    --model "tiny:$FAMILY" --data synthetic --synthetic_samples 1024 \
    --output_dir "${OUTPUT_DIR:-/tmp/hf_dp_balance_cpu}" --use_cpu --max_steps 20 \
    --per_device_train_batch_size 8 --logging_steps 5 --save_strategy no --report_to none \
    --dp_balance --dp_balance_verbose
