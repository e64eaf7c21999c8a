"""`sparsekv eval ppl|niah|ruler|iou|fidelity|compare`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from sparsekv.cli_options import (
    BudgetOpt,
    DenseLayersOpt,
    DeviceOpt,
    DtypeOpt,
    MethodOpt,
    ModelOpt,
    OptionOpt,
    OutputOpt,
    TopPOpt,
    build_config,
    console,
    parse_layers,
    parse_options,
    write_json,
)
from sparsekv.config import ConfigError, SparseConfig

eval_app = typer.Typer(no_args_is_help=True, add_completion=False,
                       help="Offline evaluation: perplexity, needle in a haystack, RULER-style tasks, IoU, fidelity.")

CacheDirOpt = Annotated[Path | None, typer.Option(help="per-cell result cache (default: <sparsekv cache>/eval)")]
NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="recompute every cell and store nothing")]
SinkOpt = Annotated[int, typer.Option(help="first tokens always kept")]
LocalOpt = Annotated[int, typer.Option(help="most recent tokens always kept")]
GqaOpt = Annotated[str, typer.Option(help="group (one selection per kv head) or head")]
PlotOpt = Annotated[Path | None, typer.Option(help="PNG path (default: next to --output, same name)")]
TextFileOpt = Annotated[Path | None, typer.Option(help="UTF-8 text to evaluate (default: the embedded essays)")]
WindowsOpt = Annotated[int, typer.Option(help="consecutive windows of the text")]
StartOpt = Annotated[int, typer.Option(help="token offset of the first window")]
SeedOpt = Annotated[int, typer.Option(help="seed of generated data and of torch")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")]
PrefillChunkOpt = Annotated[int | None, typer.Option(
    help="ppl: feed the dense prefix in chunks of this many tokens, as transformers' prefill_chunk_size does (a "
    "compressing method such as self-index then stores a long prefix chunk by chunk)")]
ChatOpt = Annotated[bool, typer.Option("--chat/--raw", help="apply the model's chat template to prompts")]


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")


# ------------------------------------------------------------------------------------------------ parsing helpers


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """'500,1K,2k' -> (500, 1000, 2000)."""
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1000 if part.endswith("k") else 1
        try:
            values.append(int(float(part.rstrip("k")) * scale))
        except ValueError:
            raise ConfigError(f"{what} expects comma-separated token counts like 500,1K,2K, got {text!r}") from None
    if not values:
        raise ConfigError(f"{what} needs at least one value")
    return tuple(values)


def parse_depths(text: str) -> tuple[float, ...]:
    """Fractions '0,0.5,1' or percents '0,50,100' (read as percents when any value is > 1)."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"--depths expects comma-separated fractions or percents, got {text!r}") from None
    if not values:
        raise ConfigError("--depths needs at least one value")
    if any(v > 1 for v in values):
        values = [v / 100 for v in values]
    return tuple(values)


def parse_budgets(text: str) -> list[int | float]:
    from sparsekv.cli_options import parse_budget

    budgets = [parse_budget(p.strip()) for p in text.split(",") if p.strip()]
    if not budgets:
        raise ConfigError("--budgets needs at least one value")
    return budgets


def result_cache(cache_dir: Path | None, no_cache: bool, only_cached: bool = False, stale_ok: bool = False):
    from sparsekv.eval.common import ResultCache, default_cache_dir

    if no_cache and only_cached:
        raise ConfigError("--no-cache and --only-cached exclude each other")
    if stale_ok and not only_cached:
        raise ConfigError("--stale-ok only works with --only-cached")
    return ResultCache(None if no_cache else (cache_dir or default_cache_dir()), only_cached=only_cached,
                       stale_ok=stale_ok)  # fmt: skip


def handle(model: str, device: str, dtype: str):
    from sparsekv.eval.common import ModelHandle

    return ModelHandle(spec=model, device=device, dtype=dtype)


def plot_path(plot: Path | None, output: Path | None, suffix: str = ".png") -> Path | None:
    if plot is not None:
        return plot
    return output.with_suffix(suffix) if output is not None else None


