#!/usr/bin/env bash
# The method comparison of the README on a GPU (float32), where a 4K decode-faithful perplexity
# window takes about a second instead of minutes: ppl over the held-out essays (the part of the haystack that
# Spotlight's hash never saw), 7 windows of 4K, and NIAH up to 7K tokens. Stage the default model first
# (scripts/gpu_stage_default_model.sh) and, for NIAH, rouge-score with its dependencies for the device's Python
# (3.12): `pip download --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all:
# rouge-score nltk absl-py six regex joblib click tqdm`, each wheel unzipped into .stage/c/py (13 MB; carried).
# Outputs (JSON, markdown, plots) in $OUT.
# Usage: bash scripts/gpu_compare.sh [ppl|niah|all]   (WINDOWS=7 by default)
set -uo pipefail
source scripts/gpu_stage_default_model.sh
export PYTHONPATH=$PYTHONPATH:$PWD/.stage/c/py
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "from sparsekv.training.capture import haystack_split; open('$OUT/heldout.txt', 'w').write(haystack_split()[1])"
METHODS=dense,oracle-topk,quest,double-sparsity,lsh,spotlight,twilight,self-index,streaming,snapkv,h2o
C="python3 -m sparsekv.cli eval compare --device cuda --quiet --cache-dir /tmp/skv-eval"
if [ "${1:-all}" != niah ]; then
$C --task ppl --methods $METHODS --budgets 0.02,0.1 --context 4096 --prefix 3072 --windows ${WINDOWS:-7} \
  --text-file "$OUT/heldout.txt" --output "$OUT/compare_ppl_4k_heldout.json" 2>&1 | grep -v "Loading\|Converting\|Writing"
fi
if [ "${1:-all}" != ppl ]; then
$C --task niah --methods $METHODS --budgets 0.02,0.1 --lengths 1000,2000,4000,7000 --depths 0,0.5,1 \
  --output "$OUT/compare_niah_7k.json" 2>&1 | grep -v "Loading\|Converting\|Writing"
fi
rm -f "$OUT/heldout.txt"
