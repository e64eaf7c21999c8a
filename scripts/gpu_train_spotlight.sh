#!/usr/bin/env bash
# `sparsekv train-hash` for the embedded default model's Spotlight hashes on a GPU machine without internet: the
# model comes from the staged copy (scripts/gpu_stage_default_model.sh); checkpoint and report in $OUT.
# Usage: bash scripts/gpu_train_spotlight.sh [STEPS] [TRAIN_WINDOWS]   (defaults 400 and 8; the shipped hash: 3000 32)
set -euo pipefail
source scripts/gpu_stage_default_model.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m sparsekv.cli train-hash --model default --device cuda --hash mlp --bits 128 --seed 0 \
  --steps "${1:-400}" --train-windows "${2:-8}" --output "$OUT/spotlight-smollm2-135m.safetensors" \
  --report "$OUT/train_report.json" 2>&1 | tail -40
