"""The commands of the methods: `sparsekv calibrate-ds` (Double Sparsity), `sparsekv gemfilter-scan` and
`sparsekv gemfilter-generate` (GemFilter), `sparsekv cache-memory` (self-index's compressed cache, or any method).

CLI layer (docs/ARCHITECTURE.md): the methods live in `sparsekv.selectors` / `sparsekv.prefill` and know nothing of
the command line; this module parses options, loads the model and prints. A method with commands of its own adds
a `register_<method>(app)` here and calls it from `register`.
"""

# no `from __future__ import annotations`: typer reads the commands' signatures
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from sparsekv.assets import haystack_text
from sparsekv.cli_options import (
    DenseLayersOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    OptionOpt,
    OutputOpt,
    UserError,
    build_config,
    console,
    format_stats,
    load,
    parse_count_or_fraction,
    write_json,
)
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.cache_memory import measure_cache_memory
from sparsekv.eval.gemfilter_scan import recommend_layer, scan_layers
from sparsekv.fingerprint import model_fingerprint
from sparsekv.prefill.gemfilter import (
    GemFilter,
    _check_options,
    default_filter_layer,
    last_selection,
    render_selection,
)
from sparsekv.selectors.double_sparsity import calibrate_channels, save_channels


def register(app: typer.Typer) -> None:
    register_double_sparsity(app)
    register_gemfilter(app)
    register_self_index(app)


# ------------------------------------------------------------------------------------------------ Double Sparsity


