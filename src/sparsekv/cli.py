"""`sparsekv` command line. Feature areas add their commands through a `register(app)` function in their own
`cli.py` module, listed in COMMAND_MODULES, so this file does not grow with every method. The CLI is the top
layer (docs/ARCHITECTURE.md): only the other CLI modules import this one; library code lives below."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import get_console
from rich.table import Table

from sparsekv.config import ConfigError, SparseConfig

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Sparse KV-cache decoding for HF transformers."
)
console = get_console()  # rich's global console: the eval harness's progress bars draw on the same one

#: modules exposing `register(app: typer.Typer)`; a module that is not part of this build is skipped
COMMAND_MODULES = [
    "sparsekv.eval.cli",
    "sparsekv.bench.cli",
    "sparsekv.training.cli",
    "sparsekv.cli_methods",
]


class UserError(Exception):
    """A bad input reported as one line, without a traceback."""


def parse_count_or_fraction(text: str, what: str) -> int | float:
    """'0.1' -> 0.1 (a fraction), '512' -> 512 (tokens)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what} must be an int (tokens) or a fraction in (0, 1), got {text!r}") from None


def parse_budget(text: str | None) -> int | float | None:
    """None -> the method's default budget."""
    return None if text is None else parse_count_or_fraction(text, "budget")


def parse_options(items: list[str] | None) -> dict:
    """key=value pairs; values are read as JSON when they parse (numbers, booleans, lists), else as strings."""
    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option expects key=value, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def parse_layers(text: str) -> tuple[int, ...]:
    """--dense-layers: '0,1' -> (0, 1); '' or 'none' -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--dense-layers expects comma-separated layer indices, got {text!r}") from None


def build_config(
    method: str,
    budget: str | None,
    top_p: float | None = None,
    dense_layers: str = "0,1",
    sink: int = 0,
    local: int = 0,
    gqa: str = "group",
    options: list[str] | None = None,
    dense_below: int | None = None,
) -> SparseConfig:
    return SparseConfig(
        method=method,
        budget=parse_budget(budget),
        top_p=top_p,
        dense_layers=parse_layers(dense_layers),
        sink=sink,
        local=local,
        gqa=gqa,
        options=parse_options(options),
        dense_below=dense_below,
    )


MethodOpt = Annotated[str, typer.Option("--method", "-m", help="selection method (see `sparsekv methods`)")]
BudgetOpt = Annotated[
    Optional[str], typer.Option(help="tokens (int) or fraction of the context in (0, 1); default: the method's")
]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="prune candidates to attention mass p")]
DenseLayersOpt = Annotated[str, typer.Option(help="comma-separated layers kept dense")]
DenseBelowOpt = Annotated[Optional[int], typer.Option(
    help="CUDA graph decode steps attend densely below this many cached tokens (over the batch); default: the "
    "method's measured crossover; 0: never")]
OptionOpt = Annotated[Optional[list[str]], typer.Option("--option", "-o", help="method option key=value")]
ModelOpt = Annotated[str, typer.Option(help="'default', an HF id, a local HF dir or a .gguf file")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")]
DtypeOpt = Annotated[str, typer.Option(help="float32, bfloat16 or float16")]
OutputOpt = Annotated[Optional[Path], typer.Option(help="write machine-readable JSON here")]


def load(model: str, device: str, dtype: str):
    """`models.load_model` in the order of the commands' options (the dtype by name)."""
    from sparsekv.models import load_model

    return load_model(model, dtype=dtype, device=device)


def write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")


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


def draft_count(text: str) -> int | str:
    """--draft-tokens: "auto" or a positive int (checked by `sparsekv.generate`)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--draft-tokens takes a positive int or auto, got {text!r}") from None


def format_stats(result) -> str:
    if result.avg_budget_tokens is None:
        budget = "dense (all tokens)"
    else:
        budget = (
            f"{result.avg_budget_tokens:.1f} of {result.avg_context_tokens:.1f} tokens "
            f"({100 * result.avg_budget_fraction:.1f}%) per step per sparse layer"
        )
    lossless = (
        f"; lossless: {100 * result.acceptance_rate:.0f}% of drafts accepted, "
        f"{result.tokens_per_verification:.2f} tokens per dense verification"
        if result.acceptance_rate is not None
        else ""
    )
    return (
        f"[{result.method}] attended {budget}; prefill {result.prefill_seconds:.2f}s, "
        f"decode {result.tokens_per_second:.1f} tokens/s{lossless}"
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
