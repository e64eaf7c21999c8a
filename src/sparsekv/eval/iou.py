"""Retrieval quality: the method's selection vs the oracle top-k at the same budget, per layer and selection head.

On a window of real text: dense prefill of the first `context - queries` tokens, then the last `queries` tokens go
through the enabled model in one chunk (each query still selects from its own causal past). Every sparse layer's
`attend` call, which receives the final selection (after any top-p pruner), is observed: for each query row the
oracle picks the same number of tokens by exact attention weight (summed over the group for gqa="group"), and we
record
- iou = |method & oracle| / |method | oracle|
- recall = |method & oracle| / |oracle|
- mass = share of the exact attention mass that the method's tokens carry (the oracle's own share is `oracle_mass`).
No method-specific code: any registered method is observed through the same hook. Dense layers report None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.cache import SparseCache
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.common import (
    NO_CACHE,
    ModelHandle,
    ResultCache,
    TaskRun,
    TextWindows,
    describe,
    mean,
    sparse_pass,
)
from sparsekv.selectors.oracle import exact_weights  # [B, S, Q, N]: the oracle's own weights
from sparsekv.step import DecodeStep, Selection

METRICS = ("iou", "recall", "mass", "oracle_mass")


@dataclass(frozen=True)
class IouSettings:
    context: int = 2048
    queries: int = 64
    windows: int = 1
    start: int = 0

    def check(self) -> None:
        if self.queries < 1 or self.queries >= self.context:
            raise ConfigError(f"need 1 <= queries < context, got queries={self.queries}, context={self.context}")


def compare_selection(step: DecodeStep, selection: Selection) -> dict[str, torch.Tensor]:
    """Per (batch, selection head, query) row: iou, recall, mass, oracle_mass of `selection` ([B, S, Q] each)."""
    num_keys = step.keys.shape[-2]
    chosen = selection.to_mask(num_keys) & step.visible[:, None]
    counts = chosen.sum(-1)  # [B, S, Q]
    weights = exact_weights(step)
    ranked = weights.masked_fill(~step.visible[:, None], float("-inf"))
    k_max = max(int(counts.max()), 1)
    top = ranked.topk(k_max, dim=-1).indices
    keep = torch.arange(k_max, device=top.device) < counts[..., None]
    oracle = torch.zeros_like(chosen).scatter_(-1, top, keep)
    inter = (chosen & oracle).sum(-1).float()
    union = (chosen | oracle).sum(-1).float()
    total = weights.sum(-1).clamp(min=1e-30)
    return {
        "iou": torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(inter)),
        "recall": torch.where(counts > 0, inter / counts.clamp(min=1).float(), torch.ones_like(inter)),
        "mass": (weights * chosen).sum(-1) / total,
        "oracle_mass": (weights * oracle).sum(-1) / total,
    }


class SelectionObserver:
    """Wraps the `attend` of every sparse layer's selector in one cache (instance attributes, nothing global).

    Methods that keep K/V themselves (`stores_kv`, compressed caches) hand attention a stand-in for the keys; for
    them the methods that take keys in (prompt and decode) are wrapped too, and the observer keeps a
    full-precision shadow copy of K for the oracle.
    """

    def __init__(self, cache: SparseCache):
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.rows: dict[int, int] = {}
        for layer_idx, layer in enumerate(cache.layers):
            if layer.selector is not None:
                self._wrap(layer_idx, layer.selector)

    def _wrap(self, layer_idx: int, selector) -> None:
        original = selector.attend
        shadow: list[torch.Tensor] = []
        if getattr(selector, "stores_kv", False):
            # every way keys reach the method's own storage: the whole prompt, a chunked prompt, decode tokens
            for name in ("prefill", "open_prompt", "store_prompt_chunk", "store"):
                setattr(selector, name, self._recording(getattr(selector, name), shadow))

        def attend(step, selection, scaling):
            observed = step
            if shadow:
                observed = step.replace(keys=torch.cat(shadow, dim=-2) if len(shadow) > 1 else shadow[0])
                if len(shadow) > 1:
                    shadow[:] = [observed.keys]
            metrics = compare_selection(observed, selection)
            for name, value in metrics.items():
                per_head = value.double().sum(dim=(0, 2)).cpu()  # [S]
                bucket = self.sums.setdefault(layer_idx, {})
                bucket[name] = bucket.get(name, 0) + per_head
            self.rows[layer_idx] = self.rows.get(layer_idx, 0) + value.shape[0] * value.shape[2]
            return original(step, selection, scaling)

        selector.attend = attend

    @staticmethod
    def _recording(method, shadow: list[torch.Tensor]):
        def call(keys, *args, **kwargs):
            shadow.append(keys.detach())
            return method(keys, *args, **kwargs)

        return call

    def per_head(self, num_layers: int, name: str) -> list[list[float] | None]:
        out = []
        for i in range(num_layers):
            if i not in self.sums:
                out.append(None)
            else:
                out.append((self.sums[i][name] / self.rows[i]).tolist())
        return out


@torch.inference_mode()
def window_iou(model, ids: torch.Tensor, config: SparseConfig, queries: int) -> dict:
    prefix = ids.shape[1] - queries
    with sparse_pass(model, config) as run:
        observer = SelectionObserver(run.cache)
        ids = ids.to(run.device)
        run(ids[:, :prefix], logits_to_keep=1)
        run(ids[:, prefix:], logits_to_keep=1)
    stats = run.cache.stats.summary()
    num_layers = len(run.cache.layers)
    return {
        "per_head": {name: observer.per_head(num_layers, name) for name in METRICS},
        "rows": [observer.rows.get(i, 0) for i in range(num_layers)],
        "avg_budget_tokens": stats["avg_budget_tokens"],
        "avg_context_tokens": stats["avg_context_tokens"],
        "seconds": run.seconds,
    }


def _combine(parts: list[dict], name: str) -> list[list[float] | None]:
    """Row-weighted mean over windows of the per-head values."""
    out = []
    for layer in range(len(parts[0]["rows"])):
        rows = [p["rows"][layer] for p in parts]
        if not sum(rows):
            out.append(None)
            continue
        heads = len(parts[0]["per_head"][name][layer])
        out.append([sum(p["per_head"][name][layer][h] * r for p, r in zip(parts, rows)) / sum(rows)
                    for h in range(heads)])  # fmt: skip
    return out


def run_iou(
    handle: ModelHandle,
    config: SparseConfig,
    settings: IouSettings,
    text: str | None = None,
    text_name: str = "haystack",
    cache: ResultCache = NO_CACHE,
    quiet: bool = True,
) -> dict:
    settings.check()
    data = TextWindows(handle, text, text_name, settings.context, settings.windows, settings.start)
    parts = []
    with TaskRun("iou", handle, cache, settings.windows, f"iou {describe(config)}", quiet=quiet) as run:
        for w in range(settings.windows):

            def compute(w=w):
                return window_iou(handle.get()[0], data.ids[w], config, settings.queries)

            parts.append(run.cell(config, data.fields(settings.__dict__, w), compute))
            run.advance(f"window {w + 1}")
    payload = run.payload(config, text=data.name, context=settings.context, queries=settings.queries,
                          windows=settings.windows, avg_budget_tokens=mean(p["avg_budget_tokens"] for p in parts),
                          avg_context_tokens=mean(p["avg_context_tokens"] for p in parts))  # fmt: skip
    for name in METRICS:
        grid = _combine(parts, name)
        payload[f"{name}_per_head"] = grid
        payload[f"{name}_per_layer"] = [None if row is None else sum(row) / len(row) for row in grid]
        payload[f"mean_{name}"] = mean(v for row in grid if row is not None for v in row)
    return payload
