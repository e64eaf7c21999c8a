"""The bytes a KV cache actually holds (`sparsekv cache-memory`, scripts/self_index_eval.py's memory section): a
haystack prefill and a few greedy decode steps through the model, then `cache.cache_memory` of the cache. On CUDA
the allocator's counts stand beside it: the bytes still allocated once the run is over (the cache and whatever
else it keeps alive) and the peak above the start (the prefill's activations and any copy the cache makes of
the prompt), both measured, not computed."""

from __future__ import annotations

import torch

from sparsekv.config import ConfigError, SparseConfig


def measure_cache_memory(
    model, tokenizer, config: SparseConfig, context: int, decode_tokens: int = 8
) -> dict:
    """Prefill `context` haystack tokens, decode `decode_tokens` greedily, then measure the cache."""
    import sparsekv
    from sparsekv.assets import haystack_text
    from sparsekv.cache import SparseCache, cache_memory
    from sparsekv.hf_compat import cache_kwargs

    ids = tokenizer.encode(haystack_text(), add_special_tokens=False)[:context]
    if len(ids) < context:
        raise ConfigError(f"the haystack has only {len(ids)} tokens")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    cuda = device.type == "cuda"
    if cuda:  # the allocator's own count: what the cache keeps alive, and the peak on the way there
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    cache = SparseCache.for_model(model, config)
    with torch.inference_mode(), sparsekv.enabled(model, config):
        logits = model(input_ids=input_ids, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        for _ in range(decode_tokens):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    allocator = None
    if cuda:
        del logits
        torch.cuda.synchronize(device)
        allocator = {
            "held_bytes": torch.cuda.memory_allocated(device) - start,
            "peak_above_start_bytes": torch.cuda.max_memory_allocated(device) - start,
        }
    report = cache_memory(cache)
    report.update(
        allocator=allocator,
        method=config.method,
        options=config.options,
        context=context,
        decode_tokens=decode_tokens,
        dense_layers_config=list(config.dense_layers),
    )
    return report
