"""`sparsekv train-hash`: train Spotlight hashes for a model and write a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("train-hash")
    def train_hash_command(
        output: Annotated[Path, typer.Option(help="checkpoint to write (.safetensors)")],
        model: Annotated[
            str, typer.Option(help="'default', an HF id, a local HF dir or a .gguf file")
        ] = "default",
        text_files: Annotated[
            Optional[list[Path]],
            typer.Option(
                "--text-files",
                help="calibration text, one file per genre; training windows are drawn evenly from "
                "them (default: the embedded essays, their last 20% held out)",
            ),
        ] = None,
        eval_text_files: Annotated[
            Optional[list[Path]],
            typer.Option(
                "--eval-text-files",
                help="held-out text for the IoU reported after each layer (one file per genre)",
            ),
        ] = None,
        bits: int = 128,
        hash: Annotated[str, typer.Option("--hash", help="mlp or linear")] = "mlp",
        hidden: Annotated[Optional[int], typer.Option(help="MLP width (default: head_dim)")] = None,
        seed: int = 0,
        steps: Annotated[int, typer.Option(help="optimizer steps per layer")] = 40,
        batch_queries: int = 16,
        window: Annotated[int, typer.Option(help="tokens per calibration window")] = 2048,
        train_windows: int = 2,
        eval_windows: int = 1,
        alpha: Annotated[float, typer.Option(help="ranking margin")] = 0.0,
        dense_layers: Annotated[
            str, typer.Option(help="comma-separated layers kept dense (not trained)")
        ] = "0,1",
        device: str = "cpu",
        report: Annotated[Optional[Path], typer.Option(help="also write the training report as JSON")] = None,
    ) -> None:
        """Train Spotlight hash functions (ranking loss, frozen model, layer by layer; resumable)."""
        from rich.console import Console
        from rich.table import Table

        from sparsekv.cli_options import load, parse_layers
        from sparsekv.config import ConfigError
        from sparsekv.training.capture import read_texts
        from sparsekv.training.trainer import TrainConfig, train_hash

        console = Console()
        cfg = TrainConfig(
            bits=bits,
            hash=hash,
            hidden=hidden,
            seed=seed,
            steps=steps,
            batch_queries=batch_queries,
            window=window,
            train_windows=train_windows,
            eval_windows=eval_windows,
            alpha=alpha,
            dense_layers=parse_layers(dense_layers),
        )
        if eval_text_files and not text_files:
            raise ConfigError("--eval-text-files needs --text-files (the default essays hold out their own part)")
        train_text = [read_texts([p]) for p in text_files] if text_files else None
        eval_text = [read_texts([p]) for p in eval_text_files] if eval_text_files else None
        with console.status("loading the model..."):
            loaded, tokenizer = load(model, device, "float32")
        result = train_hash(loaded, tokenizer, cfg, output, train_text, eval_text, console=console)
        table = Table("layer", "IoU group", "IoU head", "loss", "s")
        for layer, m in result["per_layer"].items():
            table.add_row(
                layer,
                f"{m.get('iou_group', float('nan')):.3f}",
                f"{m.get('iou_head', float('nan')):.3f}",
                f"{m.get('final_loss', float('nan')):.4f}",
                f"{m.get('seconds', 0):.0f}",
            )
        console.print(table)
        console.print(
            f"held-out IoU@{cfg.top_fraction:g}: group {result.get('mean_iou_group', float('nan')):.3f}, "
            f"head {result.get('mean_iou_head', float('nan')):.3f}; wrote {output} in "
            f"{result['seconds']:.0f}s"
        )
        if report is not None:
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(json.dumps(result, indent=2) + "\n")
