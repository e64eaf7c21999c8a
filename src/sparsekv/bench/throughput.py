"""`sparsekv bench throughput`: under one GPU memory limit, the largest batch each row fits and the decode speed of
`model.generate()` at that batch (dense at its largest batch against each method at its own).

For every row (the rows of `sparsekv bench generate`: `hf-dense`, sparsekv's `dense`, methods, `<method>@eager`;
not `hf-static-compile`, which would compile again for every batch the search tries):

- the largest batch is found by allocating, not computed: `largest_fitting_batch` doubles the batch from 1 until a
  run does not fit, then bisects between the last batch that fit and the first that did not. A batch "fits" when
  its whole measured run — `time_generate` of bench/generate.py, the same prompt length, new tokens and warmup as
  the reported numbers — finishes under the limit without torch.OutOfMemoryError (a CUDA graph capture that ran
  out of memory and fell back to eager decoding counts as not fitting: the row would not run as it is meant to).
- the limit is `torch.cuda.set_per_process_memory_fraction`: torch's allocator refuses to hold more than the limit,
  weights included, as a GPU of that size would (the CUDA context and other processes are outside it).
- the prompt is prefilled with transformers' chunked prefill (`prefill_chunk_size`), the whole batch at once: the
  prompt's activations grow with batch x chunk, not batch x context, so with a chunk small next to the context the
  KV cache, not the prefill, decides the batch. With `prefill="synthetic"` the prompt's K/V are written into the
  cache instead (random, layer by layer) and generate() continues from it: the same cache and decode steps,
  without the minutes a long context's prefill takes for every batch tried.
- the numbers reported for a row (TPOT, tokens/s, peak memory) are those of its run at its largest batch: the run
  that showed the batch fits is the measurement (one run per batch tried; the other batches' runs give the plot's
  curve of tokens/s against batch).

The search and the summary take the measuring function as a parameter, so that they run on CPU in the tests with
an injected one; a real run needs a CUDA device (a CPU has no allocation limit to measure).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from pathlib import Path

import torch

from sparsekv.bench.generate import (
    HF_ROWS,
    check_prefill,
    config_for,
    method_of,
    run_environment,
    time_generate,
)
from sparsekv.config import ConfigError

DEFAULT_ROWS = ("hf-dense", "dense", "spotlight", "quest", "self-index")
#: a row's measuring function: (row, batch) -> a `time_generate` result; an "error" key means it did not fit
Measure = Callable[[str, int], dict]


def is_dense_row(row: str) -> bool:
    """Whether a row keeps every token: the reference each method's tokens/s is compared with. hf-dense, or
    sparsekv's dense step however it runs (`dense`, `dense@eager`, `dense@compile`)."""
    return row == "hf-dense" or (row not in HF_ROWS and method_of(row) == "dense")


def largest_fitting_batch(fits: Callable[[int], bool], upper: int) -> int:
    """The largest batch in [1, upper] for which `fits` is true, 0 when batch 1 does not fit; assumes that a batch
    fits when a larger one does. Doubling first keeps the tries near the answer (each try is a whole run), and no
    batch is tried twice."""
    if upper < 1:
        raise ConfigError(f"the largest batch to try must be >= 1, got {upper}")
    if not fits(1):
        return 0
    fitting, failing = 1, None
    while fitting < upper:
        candidate = min(2 * fitting, upper)
        if not fits(candidate):
            failing = candidate
            break
        fitting = candidate
    if failing is None:
        return fitting  # `upper` fits: the search stops there
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return fitting


def search_row(row: str, measure: Measure, upper: int) -> dict:
    """`row`'s largest fitting batch (at most `upper`) and its measurement there, with every batch tried."""
    tries: dict[int, dict] = {}

    def fits(batch: int) -> bool:
        tries[batch] = measure(row, batch)
        return "error" not in tries[batch]

    best = largest_fitting_batch(fits, upper)
    failed = sorted(batch for batch, result in tries.items() if "error" in result)
    result = {
        "row": row,
        "max_batch": best,
        "capped": best == upper,
        "first_oom_batch": failed[0] if failed else None,
    }
    if best == 0:
        result["error"] = f"batch 1 does not fit: {tries[1]['error']}"
    else:
        result |= {k: v for k, v in tries[best].items() if k != "row"}
    result["tries"] = [
        {"batch": batch, **({"error": r["error"]} if "error" in r else
                            {k: r.get(k) for k in ("tpot_ms", "tokens_per_s", "peak_bytes")})}
        for batch, r in sorted(tries.items())
    ]  # fmt: skip
    return result


