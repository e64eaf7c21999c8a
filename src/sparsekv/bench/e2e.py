"""End-to-end decoding speed and memory: a whole model's prefill and decode steps, dense and a method, one run.

`run_e2e` builds a random-weight model of a real shape (no download), then for dense (SDPA over the same
preallocated SparseCache) and for the method:

- prefill: either the model's own forward over random prompt ids (`prefill="model"`; GemFilter's filter pass is
  part of it), or a synthetic fill (`prefill="synthetic"`): random bf16 K/V written into every layer's cache and
  handed to the selector exactly as the attention function does after a dense prefill (chunked). The synthetic
  fill is what makes 128K x B8 affordable: a real prefill of 1M tokens costs seconds per layer and tens of GB of
  activations, and decode speed does not depend on what the cached vectors are.
- decode: greedy steps at context N (TPOT = time per step, tokens/s = batch / TPOT), eager, and optionally one
  step captured in a CUDA graph and replayed (the replays re-run the captured step at a fixed cache length: the
  new token overwrites the same slot, which changes the context by one token out of N).
- memory: peak GPU memory above the weights during prefill and decode, and the bytes the cache holds.
- `compile`: the decode steps of both run through torch.compile (`compiled_forward`): the norms, projections,
  rotary embedding and MLP fuse into fewer kernels, the cache update and attention stay as they are.

`greedy_match` runs one model on CPU (the reference path) and on the GPU (the kernels), in float32 from the same
weights, and compares the greedy tokens of several methods: a random-weight model of the default model's shape, or
(`weights="real"`) the embedded default model itself.

The code sits in five modules: e2e_model (models, fit checks), e2e_measure (timing, memory), e2e_run
(prefill, decode, `run_e2e`), e2e_greedy (`greedy_match`) and e2e_suite (the device suite of
scripts/gpu_e2e.sh); this module is their public face.
"""

from __future__ import annotations

from sparsekv.bench.e2e_greedy import GREEDY_METHODS, GREEDY_TEXT, greedy_ids, greedy_match
from sparsekv.bench.e2e_measure import cache_bytes, profile_step
from sparsekv.bench.e2e_model import DEFAULT_SHAPE, MODELS, build_model, check_fits, fit_layers
from sparsekv.bench.e2e_run import (
    Setup,
    compiled_forward,
    model_prefill,
    run_e2e,
    run_one,
    summary_rows,
    synthetic_fill,
)
from sparsekv.bench.e2e_suite import GEMFILTER_LLAMA, device_suite, profile_lines, suite_table
from sparsekv.graph_decode import COMPILE_RECOMPILE_LIMIT

__all__ = [
    "COMPILE_RECOMPILE_LIMIT",
    "DEFAULT_SHAPE",
    "GEMFILTER_LLAMA",
    "GREEDY_METHODS",
    "GREEDY_TEXT",
    "MODELS",
    "Setup",
    "build_model",
    "cache_bytes",
    "check_fits",
    "compiled_forward",
    "device_suite",
    "fit_layers",
    "greedy_ids",
    "greedy_match",
    "model_prefill",
    "profile_lines",
    "profile_step",
    "run_e2e",
    "run_one",
    "suite_table",
    "summary_rows",
    "synthetic_fill",
]