def read_text(path: Path | None) -> tuple[str | None, str]:
    if path is None:
        return None, "haystack"
    if not path.is_file():
        raise ConfigError(f"text file {path} does not exist")
    return path.read_text(encoding="utf-8"), path.name


def _fmt(value, spec: str = "{:.3f}") -> str:
    return "-" if value is None else spec.format(value)


# ------------------------------------------------------------------------------------------------ the task commands

#: the options every task command takes, around its own: (name, annotation, default); the method's default is the
#: command's (None here)
CONFIG_OPTIONS = (("model", ModelOpt, "default"), ("method", MethodOpt, None), ("budget", BudgetOpt, None),
                  ("top_p", TopPOpt, None), ("dense_layers", DenseLayersOpt, "0,1"), ("sink", SinkOpt, 0),
                  ("local", LocalOpt, 0), ("gqa", GqaOpt, "group"), ("option", OptionOpt, None))  # fmt: skip
RUN_OPTIONS = (("device", DeviceOpt, "cpu"), ("dtype", DtypeOpt, "float32"), ("cache_dir", CacheDirOpt, None),
               ("no_cache", NoCacheOpt, False), ("quiet", QuietOpt, False), ("output", OutputOpt, None))  # fmt: skip


@dataclass
class Run:
    """What a task command gets besides its config and its own options."""

    handle: Any  # eval.common.ModelHandle
    cache: Any  # eval.common.ResultCache
    quiet: bool


