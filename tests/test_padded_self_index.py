"""Self-index on every layer (dense_layers=()) with a left-padded batch: each row decodes as it does alone.

Regression: the self-index layers handed the cache an empty [B, Hkv, N, 0] stand-in for their keys, and
transformers' `DynamicLayer.get_seq_length` reads an empty tensor as length 0. With layer 0 a self-index layer the
cache then reported length 0 from the second decode step on, so the attention mask was one column wide: every row
saw only key 0, and a left-padded row (key 0 = padding) saw nothing and gave NaN logits (greedy: token 0 forever).
"""

from __future__ import annotations

import pytest
import torch

import sparsekv
from sparsekv import SparseConfig
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs

STEPS = 6
LENGTHS = (37, 70, 100)  # rows 0 and 1 left-padded, row 2 not


@pytest.fixture(scope="module")
def tiny_llama():
    from sparsekv.models import random_model

    return random_model("tiny-llama", dtype=torch.float32, seed=0)


def prompts(model) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in LENGTHS]


@torch.inference_mode()
def greedy(model, config: SparseConfig, rows: list[torch.Tensor], steps: int = STEPS):
    """Left-padded prefill of `rows`, then `steps` greedy tokens one at a time -> (logits [B, steps + 1, V] of the
    last prompt position and every decode step, tokens [B, steps + 1], cache)."""
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r) :], mask[i, n - len(r) :] = r, 1
    cache = SparseCache.for_model(model, config)
    logits, tokens = [], []
    with sparsekv.enabled(model, config):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **cache_kwargs(model, cache),
                    use_cache=True)  # fmt: skip
        for _ in range(steps + 1):
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
            if len(tokens) > steps:
                break
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        **cache_kwargs(model, cache), use_cache=True)  # fmt: skip
    return torch.stack(logits, 1), torch.cat(tokens, 1), cache


VARIANTS = {
    "default": {},  # k_axis channel, 2-bit, 32 sinks, residual 64
    "channel-short-blocks": {"k_group": 4, "residual": 4},  # decode blocks fill and compress within the steps
    "token-axis-no-residual": {"k_axis": "token", "residual": 0},
    "kv16-no-sinks": {"kv_bits": 16, "sink_tokens": 0},
}


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_padded_rows_decode_as_alone(tiny_llama, options):
    config = SparseConfig(method="self-index", budget=0.1, dense_layers=(), options=options)
    rows = prompts(tiny_llama)
    logits, tokens, cache = greedy(tiny_llama, config, rows)
    assert torch.isfinite(logits).all(), torch.isfinite(logits).all(-1).tolist()
    assert cache.get_seq_length() == max(LENGTHS) + STEPS
    for i, row in enumerate(rows):
        alone_logits, alone_tokens, _ = greedy(tiny_llama, config, [row])
        assert torch.equal(tokens[i], alone_tokens[0]), (i, tokens[i].tolist(), alone_tokens[0].tolist())
        torch.testing.assert_close(logits[i], alone_logits[0], rtol=1e-4, atol=1e-4)


def test_cache_length_counts_self_index_layer_zero(tiny_llama):
    """What transformers reads (layer 0's get_seq_length: cache_position, mask width, default position ids) is the
    cached length at every step, when layer 0 keeps its tokens in the self-index store."""
    config = SparseConfig(method="self-index", budget=0.1, dense_layers=())
    ids = prompts(tiny_llama)[1][None]
    cache = SparseCache.for_model(tiny_llama, config)
    with torch.inference_mode(), sparsekv.enabled(tiny_llama, config):
        tiny_llama(input_ids=ids, **cache_kwargs(tiny_llama, cache), use_cache=True)
        for step in range(1, 4):
            tiny_llama(input_ids=ids[:, :1], **cache_kwargs(tiny_llama, cache), use_cache=True)
            assert cache.get_seq_length() == ids.shape[1] + step
    # the stand-in the cache holds for a self-index layer costs no memory per token
    stand_in = cache.layers[0].keys
    assert stand_in.shape[2] == ids.shape[1] + 3 and stand_in.untyped_storage().nbytes() == stand_in.element_size()
