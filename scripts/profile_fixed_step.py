"""Per-kernel CUDA time of one fixed-shape decode step, eagerly under torch.profiler, at a synthetic-fill shape.

Usage: python scripts/profile_fixed_step.py METHOD CONTEXT BATCH LAYERS   (llama3-8b-random, bf16, budget 2%)
"""
import sys

import torch

from sparsekv import SparseConfig
from sparsekv.api import enabled
from sparsekv.bench.e2e import build_model, synthetic_fill
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs

method, context, batch, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = build_model("llama3-8b-random", layers=layers, dtype=torch.bfloat16, device="cuda")
config = SparseConfig(method=method) if method == "dense" else SparseConfig(method=method, budget=0.02)
with torch.inference_mode(), enabled(model, config) as runtime:
    cache = SparseCache.for_model(model, config, initial_capacity=context + 64)
    synthetic_fill(model, cache, batch, context)
    tok = torch.randint(0, 1000, (batch, 1), device="cuda")
    def step(fixed):
        n = cache.layers[0].length
        pos = torch.full((batch, 1), n, device="cuda")
        if fixed:
            cache.fixed_position.fill_(n)
            cache.prepare_fixed_step()
        out = model(input_ids=tok, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
        if fixed:
            cache.advance_fixed_shape()
        return out
    step(False)
    cache.begin_fixed_shape(context + 64)
    for _ in range(3):
        step(True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step(True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