def summarize(rows: list[dict]) -> tuple[str | None, list[dict]]:
    """(the reference row, `rows` each with `vs_dense`): tokens/s over that of the fastest dense row (hf-dense or
    sparsekv's dense step, `is_dense_row`, each at its own largest batch); None where a row or the reference has no
    measurement."""
    dense = [r for r in rows if is_dense_row(r["row"]) and r.get("tokens_per_s")]
    reference = max(dense, key=lambda r: r["tokens_per_s"]) if dense else None
    summary = []
    for r in rows:
        ratio = r["tokens_per_s"] / reference["tokens_per_s"] if reference and r.get("tokens_per_s") else None
        summary.append({**r, "vs_dense": ratio})
    return (reference["row"] if reference else None), summary


def throughput_search(rows: tuple[str, ...], measure: Measure, max_batch: int) -> dict:
    """Every row's search with `measure`, then the summary: {"reference_row", "rows"}."""
    reference, summary = summarize([search_row(row, measure, max_batch) for row in rows])
    return {"reference_row": reference, "rows": summary}


def check_rows(rows: tuple[str, ...], budget: float, top_p: float | None,
               dense_layers: tuple[int, ...] | None = None) -> None:  # fmt: skip
    """Unknown rows and bad method settings: one ConfigError each, before any model is built."""
    from sparsekv.registry import get_method_class

    if not rows:
        raise ConfigError("--rows names no row; e.g. hf-dense,dense,self-index")
    for row in rows:
        if row == "hf-static-compile":
            raise ConfigError("hf-static-compile is not a row of bench throughput: it would compile again for "
                              "every batch the search tries; use hf-dense or dense as the dense rows")  # fmt: skip
        if row not in HF_ROWS:
            get_method_class(method_of(row))  # unknown names: one ConfigError listing the methods
            config_for(row, budget, top_p, dense_layers=dense_layers)  # bad settings for a method: its ConfigError


def memory_limit_bytes(memory_gb: float | None, total: int, free: int) -> int:
    """The limit in bytes: `memory_gb`, or all the free memory when None. Above the device's memory, or above what
    is free (the search would measure the other processes, not the limit), it is refused."""
    if memory_gb is None:
        return free
    limit = int(memory_gb * 1e9)
    if limit > total:
        raise ConfigError(f"--memory-gb {memory_gb:g} is above the device's {total / 1e9:.1f} GB")
    if limit > free:
        raise ConfigError(f"--memory-gb {memory_gb:g} is above the {free / 1e9:.1f} GB free on the device (of "
                          f"{total / 1e9:.1f} GB: the CUDA context and other processes hold the rest)")  # fmt: skip
    return limit


@contextlib.contextmanager
def memory_limit(device: torch.device, limit: int):
    """Torch's allocator refuses (torch.OutOfMemoryError) to hold more than `limit` bytes on `device` inside."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _out_of_memory(message: str) -> bool:
    return "OutOfMemoryError" in message or "out of memory" in message.lower()


def gpu_measure(net, *, context: int, seed: int, prefill: str = "model", progress=None, **timing) -> Measure:
    """The real measuring function: `time_generate` of a batch of random prompts (prefilled as `prefill` says);
    a capture that ran out of memory (graph_decode then decodes eagerly) is reported as not fitting. Memory is
    freed after every try. `progress` is told each try's outcome in a line."""

    def measure(row: str, batch: int) -> dict:
        ids = None
        try:
            generator = torch.Generator().manual_seed(seed)  # the same prompts for every row
            # a synthetic prefill caches `context` tokens: generate() takes them plus the one it feeds first
            length = context + (prefill == "synthetic")
            ids = torch.randint(3, net.config.vocab_size, (batch, length), generator=generator)
            ids = ids.to(net.device)
            result = time_generate(net, ids, row, prefill=prefill, seed=seed, **timing)
        except torch.OutOfMemoryError as error:
            result = {"row": row, "error": f"out of memory: {str(error).splitlines()[0][:200]}"}
        del ids
        capture = [path for path in result.get("decode_paths") or {} if _out_of_memory(path)]
        if capture:
            result = {"row": row, "error": f"out of memory capturing the CUDA graph ({capture[0]})"}
        _free_memory()
        if progress is not None:
            outcome = result["error"] if "error" in result else f"{result['tokens_per_s']:.0f} tokens/s"
            progress(f"{row} batch {batch}: {outcome}")
        return result

    return measure