def _parameter(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def task_command(method: str, plot: Callable[[dict, Path], Path | None] | None = None):
    """Registers `func(config, run, **own_options) -> payload` as `sparsekv eval <func name>`.

    Its options: the config's (--model, --method defaulting to `method`, --budget, ...), then its own, then
    --device/--dtype/--cache-dir/--no-cache/--quiet/--output, and --plot when the task draws a figure (`plot(payload,
    png)`, None when there is nothing to draw). The payload goes to --output as JSON, the figure to --plot (default:
    next to --output); a missing plotting extra is reported before anything runs."""

    def register_command(func: Callable[..., dict]) -> Callable[..., None]:
        own = list(inspect.signature(func, eval_str=True).parameters.values())[2:]
        options = [_parameter(n, a, method if n == "method" else d) for n, a, d in CONFIG_OPTIONS]
        options += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        options += [_parameter(n, a, d) for n, a, d in RUN_OPTIONS]
        if plot is not None:
            options.append(_parameter("plot", PlotOpt, None))

        @functools.wraps(func)
        def command(**values: Any) -> None:
            shared = {name: values.pop(name) for name, _, _ in CONFIG_OPTIONS + RUN_OPTIONS}
            config = build_config(*(shared[name] for name, _, _ in CONFIG_OPTIONS[1:]))
            png = plot_path(values.pop("plot"), shared["output"]) if plot is not None else None
            if png is not None:
                from sparsekv.eval.plots import require_plots

                require_plots()
            run = Run(handle(shared["model"], shared["device"], shared["dtype"]),
                      result_cache(shared["cache_dir"], shared["no_cache"]), shared["quiet"])  # fmt: skip
            payload = func(config, run, **values)
            figure = plot(payload, png) if png is not None else None
            if figure is not None:
                payload["plot"] = str(figure)
            write_json(shared["output"], payload)

        command.__signature__ = inspect.Signature(options, return_annotation=None)
        command.__annotations__ = {p.name: p.annotation for p in options}
        eval_app.command()(command)
        return command

    return register_command


def _niah_plot(payload: dict, png: Path) -> Path:
    from sparsekv.eval.plots import niah_heatmap

    return niah_heatmap(payload, png)


def _iou_plot(payload: dict, png: Path) -> Path | None:
    from sparsekv.eval.plots import iou_map

    return None if payload["mean_iou"] is None else iou_map(payload, png)


@task_command(method="dense")
def ppl(
    config: SparseConfig,
    run: Run,
    text_file: TextFileOpt = None,
    context: Annotated[int, typer.Option(help="tokens per window")] = 4096,
    prefix: Annotated[int, typer.Option(help="tokens prefilled densely; the rest are decoded sparsely")] = 512,
    chunk: Annotated[int, typer.Option(help="tokens per decode chunk (speed only: results are identical)")] = 256,
    windows: WindowsOpt = 1,
    start: StartOpt = 0,
    with_dense: Annotated[bool, typer.Option("--with-dense", help="also report the dense perplexity")] = False,
    prefill_chunk_size: PrefillChunkOpt = None,
) -> dict:
    """Decode-faithful perplexity: dense prefill of --prefix tokens, sparse attention for every later token."""
    from sparsekv.eval.ppl import PplSettings, run_ppl

    text, name = read_text(text_file)
    settings = PplSettings(context=context, prefix=prefix, chunk=chunk, windows=windows, start=start,
                           prefill_chunk=prefill_chunk_size)  # fmt: skip
    payload = run_ppl(run.handle, config, settings, text=text, text_name=name, with_dense=with_dense,
                      cache=run.cache, quiet=run.quiet)  # fmt: skip
    table = Table("method", "ppl", "dense ppl", "tokens scored", "avg tokens attended", "tokens/s")
    table.add_row(config.method, f"{payload['ppl']:.3f}", _fmt(payload.get("dense_ppl")), str(payload["tokens"]),
                  _fmt(payload["avg_budget_tokens"], "{:.1f}"), _fmt(payload["tokens_per_second"], "{:.1f}"))
    console.print(table)
    return payload


@task_command(method="dense", plot=_niah_plot)
def niah(
    config: SparseConfig,
    run: Run,
    lengths: Annotated[str, typer.Option(help="context lengths in tokens, e.g. 500,1K,2K,3K")] = "500,1000,2000,3000",
    depths: Annotated[str, typer.Option(help="needle depths: fractions 0,0.5,1 or percents 0,50,100")] = "0,0.25,0.5,0.75,1",
    needle: Annotated[str | None, typer.Option(help="the needle sentence")] = None,
    question: Annotated[str | None, typer.Option(help="the question about the needle")] = None,
    keywords: Annotated[str | None, typer.Option(help="comma-separated keywords an answer must contain")] = None,
    scorer: Annotated[str, typer.Option(help="keyword-recall or rougeL-recall")] = "keyword-recall",
    haystack_dir: Annotated[Path | None, typer.Option(help="folder of .txt files (default: the essays)")] = None,
    max_new_tokens: int = 32,
    chat: ChatOpt = True,
    seed: SeedOpt = 0,
) -> dict:
    """Needle in a haystack over context lengths x depths; greedy answers, per-cell score, heatmap PNG."""
    from sparsekv.eval.haystack import NEEDLE, QUESTION, read_haystack_dir
    from sparsekv.eval.niah import NiahSettings, run_niah

    settings = NiahSettings(
        lengths=parse_ints(lengths, "--lengths"), depths=parse_depths(depths), needle=needle or NEEDLE,
        question=question or QUESTION,
        keywords=tuple(k.strip() for k in keywords.split(",") if k.strip()) if keywords else (),
        scorer=scorer, max_new_tokens=max_new_tokens, chat=chat, seed=seed,
    )  # fmt: skip
    hay, hay_name = (read_haystack_dir(haystack_dir), str(haystack_dir)) if haystack_dir else (None, "paul-graham-essays")
    payload = run_niah(run.handle, config, settings, haystack=hay, haystack_name=hay_name, cache=run.cache,
                       quiet=run.quiet)  # fmt: skip
    table = Table("length", *[f"{100 * d:.0f}%" for d in settings.depths], "mean")
    for n in settings.lengths:
        row = [c for c in payload["cells"] if c["length"] == n]
        table.add_row(str(n), *[f"{c['score']:.2f}" for c in row], _fmt(payload["score_by_length"][str(n)], "{:.2f}"))
    console.print(table)
    console.print(f"[{config.method}] mean {payload['scorer']}: {payload['score']:.3f}; avg tokens attended "
                  f"{_fmt(payload['avg_budget_tokens'], '{:.1f}')}", markup=False)  # fmt: skip
    return payload


@task_command(method="dense")
def ruler(
    config: SparseConfig,
    run: Run,
    tasks: Annotated[str, typer.Option(help="comma-separated tasks")] = (
        "niah_single,niah_multikey,niah_multivalue,variable_tracking,common_words,freq_words"),
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens, e.g. 1K,2K")] = "1000,2000",
    samples: Annotated[int, typer.Option(help="samples per task and length")] = 4,
    seed: SeedOpt = 0,
    chat: ChatOpt = True,
) -> dict:
    """RULER-style tasks generated locally from --seed, scored exactly (string_match_all)."""
    from sparsekv.eval.ruler import run_ruler

    task_list = tuple(t.strip() for t in tasks.split(",") if t.strip())
    length_list = parse_ints(lengths, "--lengths")
    payload = run_ruler(run.handle, config, tasks=task_list, lengths=length_list, samples=samples, seed=seed,
                        chat=chat, cache=run.cache, quiet=run.quiet)  # fmt: skip
    table = Table("task", *[str(n) for n in length_list], "mean")
    for task in task_list:
        by_length = payload["score_by_task_length"][task]
        table.add_row(task, *[_fmt(by_length[str(n)]) for n in length_list], _fmt(payload["score_by_task"][task]))
    table.add_row("all", *["" for _ in length_list], _fmt(payload["score"]))
    console.print(table)
    return payload


@task_command(method="oracle-topk", plot=_iou_plot)
def iou(
    config: SparseConfig,
    run: Run,
    text_file: TextFileOpt = None,
    context: Annotated[int, typer.Option(help="tokens per window")] = 2048,
    queries: Annotated[int, typer.Option(help="last tokens of each window whose selections are compared")] = 64,
    windows: WindowsOpt = 1,
    start: StartOpt = 0,
) -> dict:
    """Per layer/head IoU and recall of the method's top-k vs the oracle top-k at the same budget, on real text."""
    from sparsekv.eval.iou import IouSettings, run_iou

    text, name = read_text(text_file)
    settings = IouSettings(context=context, queries=queries, windows=windows, start=start)
    payload = run_iou(run.handle, config, settings, text=text, text_name=name, cache=run.cache, quiet=run.quiet)
    table = Table("layer", "iou", "recall", "attention mass kept", "oracle mass")
    for layer, value in enumerate(payload["iou_per_layer"]):
        if value is None:
            table.add_row(str(layer), "dense", "", "", "")
            continue
        table.add_row(str(layer), f"{value:.3f}", f"{payload['recall_per_layer'][layer]:.3f}",
                      f"{payload['mass_per_layer'][layer]:.3f}", f"{payload['oracle_mass_per_layer'][layer]:.3f}")
    table.add_row("mean", _fmt(payload["mean_iou"]), _fmt(payload["mean_recall"]), _fmt(payload["mean_mass"]),
                  _fmt(payload["mean_oracle_mass"]))
    console.print(table)
    return payload


@task_command(method="oracle-topk")
def fidelity(
    config: SparseConfig,
    run: Run,
    prompts_file: Annotated[Path | None, typer.Option(help=".jsonl/.json/.txt prompts (default: essay passages)")] = None,
    samples: Annotated[int, typer.Option(help="default prompts: how many passages")] = 4,
    context: Annotated[int, typer.Option(help="default prompts: tokens per passage")] = 1000,
    max_new_tokens: int = 48,
    chat: ChatOpt = True,
    seed: SeedOpt = 0,
) -> dict:
    """Rouge-L (F) of the method's greedy output vs the dense model's greedy output, per prompt and mean."""
    from sparsekv.eval.fidelity import read_prompts, run_fidelity

    prompts = read_prompts(prompts_file) if prompts_file else None
    payload = run_fidelity(run.handle, config, prompts=prompts,
                           prompts_name=str(prompts_file) if prompts_file else "haystack passages", samples=samples,
                           context=context, max_new_tokens=max_new_tokens, chat=chat, seed=seed, cache=run.cache,
                           quiet=run.quiet)  # fmt: skip
    table = Table("#", "rougeL vs dense", "identical", f"{config.method} output")
    for cell in payload["cells"]:
        table.add_row(str(cell["index"]), f"{cell['rougeL']:.3f}", "yes" if cell["exact"] else "no",
                      cell["output"].strip()[:80])
    console.print(table)
    console.print(f"mean Rouge-L {payload['rougeL']:.3f}, identical {payload['exact']:.2f}", markup=False)
    return payload


@eval_app.command()
def compare(
    task: Annotated[str, typer.Option(help="ppl, niah, iou, ruler or fidelity")] = "ppl",
    methods: Annotated[str, typer.Option(help="comma-separated methods (unregistered ones are reported)")] = (
        "dense,oracle-topk,quest,lsh,spotlight,twilight,self-index,streaming"),
    budgets: Annotated[str, typer.Option(help="comma-separated budgets: fractions or token counts")] = "0.02,0.1",
    model: ModelOpt = "default",
    top_p: TopPOpt = None,
    dense_layers: DenseLayersOpt = "0,1",
    sink: SinkOpt = 0,
    local: LocalOpt = 0,
    gqa: GqaOpt = "group",
    option: Annotated[list[str] | None, typer.Option(
        "--option", "-o", help="key=value for every method that has the option, or method:key=value")] = None,
    text_file: TextFileOpt = None,
    context: Annotated[int | None, typer.Option(help="ppl/iou window tokens; fidelity passage tokens")] = None,
    prefix: Annotated[int, typer.Option(help="ppl: dense prefix tokens")] = 512,
    chunk: Annotated[int, typer.Option(help="ppl: decode chunk")] = 256,
    prefill_chunk_size: PrefillChunkOpt = None,
    windows: Annotated[int, typer.Option(help="ppl/iou: windows")] = 1,
    queries: Annotated[int, typer.Option(help="iou: compared queries per window")] = 64,
    lengths: Annotated[str | None, typer.Option(help="niah/ruler: lengths")] = None,
    depths: Annotated[str, typer.Option(help="niah: depths")] = "0,0.25,0.5,0.75,1",
    ruler_tasks: Annotated[str, typer.Option(help="ruler: tasks")] = (
        "niah_single,niah_multikey,niah_multivalue,variable_tracking,common_words,freq_words"),
    samples: Annotated[int, typer.Option(help="ruler: samples per task/length; fidelity: passages")] = 4,
    prompts_file: Annotated[Path | None, typer.Option(help="fidelity: prompts file")] = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    cache_dir: CacheDirOpt = None,
    no_cache: NoCacheOpt = False,
    quiet: QuietOpt = False,
    output: OutputOpt = None,
    markdown: Annotated[Path | None, typer.Option(help="markdown table (default: next to --output, .md)")] = None,
    plot: PlotOpt = None,
    only_cached: Annotated[bool, typer.Option(
        "--only-cached", help="compute nothing: table of the cells already cached, others 'not computed yet'")] = False,
    stale_ok: Annotated[bool, typer.Option(
        "--stale-ok", help="with --only-cached: accept cells computed with an older method file/checkpoint")] = False,
) -> None:
    """One task over methods x budgets: a markdown table and a budget-quality plot.

    Under `torchrun --nproc-per-node N` the cells are split over the N processes (one GPU each with --device cuda)
    and merged: the same result as one process."""
    from sparsekv.eval import compare as cmp

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    budget_list = parse_budgets(budgets)
    base = {"top_p": top_p, "dense_layers": parse_layers(dense_layers), "sink": sink, "local": local, "gqa": gqa}
    cache = result_cache(cache_dir, no_cache, only_cached, stale_ok)
    png = plot_path(plot, output)
    if png is not None:
        from sparsekv.eval.plots import require_plots

        require_plots()  # before the run, not after it
    options = parse_options(option)
    from sparsekv.eval.distributed import data_parallel

    # under torchrun: cell i on rank i % world, the result merged on every rank; rank 0 reports
    with data_parallel(device) as (shard, rank_device):
        runner, settings_note = _task_runner(task, model, rank_device, dtype, cache, text_file,
                                             context, prefix, chunk, prefill_chunk_size, windows, queries, lengths,
                                             depths, ruler_tasks, samples, prompts_file, seed)  # fmt: skip
        result = cmp.run_compare(task, runner, method_list, budget_list, base=base, options=options,
                                 quiet=quiet or not shard.is_main, shard=shard)  # fmt: skip
        stale = sum(shard.gather(cache.stale))
    if not shard.is_main:
        return
    table = cmp.markdown_table(result)
    console.print(table, markup=False, highlight=False, soft_wrap=True)
    if stale:
        console.print(f"{stale} cell(s) were computed with an older version of their method", style="yellow")
    payload = {**result.to_dict(), "model": model, "settings": settings_note, "markdown": table,
               "stale_cells": stale}  # fmt: skip
    md = plot_path(markdown, output, ".md")
    if md is not None:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(f"{cmp.TASK_SPECS[task].label} on {model}; {settings_note}\n\n{table}")
        payload["markdown_file"] = str(md)
    if png is not None:
        payload["plot"] = str(cmp.plot(result, png, f"{cmp.TASK_SPECS[task].label}, {model}: {settings_note}"))
    write_json(output, payload)


def _task_runner(task, model, device, dtype, cache, text_file, context, prefix, chunk, prefill_chunk, windows, queries,
                 lengths, depths, ruler_tasks, samples, prompts_file, seed):  # fmt: skip
    h = handle(model, device, dtype)
    if task == "ppl":
        from sparsekv.eval.ppl import PplSettings, run_ppl

        text, name = read_text(text_file)
        settings = PplSettings(context=context or 4096, prefix=prefix, chunk=chunk, windows=windows,
                               prefill_chunk=prefill_chunk)  # fmt: skip
        note = f"{name}, {settings.windows} window(s) of {settings.context} tokens, dense prefix {prefix}"
        if prefill_chunk:
            note += f" fed in chunks of {prefill_chunk}"
        return (lambda config: run_ppl(h, config, settings, text=text, text_name=name, cache=cache)), note
    if task == "niah":
        from sparsekv.eval.niah import NiahSettings, run_niah

        settings = NiahSettings(lengths=parse_ints(lengths or "500,1000,2000", "--lengths"),
                                depths=parse_depths(depths), seed=seed)  # fmt: skip
        note = f"lengths {list(settings.lengths)}, depths {list(settings.depths)}, {settings.scorer}"
        return (lambda config: run_niah(h, config, settings, cache=cache)), note
    if task == "iou":
        from sparsekv.eval.iou import IouSettings, run_iou

        text, name = read_text(text_file)
        settings = IouSettings(context=context or 2048, queries=queries, windows=windows)
        note = f"{name}, {settings.windows} window(s) of {settings.context} tokens, last {queries} queries"
        return (lambda config: run_iou(h, config, settings, text=text, text_name=name, cache=cache)), note
    if task == "ruler":
        from sparsekv.eval.ruler import run_ruler

        task_list = tuple(t.strip() for t in ruler_tasks.split(",") if t.strip())
        length_list = parse_ints(lengths or "1000,2000", "--lengths")
        note = f"tasks {','.join(task_list)}, lengths {list(length_list)}, {samples} samples, seed {seed}"
        return (lambda config: run_ruler(h, config, tasks=task_list, lengths=length_list, samples=samples,
                                         seed=seed, cache=cache)), note  # fmt: skip
    if task == "fidelity":
        from sparsekv.eval.fidelity import read_prompts, run_fidelity

        prompts = read_prompts(prompts_file) if prompts_file else None
        note = f"{prompts_file or 'essay passages'}, {samples} prompts, seed {seed}"
        return (lambda config: run_fidelity(h, config, prompts=prompts, samples=samples, context=context or 1000,
                                            seed=seed, cache=cache)), note  # fmt: skip
    raise ConfigError(f"compare supports tasks ppl, niah, iou, ruler, fidelity; got {task!r}")
