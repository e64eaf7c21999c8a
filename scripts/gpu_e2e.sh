#!/usr/bin/env bash
# Device run for issue 9: the e2e fast-path check, then every acceptance configuration of `sparsekv bench e2e`
# (dense vs method in one process per config); JSON per config + log in $OUT, a short table last.
# Usage (device tool): bash scripts/gpu_e2e.sh [full|short|spotlight|self-index|profile]
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
