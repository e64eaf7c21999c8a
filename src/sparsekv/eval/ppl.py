"""Decode-faithful perplexity.

Per window of `context` tokens: a dense prefill of the first `prefix` tokens, then the remaining tokens are fed in
chunks through the enabled model with the same SparseCache. In sparsekv every query of a chunk selects only from its
own causal past (exactly what token-by-token decoding would select; a core test checks that), so chunking changes
the speed, not the numbers. Every token after the prefix is scored: its prediction came from a forward pass whose
attention used only what the method selected at that position.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import sparsekv
from sparsekv.cache import SparseCache
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.common import (
    NO_CACHE,
    ModelHandle,
    Progress,
    ResultCache,
    config_dict,
    config_key,
    describe,
    digest,
    weighted_budget,
)
from sparsekv.hf_compat import cache_kwargs


@dataclass(frozen=True)
class PplSettings:
    context: int = 4096
    prefix: int = 512
    chunk: int = 256
    windows: int = 1
    start: int = 0  # token offset of the first window in the text

    def check(self) -> None:
        if self.context < 2 or self.prefix < 1 or self.prefix >= self.context:
            raise ConfigError(f"need 1 <= prefix < context, got prefix={self.prefix}, context={self.context}")
        if self.chunk < 1 or self.windows < 1 or self.start < 0:
            raise ConfigError("chunk and windows must be >= 1 and start >= 0")


def text_windows(tokenizer, text: str, settings: PplSettings) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows of `context` token ids ([1, context] each)."""
    needed = settings.start + settings.windows * settings.context
    # tokenize only as much text as needed (about 3-5 characters per token for English), growing if short
    chars = needed * 6 + 1000
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False, return_tensors="pt").input_ids[0]
        if len(ids) >= needed + 1 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < needed:
        raise ConfigError(
            f"the text has {len(ids)} tokens, fewer than start + windows x context = {needed}; "
            "use a longer text or fewer/shorter windows"
        )
    lo = settings.start
    return [ids[lo + i * settings.context : lo + (i + 1) * settings.context][None] for i in range(settings.windows)]


@torch.inference_mode()
def window_nll(model, ids: torch.Tensor, config: SparseConfig, prefix: int, chunk: int) -> dict:
    """Summed negative log-likelihood of ids[prefix:] given dense prefill of ids[:prefix] and sparse decode."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    total = ids.shape[1]
    cache = SparseCache.for_model(model, config)
    nll = torch.zeros((), dtype=torch.float64)
    start = time.perf_counter()
    with sparsekv.enabled(model, config):
        out = model(input_ids=ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1:].float()
        nll += F.cross_entropy(logits[0], ids[0, prefix : prefix + 1], reduction="sum").double().cpu()
        # inputs prefix .. total-2 predict targets prefix+1 .. total-1
        for lo in range(prefix, total - 1, chunk):
            hi = min(lo + chunk, total - 1)
            out = model(input_ids=ids[:, lo:hi], **cache_kwargs(model, cache), use_cache=True)
            logits = out.logits[0].float()
            nll += F.cross_entropy(logits, ids[0, lo + 1 : hi + 1], reduction="sum").double().cpu()
    seconds = time.perf_counter() - start
    stats = cache.stats.summary()
    rows = sum(int(cache.stats.layer_counts(i)[0].numel()) for i in range(len(cache.layers)))
    return {
        "nll": float(nll),
        "tokens": total - prefix,
        "seconds": seconds,
        "avg_budget_tokens": stats["avg_budget_tokens"],
        "avg_context_tokens": stats["avg_context_tokens"],
        "avg_budget_fraction": stats["avg_budget_fraction"],
        "budget_rows": rows,
    }


def run_ppl(
    handle: ModelHandle,
    config: SparseConfig,
    settings: PplSettings,
    text: str | None = None,
    text_name: str = "haystack",
    with_dense: bool = False,
    cache: ResultCache = NO_CACHE,
    quiet: bool = True,
) -> dict:
    """Perplexity of `config` over the windows of `text` (default: the embedded Paul Graham essays)."""
    settings.check()
    if text is None:
        from sparsekv.assets import haystack_text

        text, text_name = haystack_text(), "haystack"
    text_id = digest(text)
    configs = [config]
    if with_dense and config.method != "dense":
        configs.append(SparseConfig(method="dense"))
    results = {}
    windows = None
    with Progress(len(configs) * settings.windows, "ppl", quiet=quiet) as progress:
        for cfg in configs:
            parts = []
            for w in range(settings.windows):
                # the chunk size changes the speed, not the result: it is not part of the key
                shape = {k: v for k, v in settings.__dict__.items() if k != "chunk"}
                key = {**handle.key, "text": text_id, "settings": shape, "window": w, "config": config_key(cfg)}
                progress.label(f"{describe(cfg)} window {w + 1}/{settings.windows}")

                def compute(w=w, cfg=cfg):
                    nonlocal windows
                    model, tokenizer = handle.get()
                    if windows is None:
                        windows = text_windows(tokenizer, text, settings)
                    return window_nll(model, windows[w], cfg, settings.prefix, settings.chunk)

                parts.append(cache.cached("ppl", key, compute))
                progress.advance()
            results[cfg.method] = summarize(parts)
    main = results[config.method]
    payload = {
        "task": "ppl",
        "model": handle.spec if handle.name is None else handle.name,
        "config": config_dict(config),
        "text": text_name,
        "context": settings.context,
        "prefix": settings.prefix,
        "chunk": settings.chunk,
        "windows": settings.windows,
        **main,
    }
    if with_dense:
        payload["dense_ppl"] = results["dense"]["ppl"] if config.method != "dense" else main["ppl"]
    return payload


def summarize(parts: list[dict]) -> dict:
    nll = sum(p["nll"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    seconds = sum(p["seconds"] for p in parts)
    return {
        "ppl": math.exp(nll / tokens),
        "nll_per_token": nll / tokens,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "avg_budget_tokens": weighted_budget([(p["avg_budget_tokens"], p["budget_rows"]) for p in parts]),
        "avg_context_tokens": weighted_budget([(p["avg_context_tokens"], p["budget_rows"]) for p in parts]),
        "avg_budget_fraction": weighted_budget([(p["avg_budget_fraction"], p["budget_rows"]) for p in parts]),
        "per_window_ppl": [math.exp(p["nll"] / p["tokens"]) for p in parts],
    }
