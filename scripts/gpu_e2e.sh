#!/usr/bin/env bash
# The whole-model decode runs of BENCHMARKS.md on one GPU: the CUDA fast-path tests of the decode selection,
# then `sparsekv.bench.e2e.device_suite` (each configuration of `sparsekv bench e2e`, dense vs the method, in one
# process, then `greedy_match`); JSON per configuration + log in $OUT, a table last.
# Usage: bash scripts/gpu_e2e.sh [full|short|spotlight|self-index|profile]   (plans: device_suite's docstring)
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -x -p no:cacheprovider tests/test_e2e.py -k "histogram_fast_path or host_budget" 2>&1 | tail -3
python3 - "$OUT" "${1:-full}" <<'PY' 2>&1 | tee "$OUT/e2e.log"
import json, sys
from sparsekv.bench.e2e import device_suite, profile_lines, suite_table
results = device_suite(sys.argv[1], sys.argv[2])
print(profile_lines(results))
table = suite_table(results)
open(f"{sys.argv[1]}/e2e_table.txt", "w").write(table + "\n")
print(table)
PY
