"""Lossless decoding (sparse steps draft, a dense forward verifies) and the rollback it rests on, which also lets
transformers' assisted generation and prompt lookup run under `sparsekv.enabled`."""

from __future__ import annotations

import pytest
import torch

import sparsekv
from sparsekv import ConfigError, SparseConfig
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs
from sparsekv.registry import available_methods, get_method_class

ROLLBACK_METHODS = [
    m for m in available_methods()
    if not (get_method_class(m).dense or get_method_class(m).stores_kv or m == "h2o")
]  # fmt: skip


@pytest.fixture(scope="module")
def long_prompt(real_model):
    from sparsekv.assets import haystack_text

    _, tokenizer = real_model
    return tokenizer.decode(tokenizer(haystack_text()[:60000]).input_ids[:4096])


@pytest.fixture(scope="module")
def dense_tokens(real_model, long_prompt):
    model, tokenizer = real_model
    return sparsekv.generate(model, tokenizer, long_prompt, SparseConfig(method="dense"), max_new_tokens=128)


@pytest.mark.parametrize("budget", [0.02, 0.1])
@pytest.mark.parametrize("method", ["lsh", "spotlight", "quest"])
def test_lossless_output_is_dense_token_for_token(real_model, long_prompt, dense_tokens, method, budget):
    model, tokenizer = real_model
    result = sparsekv.generate(model, tokenizer, long_prompt, SparseConfig(method=method, budget=budget),
                               max_new_tokens=128, lossless=True)  # fmt: skip
    assert result.new_token_ids == dense_tokens.new_token_ids
    assert 0 < result.acceptance_rate <= 1 and result.tokens_per_verification > 1
    assert result.avg_budget_tokens < 0.2 * result.avg_context_tokens  # the drafts really were sparse


def test_lossy_decoding_differs_where_lossless_does_not(real_model, long_prompt, dense_tokens):
    """The check above can fail: plain quest at 2% leaves dense's trajectory on this prompt."""
    model, tokenizer = real_model
    lossy = sparsekv.generate(model, tokenizer, long_prompt, SparseConfig(method="quest", budget=0.02),
                              max_new_tokens=128)  # fmt: skip
    assert lossy.new_token_ids != dense_tokens.new_token_ids


@pytest.mark.parametrize("method", ["h2o", "self-index", "dense"])
def test_lossless_refuses_methods_that_cannot_be_verified(real_model, method):
    model, tokenizer = real_model
    with pytest.raises(ConfigError, match="lossless|rolled back"):
        sparsekv.generate(model, tokenizer, "hello", SparseConfig(method=method), max_new_tokens=4, lossless=True)


def test_lossless_pads_a_batch_and_stops_rows_at_eos(real_model):
    model, tokenizer = real_model
    prompts = ["The capital of France is", "Write three words about the sea and the sky, then stop."]
    dense = sparsekv.generate(model, tokenizer, prompts, SparseConfig(method="dense"), max_new_tokens=24)
    lossless = sparsekv.generate(model, tokenizer, prompts, SparseConfig(method="oracle-topk", budget=0.1),
                                 max_new_tokens=24, lossless=True, draft_tokens=3)  # fmt: skip
    assert lossless.new_token_ids == dense.new_token_ids


# ------------------------------------------------------------- rollback inside model.generate()


@pytest.fixture(scope="module")
def tiny():
    from sparsekv.models import random_model

    return random_model("tiny-llama", dtype=torch.float64, seed=0)


def _greedy(model, config, ids, **kwargs):
    with sparsekv.enabled(model, config):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, pad_token_id=0, **kwargs)  # fmt: skip


@pytest.mark.parametrize("method", ROLLBACK_METHODS)
def test_prompt_lookup_and_assisted_generation_under_sparsekv(tiny, method):
    """Both verify candidates in multi-token forwards and roll the cache back on a rejection; a chunk of new tokens
    selects exactly as token-by-token decoding, so the output equals plain greedy decoding with the same config."""
    from sparsekv.models import random_model

    top_p = 0.9 if get_method_class(method).consumes_top_p else None
    config = SparseConfig(method=method, budget=0.3, dense_layers=(0,), top_p=top_p)
    base = torch.randint(3, tiny.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([base, base[:, :12]], dim=1)  # repeats: prompt lookup finds candidates
    plain = _greedy(tiny, config, ids)
    assert torch.equal(_greedy(tiny, config, ids, prompt_lookup_num_tokens=3), plain)
    assistant = random_model("tiny-llama", dtype=torch.float64, seed=1)
    assert torch.equal(_greedy(tiny, config, ids, assistant_model=assistant), plain)


def test_a_cache_cannot_roll_back_into_its_prompt(tiny):
    config = SparseConfig(method="oracle-topk", budget=0.3, dense_layers=(0,))
    cache = SparseCache.for_model(tiny, config)
    ids = torch.randint(3, tiny.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with sparsekv.enabled(tiny, config):
        tiny(input_ids=ids, **cache_kwargs(tiny, cache), use_cache=True)
        tiny(input_ids=ids[:, :2], **cache_kwargs(tiny, cache), use_cache=True)
    cache.crop(-1)
    assert cache.get_seq_length() == 11
    with pytest.raises(ConfigError, match="prompt"):
        cache.crop(-2)
