#!/usr/bin/env bash
# Device run (issue 4): train the Spotlight hashes of the embedded default model on the GPU.
# Stage the default model first (scripts/gpu_stage_default_model.sh), then:
#   bash scripts/gpu_train_spotlight.sh STEPS TRAIN_WINDOWS
set -euo pipefail
source scripts/gpu_stage_default_model.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m sparsekv.cli train-hash --model default --device cuda --hash mlp --bits 128 --seed 0 \
  --steps "${1:-400}" --train-windows "${2:-8}" --output "$OUT/spotlight-smollm2-135m.safetensors" \
  --report "$OUT/train_report.json" 2>&1 | tail -40
