#!/usr/bin/env bash
# `sparsekv train-hash` for the embedded default model's Spotlight hash on a GPU machine without internet: the
# model comes from the staged copy (scripts/gpu_stage_default_model.sh), the genres from CORPUS (the files of
# scripts/calibration_corpus.py); checkpoint and report in $OUT.
# Usage: bash scripts/gpu_train_spotlight.sh CORPUS [STEPS] [TRAIN_WINDOWS]   (the shipped hash: 3000 48)
set -euo pipefail
C=${1:?usage: gpu_train_spotlight.sh CORPUS [STEPS] [TRAIN_WINDOWS]}
source scripts/gpu_stage_default_model.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m sparsekv.cli train-hash --model default --device cuda --hash mlp --bits 128 --seed 0 \
  --steps "${2:-3000}" --batch-queries 32 --window 4096 --train-windows "${3:-48}" \
  --text-files "$C/essays.txt" --text-files "$C/docs.txt" --text-files "$C/code.txt" \
  --eval-text-files "$C/persuasion.txt" --eval-text-files "$C/manpages.txt" --eval-windows 2 \
  --output "$OUT/spotlight-smollm2-135m.safetensors" --report "$OUT/train_report.json" 2>&1 | tail -40
