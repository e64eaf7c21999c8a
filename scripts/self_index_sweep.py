"""Decode-faithful perplexity of self-index variants over several 4K haystack windows and rotation seeds.

One window's perplexity moves by up to ~0.4 with the rotation's seed alone (results/self_index.md), so options are
compared on the mean over windows x seeds, never on one run. Same protocol as scripts/self_index_eval.py's ppl
section (dense prefill of 3072 tokens, 1024 decoded in chunks of 256, budget 10%), float32.

    PYTHONPATH=src python scripts/self_index_sweep.py --device cuda --output runs/sweep.jsonl   # ~0.6 s a run (H200)
    python scripts/self_index_sweep.py --table runs/sweep.jsonl                                # ratios vs dense

On the device: stage the default model (scripts/gpu_stage_default_model.sh), then
`source scripts/gpu_stage_default_model.sh && python3 scripts/self_index_sweep.py --device cuda --output $OUT/s.jsonl`.
On CPU a run takes ~3-7 minutes: pass fewer --windows / --seeds / --variants.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

#: name -> (method, self-index options); "previous" = the defaults before k_rotate / v_clip (2026-11-21)
VARIANTS = {
    "dense": ("dense", {}),
    "oracle-topk": ("oracle-topk", {}),
    "default": ("self-index", {}),
    "previous": ("self-index", {"k_rotate": False, "v_clip": False}),
    "k_rotate only": ("self-index", {"v_clip": False}),
    "v_clip only": ("self-index", {"k_rotate": False}),
    "kv_bits=16": ("self-index", {"kv_bits": 16}),
    "kv_bits=16 no k_rotate": ("self-index", {"kv_bits": 16, "k_rotate": False}),
}
WINDOWS = (0, 8192, 16384, 24576, 32768, 40960, 49152, 57344, 65536)  # token offsets; 0 = the report window
SEEDS = (0x5E1F, 12345, 777)  # V_ROTATE_SEED: the rotation's signs (default first)


def run(args) -> None:
    import torch

    from sparsekv import SparseConfig
    from sparsekv.eval.common import ModelHandle
    from sparsekv.eval.ppl import PplSettings, run_ppl
    from sparsekv.models import load_model
    from sparsekv.selectors.self_index import rotation

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on the GPU too
    model, tokenizer = load_model("default", dtype=torch.float32, device=args.device)
    handle = ModelHandle(model=model, tokenizer=tokenizer, name="default")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("a") as out:
        for name in args.variants.split(","):
            method, options = VARIANTS[name]
            seeds = args.seeds if method == "self-index" else args.seeds[:1]  # the others do not rotate
            config = SparseConfig(method=method, budget=0.1, options=options)
            for seed in seeds:
                rotation.V_ROTATE_SEED = seed
                rotation._ROTATION_BASE.clear()  # the QR base (head_dim not a power of two) depends on it
                for start in args.windows:
                    begin = time.perf_counter()
                    settings = PplSettings(context=4096, prefix=3072, chunk=256, windows=1, start=start)
                    result = run_ppl(handle, config, settings)
                    row = {"variant": name, "method": method, "options": options, "window": start, "seed": seed,
                           "ppl": result["ppl"], "budget": result.get("avg_budget_fraction"),
                           "device": args.device, "seconds": round(time.perf_counter() - begin, 1)}  # fmt: skip
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")
    rotation.V_ROTATE_SEED = SEEDS[0]


def table(path: Path) -> str:
    """Mean ppl / dense per window (over seeds), then the mean and worst window, and window 0 per seed."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    dense = {r["window"]: r["ppl"] for r in rows if r["variant"] == "dense"}
    ratios = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["variant"] != "dense" and r["window"] in dense:
            ratios[r["variant"]][r["window"]][r["seed"]] = r["ppl"] / dense[r["window"]]
    windows = sorted(dense)
    head = (
        "| variant | " + " | ".join(f"{w // 1024}K" for w in windows) + " | mean | worst | window 0 by seed |"
    )
    lines = [head, "|" + "---|" * (len(windows) + 4)]
    for name, per_window in ratios.items():
        means = [statistics.mean(per_window[w].values()) for w in windows if per_window[w]]
        if len(means) != len(windows):
            continue
        seeds = " / ".join(f"{v:.3f}" for v in per_window[0].values()) if 0 in per_window else "-"
        lines.append(f"| {name} | " + " | ".join(f"{m:.3f}" for m in means)
                     + f" | **{statistics.mean(means):.4f}** | {max(means):.3f} | {seeds} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", type=Path, default=Path("runs/self_index_sweep.jsonl"), help="rows appended"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--windows", default=",".join(map(str, WINDOWS)), help="token offsets of the 4K windows"
    )
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="rotation seeds (self-index runs)")
    parser.add_argument("--table", type=Path, help="print the table of a rows file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    args.windows = [int(w) for w in args.windows.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    run(args)


if __name__ == "__main__":
    main()
