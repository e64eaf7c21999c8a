"""GemFilter's filter-layer scan (`sparsekv gemfilter-scan`): needle prompts probe every layer for the distance
between the needle and the tokens that layer would keep (the paper's Fig. 5), and `recommend_layer` picks r.

An evaluation of the method in `sparsekv.prefill.gemfilter`, which stays free of the evaluation harness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparsekv.eval.haystack import NEEDLE, needle_prompt
from sparsekv.prefill.gemfilter import kept_counts, layer_scores, num_layers_of, pool_scores, select_tokens

__all__ = ["ProbeResult", "needle_span", "recommend_layer", "scan_layers", "selection_distance"]


@dataclass
class ProbeResult:
    """One needle prompt: per layer, how far the selection is from the needle and how much of it it holds."""

    context: int
    depth: float
    prompt_tokens: int
    needle: tuple[int, int]  # token span [start, end) of the needle in the prompt
    distance: list[int]  # per layer: min |selected - needle| (0 = a needle token is selected)
    coverage: list[float]  # per layer: fraction of the needle's tokens selected

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def needle_span(tokenizer, prompt: str, needle: str) -> tuple[list[int], tuple[int, int]]:
    """(prompt token ids, [start, end) token span of the needle's characters)."""
    start_char = prompt.find(needle)
    if start_char < 0:
        raise ValueError("the needle is not in the prompt")
    end_char = start_char + len(needle)
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        inside = [i for i, (a, b) in enumerate(offsets) if a < end_char and b > start_char]
        return ids, (inside[0], inside[-1] + 1)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    start = len(tokenizer.encode(prompt[:start_char], add_special_tokens=False))
    end = len(tokenizer.encode(prompt[:end_char], add_special_tokens=False))
    return ids, (start, max(end, start + 1))


def selection_distance(kept: torch.Tensor, span: tuple[int, int]) -> tuple[int, float]:
    start, end = span
    inside = ((kept >= start) & (kept < end)).sum().item()
    if inside:
        return 0, inside / (end - start)
    gaps = torch.minimum((kept - start).abs(), (kept - (end - 1)).abs())
    return int(gaps.min()), 0.0


@torch.no_grad()
def scan_layers(
    model,
    tokenizer,
    contexts: Sequence[int] = (1000, 2000, 3000),
    depths: Sequence[float] = (0.25, 0.5, 0.75),
    keep: float = 256,
    pool: int = 31,
    progress: Callable[[str], None] | None = None,
    window: int = 8,
) -> list[ProbeResult]:
    """Needle probes over every layer (one forward pass per prompt, the last layer's attention skipped)."""
    from sparsekv.models import chat_prompt  # late: transformers loads only when a scan runs

    device = next(model.parameters()).device
    num_layers = num_layers_of(model)
    results = []
    for context in contexts:
        for depth in depths:
            if progress:
                progress(f"context {context}, depth {depth}")
            prompt = chat_prompt(tokenizer, needle_prompt(tokenizer, context_tokens=context, depth=depth))
            ids, span = needle_span(tokenizer, prompt, NEEDLE)
            input_ids = torch.tensor([ids], device=device)
            mask = torch.ones_like(input_ids)
            scores = layer_scores(model, input_ids, mask, range(num_layers), window)
            counts = kept_counts(keep, [len(ids)])
            distance, coverage = [], []
            for layer in range(num_layers):
                pooled = pool_scores(scores[layer], mask.bool(), pool)
                kept = select_tokens(pooled, mask.bool(), counts)[0].cpu()
                d, c = selection_distance(kept, span)
                distance.append(d)
                coverage.append(c)
            results.append(ProbeResult(context, depth, len(ids), span, distance, coverage))
    return results


def recommend_layer(probes: Sequence[ProbeResult], min_coverage: float = 0.5) -> int:
    """The first layer whose selection holds at least `min_coverage` of the needle in every probe (the paper takes
    the first layer that finds the needle); else the layer with the best mean coverage."""
    num_layers = len(probes[0].coverage)
    for layer in range(num_layers):
        if all(p.distance[layer] == 0 and p.coverage[layer] >= min_coverage for p in probes):
            return layer
    mean = [sum(p.coverage[layer] for p in probes) / len(probes) for layer in range(num_layers)]
    return max(range(num_layers), key=lambda layer: (mean[layer], -layer))
