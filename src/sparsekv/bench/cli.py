"""`sparsekv bench kernels` and `sparsekv bench attention`: print a table, optionally write JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Kernel and sparse-attention benchmarks (GPU)."
)
console = Console()


def register(parent: typer.Typer) -> None:
    """Mounted by the top-level CLI as `sparsekv bench`."""
    parent.add_typer(app, name="bench")


def _print(result: dict, title: str) -> None:
    table = Table(title=title)
    for col in ("stage / kernel", "shape", "median us", "MB moved", "GB/s", "% copy BW"):
        table.add_column(col, justify="left" if col in ("stage / kernel", "shape") else "right")
    for r in result["rows"]:
        table.add_row(
            r["name"],
            r["shape"],
            f"{r['us']:.1f}",
            f"{r['bytes'] / 1e6:.1f}",
            f"{r['gbps']:.0f}",
            f"{r.get('pct_copy', 0):.0f}",
        )
    console.print(table)


def _progress(line: str) -> None:
    """A long benchmark's way, on stderr (the table and JSON stay clean)."""
    Console(stderr=True).print(f"[dim]{line}[/dim]")


def _write(result: dict, output: Path | None, quiet: bool = False) -> None:
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2))
        if not quiet:
            console.print(f"wrote {output}")


@app.command()
def kernels(
    batch: Annotated[int, typer.Option(help="batch size")] = 8,
    context: Annotated[int, typer.Option(help="tokens in the KV cache")] = 131072,
    budget: Annotated[float, typer.Option(help="fraction (<1) or tokens")] = 0.02,
    shape: Annotated[str, typer.Option(help="llama3-8b | default")] = "llama3-8b",
    output: Annotated[Path | None, typer.Option(help="write JSON here")] = None,
) -> None:
    """Each kernel alone: median time, bytes, bandwidth vs copy, torch baselines."""
    from sparsekv.bench.kernels import run_kernels

    result = run_kernels(batch=batch, context=context, budget=budget, shape=shape)
    _print(result, f"kernels on {result['device']} (copy {result['copy_gbps']:.0f} GB/s)")
    _write(result, output)


@app.command()
def attention(
    method: Annotated[
        str, typer.Option(help="spotlight (128-bit codes) | lsh (1024-bit codes)")
    ] = "spotlight",
    batch: Annotated[int, typer.Option(help="batch size")] = 8,
    context: Annotated[int, typer.Option(help="tokens in the KV cache")] = 131072,
    budget: Annotated[float, typer.Option(help="fraction (<1) or tokens")] = 0.02,
    shape: Annotated[str, typer.Option(help="llama3-8b | default")] = "llama3-8b",
    graph: Annotated[bool, typer.Option(help="time CUDA graphs of each stage")] = True,
    output: Annotated[Path | None, typer.Option(help="write JSON here")] = None,
) -> None:
    """Score + select + attend of one decode step vs dense SDPA, per stage."""
    from sparsekv.bench.attention import run_attention

    result = run_attention(
        method=method, batch=batch, context=context, budget=budget, shape=shape, use_graph=graph
    )
    _print(
        result,
        f"{method} B{batch} N{context} budget {result['budget_tokens']} on {result['device']}: "
        f"{result['speedup_vs_dense']:.1f}x vs dense (attend rel err {result['attend_rel_err']:.1e})",
    )
    _write(result, output)


