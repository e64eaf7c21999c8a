"""What the command groups share: their options, the parsers behind them, the console and the JSON output.
The `sparsekv` app (cli.py) and each feature area's commands (eval/cli.py, bench/cli.py, training/cli.py,
cli_methods.py) import these; nothing imports the app itself (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import get_console

from sparsekv.config import ConfigError, SparseConfig

console = get_console()  # rich's global console: the eval harness's progress bars draw on the same one


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