def register_double_sparsity(app: typer.Typer) -> None:
    """Adds `sparsekv calibrate-ds` (Double Sparsity's channel file)."""

    @app.command("calibrate-ds")
    def calibrate_ds(
        output: Annotated[Path, typer.Option(help="channels file to write (.safetensors)")],
        model: Annotated[
            str, typer.Option(help="'default', an HF id, a local HF dir or a .gguf file")
        ] = "default",
        text_file: Annotated[
            Path | None, typer.Option(help="calibration text (default: the Paul Graham essays)")
        ] = None,
        tokens: Annotated[int, typer.Option(help="calibration tokens in total")] = 4096,
        segment: Annotated[int, typer.Option(help="tokens per forward pass")] = 2048,
        device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
        dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    ) -> None:
        """Rank each layer's and kv-head's key channels by mean |q⊙k| for the double-sparsity method."""
        if tokens < 1 or segment < 1:
            raise ConfigError("--tokens and --segment must be >= 1")
        if text_file is not None:
            if not text_file.is_file():
                raise ConfigError(f"text file {text_file} not found")
            text, source = text_file.read_text(), str(text_file)
        else:
            text, source = haystack_text(), "paul-graham-essays"
        loaded, tokenizer = load(model, device, dtype)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :tokens]
        if ids.shape[1] < tokens:
            console.print(
                f"note: the text has only {ids.shape[1]} tokens; calibrating on those", style="yellow"
            )
        segments = list(ids.split(segment, dim=1))
        with console.status("calibrating...") as status:
            scores = calibrate_channels(
                loaded, segments, progress=lambda i, n: status.update(f"calibrating: segment {i}/{n}")
            )
        metadata = {
            "fingerprint": model_fingerprint(loaded),
            "model": model,
            "tokens": int(ids.shape[1]),
            "segment": segment,
            "text": source,
            "dtype": dtype,
            "statistic": "mean|q_c| * mean|k_c| post-RoPE, summed over the kv-head's query group",
        }
        save_channels(output, scores, metadata)
        head_dim = scores.shape[-1]
        top = max(1, head_dim // 8)
        share = (scores.sort(-1, descending=True).values[..., :top].sum(-1) / scores.sum(-1)).mean(-1)
        console.print(
            f"wrote {output}: {scores.shape[0]} layers x {scores.shape[1]} kv heads x {head_dim} "
            f"channels from {ids.shape[1]} tokens"
        )
        console.print(
            "share of the |q⊙k| mass in the top d/8 channels, per layer: "
            + " ".join(f"{float(s):.2f}" for s in share)
        )


# ------------------------------------------------------------------------------------------------------ GemFilter


def _parse_list(text: str, kind: type, name: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--{name} expects comma-separated {kind.__name__}s, got {text!r}") from None


def register_gemfilter(app: typer.Typer) -> None:
    """Adds `sparsekv gemfilter-scan` and `sparsekv gemfilter-generate`."""

    @app.command("gemfilter-scan")
    def gemfilter_scan(
        model: ModelOpt = "default",
        contexts: Annotated[
            str, typer.Option(help="comma-separated haystack lengths (tokens)")
        ] = "1000,2000,3000",
        depths: Annotated[
            str, typer.Option(help="comma-separated needle depths in [0, 1]")
        ] = "0.25,0.5,0.75",
        keep: Annotated[str, typer.Option(help="tokens kept (int) or fraction")] = "256",
        pool: Annotated[int, typer.Option(help="average-pool kernel (the paper: 5)")] = GemFilter.pool,
        window: Annotated[
            int, typer.Option(help="queries scoring the tokens (the paper: 1)")
        ] = GemFilter.window,
        device: DeviceOpt = "cpu",
        dtype: DtypeOpt = "float32",
        output: OutputOpt = None,
    ) -> None:
        """Needle probe over layers: distance between the needle and the selected tokens per layer (GemFilter
        Fig. 5); recommends the filter layer."""
        keep_value = parse_count_or_fraction(keep, "--keep")
        _check_options(keep_value, None, pool, window)
        context_list = _parse_list(contexts, int, "contexts")
        depth_list = _parse_list(depths, float, "depths")
        loaded, tokenizer = load(model, device, dtype)
        with console.status("probing...") as status:
            probes = scan_layers(
                loaded,
                tokenizer,
                context_list,
                depth_list,
                keep_value,
                pool,
                progress=lambda text: status.update(f"probing {text}"),
                window=window,
            )
        best = recommend_layer(probes)
        num_layers = len(probes[0].distance)
        table = Table("layer", *(f"{p.context}@{p.depth:g}" for p in probes), "mean coverage")
        for layer in range(num_layers):
            cells = [
                f"{p.distance[layer]}" + ("" if p.distance[layer] else f" ({p.coverage[layer]:.0%})")
                for p in probes
            ]
            mean = sum(p.coverage[layer] for p in probes) / len(probes)
            table.add_row(f"{layer}{' *' if layer == best else ''}", *cells, f"{mean:.0%}")
        console.print(table)
        console.print(
            f"distance = min |selected - needle| in tokens (0 = needle kept; % = needle tokens kept), "
            f"keep={keep_value}. Recommended filter_layer: {best} "
            f"(default {default_filter_layer(num_layers)} of {num_layers})."
        )
        write_json(
            output,
            {
                "model": model,
                "keep": keep_value,
                "pool": pool,
                "window": window,
                "recommended_layer": best,
                "default_layer": default_filter_layer(num_layers),
                "probes": [p.to_dict() for p in probes],
            },
        )

    @app.command("gemfilter-generate")
    def gemfilter_generate(
        prompt: Annotated[str | None, typer.Option(help="the prompt (chat template applied)")] = None,
        prompt_file: Annotated[Path | None, typer.Option(help="read the prompt from this file")] = None,
        needle_context: Annotated[
            int | None, typer.Option(help="use a needle prompt of this many tokens")
        ] = None,
        depth: Annotated[float, typer.Option(help="needle depth for --needle-context")] = 0.5,
        model: ModelOpt = "default",
        keep: Annotated[str, typer.Option(help="tokens kept (int) or fraction")] = "1024",
        filter_layer: Annotated[
            str | None,
            typer.Option(help="0-based filter layer, or a fraction of the depth like 0.4 (default 0.6)"),
        ] = None,
        pool: Annotated[int, typer.Option(help="average-pool kernel (the paper: 5)")] = GemFilter.pool,
        window: Annotated[
            int, typer.Option(help="queries scoring the tokens (the paper: 1)")
        ] = GemFilter.window,
        max_new_tokens: int = 32,
        raw: Annotated[bool, typer.Option(help="do not apply the chat template")] = False,
        show_selected: Annotated[bool, typer.Option(help="print the kept prompt text")] = False,
        selected_output: Annotated[Path | None, typer.Option(help="save the kept prompt text here")] = None,
        device: DeviceOpt = "cpu",
        dtype: DtypeOpt = "float32",
        output: OutputOpt = None,
    ) -> None:
        """Generate with GemFilter; --show-selected prints the prompt text the filter kept."""
        import sparsekv
        from sparsekv.models import chat_prompt

        if sum(x is not None for x in (prompt, prompt_file, needle_context)) != 1:
            raise UserError("give exactly one of --prompt, --prompt-file, --needle-context")
        layer = None
        if filter_layer is not None:
            try:
                layer = parse_count_or_fraction(filter_layer, "--filter-layer")
            except ConfigError:
                raise ConfigError(
                    f"--filter-layer must be a layer index or a fraction of the depth like 0.4, got {filter_layer!r}"
                ) from None
        options = {
            "keep": parse_count_or_fraction(keep, "--keep"),
            "filter_layer": layer,
            "pool": pool,
            "window": window,
        }
        config = SparseConfig(method="gemfilter", options=options)
        loaded, tokenizer = load(model, device, dtype)
        if needle_context is not None:
            from sparsekv.eval.haystack import needle_prompt

            text = needle_prompt(tokenizer, context_tokens=needle_context, depth=depth)
        else:
            text = prompt if prompt is not None else prompt_file.read_text()
        text = text if raw else chat_prompt(tokenizer, text)
        result = sparsekv.generate(loaded, tokenizer, text, config, max_new_tokens=max_new_tokens)
        selection = last_selection(loaded)
        kept_text = render_selection(tokenizer, selection) if selection is not None else text
        if show_selected:
            console.rule("kept prompt")
            console.print(kept_text, markup=False, highlight=False)
            console.rule()
        if selected_output is not None:
            selected_output.parent.mkdir(parents=True, exist_ok=True)
            selected_output.write_text(kept_text + "\n")
        console.print(result.texts[0], markup=False, highlight=False)
        summary = (
            (
                f"kept {len(selection.kept[0])} of {selection.prompt_lengths[0]} prompt tokens at layer "
                f"{selection.filter_layer} (filter pass {selection.seconds:.2f}s)"
            )
            if selection
            else ""
        )
        console.print(f"{summary}; {format_stats(result)}", style="dim")
        write_json(
            output,
            {
                "model": model,
                "options": options,
                "kept_text": kept_text,
                **(selection.to_dict() if selection else {}),
                **result.to_dict(),
            },
        )


# ----------------------------------------------------------------------------------------------------- self-index


def register_self_index(app: typer.Typer) -> None:
    """Adds `sparsekv cache-memory` (the bytes the self-index cache holds; any method's cache can be measured)."""

    @app.command("cache-memory")
    def cache_memory_command(
        model: ModelOpt = "default",
        context: Annotated[int, typer.Option(help="prompt tokens (haystack text)")] = 4096,
        method: Annotated[str, typer.Option("--method", "-m")] = "self-index",
        dense_layers: DenseLayersOpt = "0,1",
        option: OptionOpt = None,
        decode_tokens: Annotated[int, typer.Option(help="decode steps after the prefill")] = 8,
        device: DeviceOpt = "cpu",
        dtype: DtypeOpt = "float32",
        output: OutputOpt = None,
    ) -> None:
        """Bytes the KV cache actually holds per token, by component, vs a bf16 dense cache."""
        config = build_config(method, "0.1", None, dense_layers, 0, 0, "group", option)
        loaded, tokenizer = load(model, device, dtype)
        report = measure_cache_memory(loaded, tokenizer, config, context, decode_tokens)
        per = report["components_bytes_per_token_per_kv_head_per_layer"]
        table = Table("component", "bytes / token / kv-head / layer", "total MiB")
        for name, value in report["components"].items():
            if value:
                table.add_row(name, f"{per[name]:.2f}", f"{value / 2**20:.2f}")
        console.print(table)
        ratio = report["compressed_layers_ratio_vs_bf16"]
        compressed = (
            f"; {100 * ratio:.1f}% on the {report['compressed_layers']} compressed layers" if ratio else ""
        )
        console.print(
            f"{report['tokens']} tokens: {report['bytes_per_token']:.0f} B/token held vs "
            f"{report['dense_bf16_bytes_per_token']} B/token for a bf16 dense cache "
            f"({100 * report['ratio_vs_bf16']:.1f}% overall{compressed}; {report['dense_layers']} dense layers at "
            f"{dtype})"
        )
        if report["allocator"] is not None:
            held, peak = report["allocator"]["held_bytes"], report["allocator"]["peak_above_start_bytes"]
            console.print(f"allocator: {held / 2**20:.1f} MiB held after the run, peak {peak / 2**20:.1f} MiB above "
                          "its start")  # fmt: skip
        write_json(output, report)