@app.command()
def e2e(
    model: Annotated[
        str, typer.Option(help="default (SmolLM2-135M shape) | llama3-8b-random (random weights)")
    ] = "llama3-8b-random",
    layers: Annotated[
        int | None, typer.Option(help="decoder layers (fewer than the model's to fit long caches)")
    ] = None,
    context: Annotated[int, typer.Option(help="tokens in the KV cache before decoding")] = 32768,
    batch: Annotated[int, typer.Option(help="batch size")] = 1,
    method: Annotated[str, typer.Option(help="sparse method compared with dense")] = "spotlight",
    budget: Annotated[str, typer.Option(help="fraction (<1) or tokens")] = "0.02",
    top_p: Annotated[float | None, typer.Option("--top-p", help="Twilight top-p pruning")] = None,
    new_tokens: Annotated[int, typer.Option(help="timed decode steps")] = 32,
    cuda_graph: Annotated[
        bool, typer.Option("--cuda-graph", help="also time one captured decode step")
    ] = False,
    prefill: Annotated[
        str, typer.Option(help="auto | model | synthetic (random K/V written into the cache)")
    ] = "auto",
    dense_layers: Annotated[str, typer.Option(help="layers kept dense: 'none' or e.g. '0,1'")] = "none",
    option: Annotated[list[str] | None, typer.Option(help="method option key=value (repeatable)")] = None,
    compile: Annotated[
        bool, typer.Option("--compile", help="decode steps of both through torch.compile (attention stays)")
    ] = False,
    output: Annotated[Path | None, typer.Option(help="write JSON here")] = None,
) -> None:
    """Whole-model decode (TPOT, tokens/s), prefill time and peak GPU memory: dense vs a method, one run."""
    from sparsekv.bench.e2e import run_e2e, summary_rows
    from sparsekv.cli_options import parse_budget, parse_layers, parse_options

    result = run_e2e(
        model, layers=layers, context=context, batch=batch, method=method, budget=parse_budget(budget),
        top_p=top_p, new_tokens=new_tokens, cuda_graph=cuda_graph, prefill=prefill,
        dense_layers=parse_layers(dense_layers), options=parse_options(option), compile=compile,
    )  # fmt: skip
    compiled = " (compiled)" if compile else ""
    table = Table(
        title=f"{method} vs dense{compiled}: {model} ({result['layers']} layers) N{context} B{batch} budget {budget} "
        f"on {result['device']} (prefill: {result['prefill']})"
    )
    for col in ("", "dense", method, "ratio"):
        table.add_column(col, justify="left" if not col else "right")
    for row in summary_rows(result):
        table.add_row(*row)
    console.print(table)
    for name in ("dense", "method"):
        if result["runs"][name].get("graph_error"):
            console.print(f"{name}: CUDA graph capture failed: {result['runs'][name]['graph_error']}")
    _write(result, output)


@app.command()
def generate(
    model: Annotated[str, typer.Option(
        help="llama3-8b-random | default (SmolLM2-135M shape): random weights and prompts; embedded | gemma3-270m: "
        "real weights (the embedded model, the Gemma 3 asset) on windows of the embedded essays")] = "llama3-8b-random",
    layers: Annotated[int | None, typer.Option(help="decoder layers (fewer than the model's to fit)")] = None,
    context: Annotated[int, typer.Option(help="prompt tokens per sequence")] = 32768,
    batch: Annotated[int, typer.Option(help="batch size")] = 1,
    rows: Annotated[str, typer.Option(
        help="comma-separated: hf-dense, hf-static-compile and methods (dense: sparsekv's captured dense step; "
        "<method>@eager: without CUDA graphs; <method>@compile: the step compiled by torch.compile, then "
        "captured; <method>@lossless: sparse drafts, dense verification, dense's output; <method>@lossless-compile: "
        "the same with its steps compiled; a ':<budget>' suffix "
        "gives a row its own budget, e.g. twilight@compile:0.25)")] = (
        "hf-dense,hf-static-compile,dense,spotlight,lsh,quest,twilight,double-sparsity,self-index"
    ),
    budget: Annotated[float, typer.Option(help="fraction of the context attended per step (<1)")] = 0.02,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Twilight top-p pruning")] = None,
    dense_below: Annotated[int | None, typer.Option(
        help="the methods' dense fallback: below this many cached tokens (over the batch) a captured step decodes "
        "densely; default: each method's measured crossover; 0: never (what measures the crossover)")] = None,
    new_tokens: Annotated[int, typer.Option(help="timed decode steps")] = 32,
    warmup: Annotated[int, typer.Option(help="decode steps before the timed ones")] = 4,
    prefill_chunk_size: Annotated[
        int | None, typer.Option(help="transformers' chunked prefill (every row)")
    ] = None,
    rounds: Annotated[int, typer.Option(help="all rows again, in turn (best round reported)")] = 1,
    tp: Annotated[int, typer.Option(
        help="tensor parallelism over this many GPUs (launch with torchrun --nproc-per-node TP); rank 0 reports")] = 1,
    prefill: Annotated[str, typer.Option(
        help="model: the model prefills the prompt | synthetic: random K/V written into each row's cache, "
        "generate() continuing from it (random-weight models; skips a long prefill)")] = "model",
    dense_layers: Annotated[str | None, typer.Option(
        help="comma-separated layers the methods keep dense (default: 0,1; none: every layer selects)")] = None,
    profile_step: Annotated[int, typer.Option(
        help="CUDA: also replay each row's captured step 10 times under torch.profiler and list this many of its "
        "heaviest kernels (0: no profile)")] = 0,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help=(
        "key=value for every row's method that has the option, or method:key=value (repeatable)"))] = None,
    draft_tokens: Annotated[str, typer.Option(
        help="lossless rows: tokens drafted per verification, or auto (chosen round by round)")] = "auto",
    output: Annotated[Path | None, typer.Option(help="write JSON here")] = None,
) -> None:
    """Decode TPOT through model.generate(): HF dense, HF static cache + compile and each method, one process."""
    import torch.distributed as dist

    from sparsekv.bench.generate import decode_path, run_generate
    from sparsekv.cli_options import draft_count, parse_options

    names = tuple(r.strip() for r in rows.split(",") if r.strip())
    rank = int(os.environ.get("RANK", "0"))
    result = run_generate(model, layers=layers, context=context, batch=batch, rows=names, budget=budget,
                          top_p=top_p, dense_below=dense_below, new_tokens=new_tokens, warmup=warmup,
                          prefill_chunk_size=prefill_chunk_size, rounds=rounds, tp=tp, prefill=prefill,
                          profile_step=profile_step, dense_layers=_layers(dense_layers),
                          options=parse_options(option), draft_tokens=draft_count(draft_tokens),
                          progress=_progress if rank == 0 else None,
                          on_row=(lambda so_far: _write(so_far, output, quiet=True)) if rank == 0 else None)  # fmt: skip
    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still talks to it
        dist.destroy_process_group()
        if result["rank"] != 0:
            return
    parallel = f" TP={tp} ({tp} x {result['device']})" if tp > 1 else f" on {result['device']}"
    table = Table(
        title=f"model.generate(): {model} ({result['layers']} layers) N{context} B{batch} budget {budget}{parallel}, "
        f"transformers {result['transformers']}"
    )
    columns = ("row", "TPOT ms", "step alone ms", "tokens/s", "vs HF best dense", "vs captured dense",
               "tokens attended", "prefill s", "peak GB", "decode steps")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("row", "decode steps") else "right")
    for r in result["summary"]:
        if r.get("error"):
            table.add_row(r["row"], r["error"], *[""] * (len(columns) - 2))
            continue
        table.add_row(
            r["row"], f"{r['tpot_ms']:.2f}", f"{r['step_ms']:.2f}" if r.get("step_ms") else "", f"{r['tokens_per_s']:.1f}",
            f"{r['vs_hf_best_dense']:.2f}x" if r["vs_hf_best_dense"] else "",
            f"{r['vs_captured_dense']:.2f}x" if r["vs_captured_dense"] else "",
            f"{r['avg_budget_tokens']:.0f} / {r['avg_context_tokens']:.0f}" if r["avg_budget_tokens"] else "",
            f"{r['prefill_s']:.1f}", f"{r['peak_bytes'] / 1e9:.1f}" if r["peak_bytes"] else "",
            _lossless_facts(r) + decode_path(r.get("decode_paths")),
        )  # fmt: skip
    console.print(table)
    for r in result["summary"]:
        if "verify_profile" in r:  # a lossless row: a profiled round's draft step and verification
            _print_step_profile(f"{r['row']} draft step", r["step_profile"])
            _print_step_profile(f"{r['row']} verification", r["verify_profile"])
        elif "step_profile" in r:
            _print_step_profile(r["row"], r["step_profile"])
    _write(result, output)