def run_throughput(
    model: str = "llama3-8b-random",
    *,
    layers: int | None = None,
    context: int = 32768,
    memory_gb: float | None = None,
    rows: tuple[str, ...] = DEFAULT_ROWS,
    budget: float = 0.02,
    top_p: float | None = None,
    dense_below: int | None = None,
    new_tokens: int = 32,
    warmup: int = 4,
    prefill_chunk_size: int = 1024,
    max_batch: int = 1024,
    seed: int = 0,
    prefill: str = "model",
    dense_layers: tuple[int, ...] | None = None,
    progress=None,
) -> dict:
    """Every row's largest batch under the memory limit and its decode speed there (see the module's docstring);
    `progress` is told each try's outcome in a line. prefill="synthetic": each try's prompt K/V are written into
    its cache (`time_generate`), so a long context's batch search does not spend minutes prefilling.
    dense_layers: the layers the methods keep dense (None: the config's default, layers 0 and 1)."""
    from sparsekv.bench.e2e import build_model

    for what, value, least in (("context", context, 2), ("new_tokens", new_tokens, 1), ("warmup", warmup, 0),
                               ("prefill_chunk_size", prefill_chunk_size, 1), ("max_batch", max_batch, 1)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{what} must be >= {least}, got {value}")
    if memory_gb is not None and not memory_gb > 0:
        raise ConfigError(f"--memory-gb must be > 0, got {memory_gb}")
    check_rows(rows, budget, top_p, dense_layers)
    chunk = prefill_chunk_size if prefill == "model" else None  # a synthetic prefill feeds no prompt chunks
    check_prefill(prefill, rows, model=model, prefill_chunk_size=chunk)
    # unknown model: a ConfigError; the weights' size decides below whether the limit can hold them at all
    meta = build_model(model, layers=layers, dtype=torch.bfloat16, device="meta")
    weights = sum(p.numel() for p in meta.parameters()) * 2
    if not torch.cuda.is_available():
        message = "bench throughput measures GPU memory: it needs a CUDA device, and this machine has none"
        raise ConfigError(message)
    device = torch.device("cuda", torch.cuda.current_device())  # an index: the memory limit is per device
    free, total = torch.cuda.mem_get_info(device)
    limit = memory_limit_bytes(memory_gb, total, free)
    if weights >= limit:
        raise ConfigError(f"{model} with {meta.config.num_hidden_layers} layers has {weights / 1e9:.1f} GB of bf16 "
                          f"weights, more than the {limit / 1e9:.1f} GB limit: raise --memory-gb or use fewer "
                          f"--layers")  # fmt: skip
    with memory_limit(device, limit):
        net = build_model(model, layers=layers, dtype=torch.bfloat16, device=device, seed=seed)
        measure = gpu_measure(net, context=context, seed=seed, prefill=prefill, progress=progress, budget=budget,
                              top_p=top_p, dense_below=dense_below, new_tokens=new_tokens, warmup=warmup,
                              prefill_chunk_size=chunk, dense_layers=dense_layers)  # fmt: skip
        found = throughput_search(rows, measure, max_batch)
        del net, measure
        _free_memory()
    return {
        **run_environment(device),
        "model": model,
        "layers": meta.config.num_hidden_layers,
        "context": context,
        "memory_limit_bytes": limit,
        "weights_bytes": weights,
        "budget": budget,
        "top_p": top_p,
        "dense_below": dense_below,
        "dense_layers": dense_layers,
        "new_tokens": new_tokens,
        "warmup": warmup,
        "prefill_chunk_size": chunk,
        "prefill": prefill,
        "max_batch": max_batch,
        **found,
    }


def plot_throughput(result: dict, path: Path) -> Path:
    """Tokens/s against batch, one line per row (every batch that fit), and where each dense row ran out of memory
    (an x at its first batch that did not fit, at the height of its last point). matplotlib: the eval extra."""
    from sparsekv.eval.common import require_extra

    require_extra("matplotlib").use("Agg", force=True)
    plt = require_extra("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in result["rows"]:
        points = [(t["batch"], t["tokens_per_s"]) for t in r["tries"] if t.get("tokens_per_s")]
        if not points:
            continue
        (line,) = ax.plot(*zip(*points), marker="o", label=f"{r['row']} (max batch {r['max_batch']})")
        if is_dense_row(r["row"]) and r["first_oom_batch"] is not None:
            oom = r["first_oom_batch"]
            ax.plot(
                [oom], [points[-1][1]], marker="x", markersize=10, markeredgewidth=2, color=line.get_color()
            )
            ax.annotate(f"{r['row']} OOM at {oom}", (oom, points[-1][1]), textcoords="offset points", xytext=(6, 4),
                        fontsize=7, color=line.get_color())  # fmt: skip
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # batches, not powers of two
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s (model.generate())")
    limit = result.get("memory_limit_bytes")
    where = f" under {limit / 1e9:.1f} GB" if limit else ""
    ax.set_title(f"{result.get('model', '')} context {result.get('context', '')}{where} on "
                 f"{result.get('device', '')}", fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
