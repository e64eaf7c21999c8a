#!/usr/bin/env bash
# Device run for issue 10: kernel tests on the GPU, then kernel and attention benchmarks; JSON + logs in $OUT.
# Usage (device tool): bash scripts/gpu_kernels.sh [quick]
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -x tests/test_kernels_triton.py tests/test_kernels_reference.py 2>&1 | tee "$OUT/pytest.log" | tail -15
B="python3 -m sparsekv.bench.cli"
$B kernels --batch 8 --context 131072 --output "$OUT/kernels_128k_b8.json" 2>&1 | tee "$OUT/bench.log"
for cfg in "8 131072" "8 131077" "1 32768" "8 32768" "1 131072" "1 1048576"; do
  set -- $cfg
  $B attention --method spotlight --batch "$1" --context "$2" --budget 0.02 \
    --output "$OUT/attention_spotlight_b$1_n$2.json" 2>&1 | tee -a "$OUT/bench.log"
done
$B attention --method spotlight --batch 1 --context 32768 --budget 0.02 --shape default \
  --output "$OUT/attention_spotlight_default_b1_n32768.json" 2>&1 | tee -a "$OUT/bench.log"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("attention_*.json")):
    r = json.loads(f.read_text())
    st = {row["name"].split(" (")[0]: row["us"] for row in r["rows"]}
    print(f"{f.stem}: " + " | ".join(f"{k} {v:.1f}us" for k, v in st.items()) + f" | x{r['speedup_vs_dense']:.1f}")
k = json.loads((out / "kernels_128k_b8.json").read_text())
for row in k["rows"]:
    print(f"{row['name'][:44]:44s} {row['us']:9.1f} us {row['gbps']:7.0f} GB/s {row.get('pct_copy', 0):4.0f}%")
print("copy GB/s", round(k["copy_gbps"]))
PY