def _print_step_profile(row: str, profile: dict | None) -> None:
    """A row's captured step under the profiler (`bench.generate.kernel_profile`), heaviest kernels first."""
    if profile is None:
        console.print(f"{row}: no captured step to profile (CUDA graphs decode on CUDA only; a lossless row "
                      "profiles a round after its first timed ones)")
        return
    table = Table(title=f"{row}: {profile['kernels_per_step']:.0f} kernels a step, "
                        f"{profile['kernel_us_per_step']:.0f} µs of kernel time")  # fmt: skip
    for col in ("µs / step", "launches / step", "kernel"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for k in profile["top"]:
        table.add_row(f"{k['us_per_step']:.1f}", f"{k['launches_per_step']:.1f}", k["kernel"][:110])
    console.print(table)


def _layers(text: str | None) -> tuple[int, ...] | None:
    """--dense-layers: None (the config's default) or the parsed layer list."""
    from sparsekv.cli_options import parse_layers

    return None if text is None else parse_layers(text)


def _lossless_facts(row: dict) -> str:
    """A @lossless row's drafts in short (its decode paths count rounds, not steps)."""
    if "drafts_per_round" not in row:
        return ""
    accepted = "no drafts" if row["acceptance_rate"] is None else f"accepted {row['acceptance_rate']:.2f}"
    timed = ""
    if row.get("verify_ms") is not None:
        draft = f"draft step {row['draft_step_ms']:.2f} ms, " if row.get("draft_step_ms") is not None else ""
        timed = f"{draft}verification {row['verify_ms']:.2f} ms, "
    drafts = ", ".join(f"{n} drafts x{count}" for n, count in sorted(row.get("drafts_per_round", {}).items()))
    return (f"{accepted}, {row['tokens_per_verification']:.2f} tokens/verification; "
            f"{timed}{drafts}; rounds: ")  # fmt: skip


@app.command()
def throughput(
    model: Annotated[
        str, typer.Option(help="default (SmolLM2-135M shape) | llama3-8b-random (random weights)")
    ] = "llama3-8b-random",
    layers: Annotated[int | None, typer.Option(help="decoder layers (fewer than the model's)")] = None,
    context: Annotated[int, typer.Option(help="prompt tokens per sequence")] = 32768,
    memory_gb: Annotated[float | None, typer.Option(
        help="GPU memory the run may use, weights included (default: all the free memory)")] = None,
    rows: Annotated[str, typer.Option(
        help="comma-separated: hf-dense, dense (sparsekv's captured dense step) and methods (<method>@eager: "
        "without CUDA graphs)")] = "hf-dense,dense,spotlight,quest,self-index",
    budget: Annotated[float, typer.Option(help="fraction of the context attended per step (<1)")] = 0.02,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Twilight top-p pruning")] = None,
    dense_below: Annotated[int | None, typer.Option(
        help="the methods' dense fallback: below this many cached tokens (over the batch) a captured step decodes "
        "densely; default: each method's measured crossover; 0: never (what measures the crossover)")] = None,
    new_tokens: Annotated[int, typer.Option(help="timed decode steps")] = 32,
    warmup: Annotated[int, typer.Option(help="decode steps before the timed ones")] = 4,
    prefill_chunk_size: Annotated[
        int, typer.Option(help="transformers' chunked prefill: bounds the prompt's activations per sequence")
    ] = 1024,
    max_batch: Annotated[int, typer.Option(help="the largest batch the search tries")] = 1024,
    prefill: Annotated[str, typer.Option(
        help="model: the model prefills each batch tried | synthetic: random K/V written into the cache, "
        "generate() continuing from it (skips a long context's prefill)")] = "model",
    dense_layers: Annotated[str | None, typer.Option(
        help="comma-separated layers the methods keep dense (default: 0,1; none: every layer selects)")] = None,
    output: Annotated[Path | None, typer.Option(help="write JSON here")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG of tokens/s vs batch here (matplotlib)")] = None,
) -> None:
    """Largest batch under a GPU memory limit, per row (found by allocating), and model.generate() tokens/s there.

    Run it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, else fragmentation can decide the batch."""
    from sparsekv.bench.throughput import plot_throughput, run_throughput
    from sparsekv.eval.plots import require_plots

    if plot is not None:
        require_plots()  # before the search: a missing matplotlib must not cost the run
    names = tuple(r.strip() for r in rows.split(",") if r.strip())
    result = run_throughput(model, layers=layers, context=context, memory_gb=memory_gb, rows=names, budget=budget,
                            top_p=top_p, dense_below=dense_below, new_tokens=new_tokens, warmup=warmup,
                            prefill_chunk_size=prefill_chunk_size, max_batch=max_batch, prefill=prefill,
                            dense_layers=_layers(dense_layers), progress=_progress)  # fmt: skip
    _print_throughput(result)
    _write(result, output)
    if plot is not None:
        console.print(f"wrote {plot_throughput(result, plot)}")


def _print_throughput(result: dict) -> None:
    from sparsekv.bench.generate import decode_path

    reference = f"{result['reference_row']} at its max batch" if result["reference_row"] else "no dense row measured"
    table = Table(
        title=f"throughput under {result['memory_limit_bytes'] / 1e9:.1f} GB: {result['model']} ({result['layers']} "
        f"layers) N{result['context']} budget {result['budget']} on {result['device']}; tokens/s vs {reference}"
    )
    columns = ("row", "max batch", "TPOT ms", "tokens/s", "vs dense", "peak GB", "decode steps")
    for col in columns:
        table.add_column(col, justify="left" if col in ("row", "decode steps") else "right")
    for r in result["rows"]:
        if r.get("error"):
            table.add_row(r["row"], "0", r["error"], *[""] * (len(columns) - 3))
            continue
        table.add_row(
            r["row"], f"{r['max_batch']}" + ("+ (--max-batch)" if r["capped"] else ""), f"{r['tpot_ms']:.2f}",
            f"{r['tokens_per_s']:.1f}", f"{r['vs_dense']:.2f}x" if r["vs_dense"] else "",
            f"{r['peak_bytes'] / 1e9:.1f}" if r.get("peak_bytes") else "", decode_path(r.get("decode_paths")),
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    app()
