"""Decode-faithful perplexity.

Per window of `context` tokens: a dense prefill of the first `prefix` tokens, then the remaining tokens are fed in
chunks through the enabled model with the same SparseCache. In sparsekv every query of a chunk selects only from its
own causal past (exactly what token-by-token decoding would select; a core test checks that), so chunking changes
the speed, not the numbers. Every token after the prefix is scored: its prediction came from a forward pass whose
attention used only what the method selected at that position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.eval.common import (
    NO_CACHE,
    ModelHandle,
    ResultCache,
    TaskRun,
    TextWindows,
    budget_summary,
    describe,
    sparse_pass,
    token_windows,
)


@dataclass(frozen=True)
class PplSettings:
    context: int = 4096
    prefix: int = 512
    chunk: int = 256
    windows: int = 1
    start: int = 0  # token offset of the first window in the text
    #: the dense prefix fed in chunks of this many tokens, as transformers' `prefill_chunk_size` feeds a prompt
    #: (None: in one forward); a compressing method may then store it chunk by chunk, which changes the numbers
    prefill_chunk: int | None = None

    def check(self) -> None:
        if self.context < 2 or self.prefix < 1 or self.prefix >= self.context:
            raise ConfigError(f"need 1 <= prefix < context, got prefix={self.prefix}, context={self.context}")
        if self.chunk < 1 or self.windows < 1 or self.start < 0:
            raise ConfigError("chunk and windows must be >= 1 and start >= 0")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError(f"the prefill chunk must be >= 1 token, got {self.prefill_chunk}")


def text_windows(tokenizer, text: str, settings: PplSettings) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows of `context` token ids ([1, context] each)."""
    return token_windows(tokenizer, text, settings.context, settings.windows, settings.start)


@torch.inference_mode()
def window_nll(
    model, ids: torch.Tensor, config: SparseConfig, prefix: int, chunk: int, prefill_chunk: int | None = None
) -> dict:
    """Summed negative log-likelihood of ids[prefix:] given dense prefill of ids[:prefix] (in chunks of
    `prefill_chunk` tokens when given) and sparse decode."""
    total = ids.shape[1]
    nll = torch.zeros((), dtype=torch.float64)
    with sparse_pass(model, config, prompt_length=prefix if prefill_chunk else None) as run:
        ids = ids.to(run.device)
        for lo in range(0, prefix, prefill_chunk or prefix):
            out = run(ids[:, lo : min(prefix, lo + (prefill_chunk or prefix))], logits_to_keep=1)
        logits = out.logits[:, -1:].float()
        nll += F.cross_entropy(logits[0], ids[0, prefix : prefix + 1], reduction="sum").double().cpu()
        # inputs prefix .. total-2 predict targets prefix+1 .. total-1
        for lo in range(prefix, total - 1, chunk):
            hi = min(lo + chunk, total - 1)
            logits = run(ids[:, lo:hi]).logits[0].float()
            nll += F.cross_entropy(logits, ids[0, lo + 1 : hi + 1], reduction="sum").double().cpu()
    stats = run.cache.stats
    summary = stats.summary()
    return {
        "nll": float(nll),
        "tokens": total - prefix,
        "seconds": run.seconds,
        "avg_budget_tokens": summary["avg_budget_tokens"],
        "avg_context_tokens": summary["avg_context_tokens"],
        "avg_budget_fraction": summary["avg_budget_fraction"],
        "budget_rows": sum(int(stats.layer_counts(i)[0].numel()) for i in range(len(run.cache.layers))),
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
    data = TextWindows(handle, text, text_name, settings.context, settings.windows, settings.start)
    # the chunk size changes the speed, not the result: it is not part of the key; a prefix in one forward keeps
    # the key it had before chunked prefixes existed (cells cached then stay valid)
    shape = {k: v for k, v in settings.__dict__.items() if k != "chunk" and not (k == "prefill_chunk" and v is None)}
    configs = [config]
    if with_dense and config.method != "dense":
        configs.append(SparseConfig(method="dense"))
    results = {}
    with TaskRun("ppl", handle, cache, len(configs) * settings.windows, "ppl", quiet=quiet) as run:
        for cfg in configs:
            parts = []
            for w in range(settings.windows):

                def compute(w=w, cfg=cfg):
                    return window_nll(handle.get()[0], data.ids[w], cfg, settings.prefix, settings.chunk,
                                      settings.prefill_chunk)  # fmt: skip

                parts.append(run.cell(cfg, data.fields(shape, w), compute,
                                      label=f"{describe(cfg)} window {w + 1}/{settings.windows}"))  # fmt: skip
                run.advance()
            results[cfg.method] = summarize(parts)
    main = results[config.method]
    payload = run.payload(config, text=data.name, context=settings.context, prefix=settings.prefix,
                          chunk=settings.chunk, windows=settings.windows, prefill_chunk=settings.prefill_chunk,
                          **main)  # fmt: skip
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
        **budget_summary(parts, "budget_rows", ("avg_budget_tokens", "avg_context_tokens", "avg_budget_fraction")),
        "per_window_ppl": [math.exp(p["nll"] / p["tokens"]) for p in parts],
    }
