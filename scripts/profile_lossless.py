"""Where a lossless round's time goes: its draft step and its verification, each alone, at the fixed shapes of
the captured rounds (the embedded model's real weights, essay windows): the CUDA-graph replay's time of each,
the captured dense step's beside them, and per-kernel CUDA time of eager runs under torch.profiler.

Usage: python scripts/profile_lossless.py METHOD BUDGET CONTEXT BATCH DRAFTS [compile]
("compile": both steps run the model's forward through torch.compile, as with compile_step=True)
"""

import sys

import torch

from sparsekv import SparseConfig
from sparsekv.api import enabled
from sparsekv.bench.generate import embedded_prompts
from sparsekv.cache import SparseCache, layer_infos
from sparsekv.graph_decode import compile_for_decode
from sparsekv.lossless import CapturedRounds, Decoder, DraftCounts, RowTokens, Sampler, prefill, speculate
from sparsekv.models import load_model

method, budget, context, batch, drafts = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
compiled = sys.argv[6:] == ["compile"]
device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a check of this script, without timings
model, tokenizer = load_model("default", dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
ids = embedded_prompts(tokenizer, batch, context).to(device)
mask = torch.ones_like(ids)


def replay_ms(graph, replays: int = 20) -> float:
    if device == "cpu":
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def kernels(step, label: str, calls: int = 3) -> None:
    step()
    if device == "cpu":
        return
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / calls
    print(f"--- {label}: kernels {total / 1e3:.2f} ms a step, {sum(e.count for e in rows) // calls} launches")
    for e in rows[:16]:
        print(f"{e.device_time_total / calls:9.1f} us {e.count // calls:5d}x  {e.key[:110]}")


with torch.inference_mode(), enabled(model, SparseConfig(method=method, budget=budget), graph_decode=False):
    config = SparseConfig(method=method, budget=budget)
    cache = SparseCache(config, layer_infos(model), initial_capacity=context + 64)
    cache.fallback_threshold = 0  # the method's own step, as in lossless rounds
    logits = prefill(model, cache, ids, mask)
    decoder, sampler = Decoder(model, cache, mask), Sampler(None, None, ids.device)
    out = RowTokens(batch, 40, torch.tensor([]), ids.device)
    first = sampler.draw(logits)[0]
    out.add(first[:, None], torch.ones_like(first))
    counts = DraftCounts()
    speculate(decoder, sampler, first, drafts, out, counts)  # the first round: the methods' state from the prompt
    rounds = CapturedRounds(model, decoder, drafts, context + 64, out,
                            compile_for_decode(model.forward) if compiled else None)  # fmt: skip
    rounds.finish(rounds.launch(sampler, counts, drafts), out, counts)  # captures both graphs
    start = rounds.slot
    verify_inputs = rounds.verify_inputs[drafts]

    def draft():
        cache.fixed_position.fill_(start)
        return rounds._step("draft", rounds.draft_inputs, dense=False)

    def verify():
        cache.fixed_position.fill_(start)
        return rounds._step(f"verify{drafts}", verify_inputs, dense=True)

    times = {name: replay_ms(rounds.graphs.get(name, (None,))[0]) for name in ("draft", f"verify{drafts}")}
    rounds.path = "fixed-shape"
    kernels(draft, f"{method} {budget:g} draft step")
    kernels(verify, f"verification of {drafts} drafts")
    cache.fixed_dense = True  # the dense fallback: the captured dense step of the same cache
    draft()
    dense_graph = torch.cuda.CUDAGraph() if device == "cuda" else None
    if dense_graph is not None:
        with torch.cuda.graph(dense_graph):
            draft()
    times["dense step"] = replay_ms(dense_graph)
    kernels(draft, "dense step")
    print(f"{method} {budget:g} {context}x{batch}, {drafts} drafts, replays: "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items()))
