"""Whole-model decode TPOT of two source trees on one GPU: a change's before / after on the same device.

Each (configuration, tree) runs `run_e2e` (dense and METHOD, CUDA graph) in its own process, the trees
alternating, so both see the same machine; dense is measured in every run, so its spread between runs shows the
noise. Prints one line per run and a table last; JSON lines in $OUT/ab_e2e.jsonl when OUT is set.

    python3 scripts/gpu_ab_e2e.py BEFORE_SRC AFTER_SRC [128k_b8,32k_b1,32k_b8] [METHOD]   (METHOD: spotlight)

BEFORE_SRC / AFTER_SRC: directories that hold the `sparsekv` package (e.g. `src`, and an old revision's `src`
exported with `git archive REV src | tar -x -C /tmp/before`). A tree written `DIR:compile` runs its decode steps
(dense and METHOD) through torch.compile: `src src:compile` measures what compiling gives.
"""

import json
import os
import subprocess
import sys

CONFIGS = {"128k_b8": (131072, 8), "32k_b1": (32768, 1), "32k_b8": (32768, 8)}

RUN = r"""
import json, sys
from sparsekv.bench.e2e import fit_layers, run_e2e
context, batch, method, compile = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
layers = fit_layers(batch, context) if context * batch > 32768 * 8 else 32
r = run_e2e("llama3-8b-random", layers=layers, context=context, batch=batch, method=method, budget=0.02,
            cuda_graph=True, new_tokens=16, **({"compile": True} if compile else {}))
d, m = r["runs"]["dense"], r["runs"]["method"]
print("RESULT " + json.dumps({"device": r["device"], "layers": layers, "dense_ms": d["tpot_graph_ms"],
                              "method_ms": m["tpot_graph_ms"], "ratio": r["ratios"]["tpot_speedup_graph"]}))
"""


def run(tree: str, context: int, batch: int, method: str) -> dict:
    src, _, mode = tree.partition(":")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "PYTHONUNBUFFERED": "1"}
    args = [str(context), str(batch), method, "1" if mode == "compile" else "0"]
    proc = subprocess.run([sys.executable, "-c", RUN, *args], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (proc.stdout + proc.stderr)[-1500:]}


def main() -> None:
    before, after = sys.argv[1], sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CONFIGS)
    method = sys.argv[4] if len(sys.argv) > 4 else "spotlight"
    rows = []
    for name in names:
        context, batch = CONFIGS[name]
        for label, src in (("before", before), ("after", after)):
            result = {"config": name, "tree": label, "method": method, **run(src, context, batch, method)}
            rows.append(result)
            print(json.dumps(result), flush=True)
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], "ab_e2e.jsonl"), "a") as f:
                    f.write(json.dumps(result) + "\n")
    print(f"{'config':8s} {'tree':7s} {'layers':>6s} {'dense ms':>9s} {method + ' ms':>14s} {'x':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:8s} {r['tree']:7s} ERROR {r['error'][-300:]}")
        else:
            print(f"{r['config']:8s} {r['tree']:7s} {r['layers']:6d} {r['dense_ms']:9.2f} {r['method_ms']:14.2f} "
                  f"{r['ratio']:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
