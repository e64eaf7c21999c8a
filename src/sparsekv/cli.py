"""`sparsekv` command line. Feature areas add their commands through a `register(app)` function in their own
`cli.py` module, listed in COMMAND_MODULES, so this file does not grow with every method. The CLI is the top
layer (docs/ARCHITECTURE.md) and nothing imports this module: what the command groups share is cli_options.py."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Optional

import typer
from rich.table import Table

from sparsekv.cli_options import (
    BudgetOpt,
    DenseBelowOpt,
    DenseLayersOpt,
    DeviceOpt,
    DtypeOpt,
    MethodOpt,
    ModelOpt,
    OptionOpt,
    OutputOpt,
    TopPOpt,
    UserError,
    build_config,
    console,
    draft_count,
    format_stats,
    load,
    write_json,
)
from sparsekv.config import ConfigError, SparseConfig

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Sparse KV-cache decoding for HF transformers."
)

#: modules exposing `register(app: typer.Typer)`; a module that is not part of this build is skipped
COMMAND_MODULES = [
    "sparsekv.eval.cli",
    "sparsekv.bench.cli",
    "sparsekv.training.cli",
    "sparsekv.cli_methods",
]


@app.command()
def methods() -> None:
    """List the selection methods, their options and how they decode on CUDA."""
    from sparsekv.lossless import lossless_rounds
    from sparsekv.registry import available_methods, get_method_class, method_options

    table = Table("method", "options", "dense fallback (CUDA)", "CUDA-graph step", "lossless rounds (CUDA)")
    for name in available_methods():
        opts = method_options(name)
        method = get_method_class(name)
        fallback = f"below {method.dense_below:,} cached tokens" if method.dense_below else "-"
        lossless = lossless_rounds(name)
        table.add_row(name, ", ".join(f"{k}={f.default!r}" for k, f in opts.items()) or "-", fallback,
                      "yes" if method.fixed_shape or method.dense else "no",
                      "-" if method.dense else "no" if lossless.startswith("no:") else lossless)  # fmt: skip
    console.print(table)
    console.print(
        "Every method selects in the layers that attend globally; the config's dense_layers and, in hybrid "
        "models (e.g. Gemma 3), the sliding-window layers keep their native attention. The stats list the "
        "layers that selected (per_layer_avg_tokens). In generation on CUDA a method decodes with the dense step "
        "while the batch holds fewer cached tokens (tokens x sequences) than its measured crossover "
        "(--dense-below / SparseConfig.dense_below; 0 turns the fallback off). Lossless decoding (--lossless): "
        "'captured' rounds replay CUDA graphs after the first, 'eager' rounds do not; for a 'no', "
        "`sparsekv generate --lossless --method <method>` says why."
    )


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="the prompt (chat template applied when the model has one)")],
    model: ModelOpt = "default",
    method: MethodOpt = "oracle-topk",
    budget: BudgetOpt = None,
    top_p: TopPOpt = None,
    dense_layers: DenseLayersOpt = "0,1",
    sink: int = 0,
    local: int = 0,
    gqa: str = "group",
    option: OptionOpt = None,
    dense_below: DenseBelowOpt = None,
    max_new_tokens: int = 32,
    raw: Annotated[bool, typer.Option(help="do not apply the chat template")] = False,
    lossless: Annotated[
        bool, typer.Option("--lossless", help="sparse steps draft, a dense step verifies: dense's exact output")
    ] = False,
    draft_tokens: Annotated[str, typer.Option(
        help="--lossless: tokens drafted per verification, or auto (chosen round by round from measured acceptance "
        "and step times)")] = "auto",
    allow_longer_context: Annotated[
        bool, typer.Option("--allow-longer-context", help="run a prompt longer than the model's trained context")
    ] = False,
    compile_step: Annotated[bool, typer.Option(
        "--compile-step", help="CUDA: the captured decode steps (and lossless rounds' steps) run the forward "
        "compiled by torch.compile")] = False,
    sample: Annotated[bool, typer.Option("--sample", help="sample (softmax / temperature) instead of greedy")] = False,
    temperature: Annotated[float, typer.Option(help="--sample: the softmax temperature")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="--sample: a seed for repeatable draws")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    output: OutputOpt = None,
) -> None:
    """Generate greedily with sparse decoding; prints the answer and budget/speed stats."""
    import sparsekv
    from sparsekv.models import chat_prompt

    config = build_config(method, budget, top_p, dense_layers, sink, local, gqa, option, dense_below)
    drafts = draft_count(draft_tokens)
    if compile_step and not device.startswith("cuda"):
        raise ConfigError("--compile-step compiles the decode step that CUDA graphs capture: it needs --device cuda")
    loaded, tokenizer = load(model, device, dtype)
    text = prompt if raw else chat_prompt(tokenizer, prompt)
    result = sparsekv.generate(loaded, tokenizer, text, config, max_new_tokens=max_new_tokens, lossless=lossless,
                               draft_tokens=drafts, allow_longer_context=allow_longer_context,
                               compile_step=compile_step, do_sample=sample, temperature=temperature,
                               seed=seed)  # fmt: skip
    console.print(result.texts[0], markup=False, highlight=False)
    console.print(format_stats(result), style="dim")
    write_json(
        output,
        {"model": model, "prompt": prompt, "budget": config.budget, "top_p": top_p, **result.to_dict()},
    )


@app.command()
def demo(
    model: ModelOpt = "default",
    method: MethodOpt = "self-index",
    budget: BudgetOpt = None,
    top_p: TopPOpt = None,
    context: Annotated[int, typer.Option(help="haystack tokens around the needle")] = 1000,
    max_new_tokens: int = 24,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    output: OutputOpt = None,
) -> None:
    """Needle in a haystack: dense vs a sparse method, answers, budgets and times side by side."""
    import sparsekv
    from sparsekv.eval.haystack import needle_prompt
    from sparsekv.models import chat_prompt

    sparse_config = build_config(method, budget, top_p)
    loaded, tokenizer = load(model, device, dtype)
    prompt = chat_prompt(tokenizer, needle_prompt(tokenizer, context_tokens=context, depth=0.5))
    results = {}
    for config in (SparseConfig(method="dense"), sparse_config):
        with console.status(f"generating with {config.method}..."):
            results[config.method] = sparsekv.generate(loaded, tokenizer, prompt, config, max_new_tokens)
    table = Table("method", "answer", "tokens attended / step", "KV cache", "prefill s", "decode tok/s")
    for name, result in results.items():
        attended = (
            "all"
            if result.avg_budget_tokens is None
            else f"{result.avg_budget_tokens:.0f} / {result.avg_context_tokens:.0f}"
        )
        table.add_row(
            name,
            result.texts[0].strip(),
            attended,
            f"{result.cache_bytes / 2**20:.1f} MiB",
            f"{result.prefill_seconds:.2f}",
            f"{result.tokens_per_second:.1f}",
        )
    console.print(table)
    dense_text, sparse_text = (r.texts[0].strip() for r in results.values())
    console.print(
        "same answer" if dense_text == sparse_text else "answers differ",
        style="bold green" if dense_text == sparse_text else "bold yellow",
    )
    write_json(output, {name: r.to_dict() for name, r in results.items()})


def _register_command_modules() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name and name.startswith(error.name):
                continue  # that feature is not part of this build
            raise
        if hasattr(module, "register"):
            module.register(app)


def main() -> None:
    _register_command_modules()
    try:
        app(standalone_mode=False)
    except (ConfigError, UserError) as error:
        console.print(f"error: {error}", style="bold red", markup=False)
        sys.exit(2)
    except Exception as error:
        # by class name: recent typer releases raise the exceptions of a click copy of their own, not the click
        # package's
        kinds = {cls.__name__ for cls in type(error).__mro__}
        if "Exit" in kinds:
            sys.exit(error.exit_code)
        if "ClickException" in kinds:
            error.show()
            sys.exit(error.exit_code)
        if "Abort" in kinds:
            sys.exit(130)
        if type(error).__name__ in ("AssetError", "ModelLoadError"):
            console.print(f"error: {error}", style="bold red", markup=False)
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
