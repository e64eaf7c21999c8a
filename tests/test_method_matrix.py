"""Properties every registered method must have; a new method joins this matrix by being in the registry.

Runs on tiny random models in float64 so that equalities are exact up to rounding, not up to near-ties.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from sparsekv import SparseConfig, available_methods
from sparsekv.registry import get_method_class
from tests.helpers import run_chunks

METHODS = available_methods()
PREFIX, TOTAL = 24, 40


def make_config(method: str, **overrides) -> SparseConfig:
    cls = get_method_class(method)
    settings = {"dense_layers": (0,), "top_p": 0.9 if cls.consumes_top_p else None, **overrides}
    return SparseConfig(method=method, **settings)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-mha"])
def tiny(request):
    from sparsekv.models import random_model

    return random_model(request.param, dtype=torch.float64, seed=0)


@pytest.fixture(scope="module")
def tiny_gqa():
    from sparsekv.models import random_model

    return random_model("tiny-llama", dtype=torch.float64, seed=0)


def random_ids(model, batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)


def expected_budget(config: SparseConfig, visible_counts: torch.Tensor) -> torch.Tensor:
    return torch.tensor([config.tokens_for(int(n)) for n in visible_counts.flatten()]).view_as(visible_counts)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gqa", ["group", "head"])
@pytest.mark.parametrize("budget", [6, 0.25])
def test_selection_is_causal_and_within_budget(tiny, method, gqa, budget):
    config = make_config(method, budget=budget, gqa=gqa, sink=1, local=1)
    _, recorder = run_chunks(tiny, config, random_ids(tiny, 2, TOTAL, seed=1), PREFIX, chunk=8)
    if get_method_class(method).dense:
        assert recorder.calls == []
        return
    assert recorder.calls, "a sparse method made no selection"
    for _, mask, visible, counts in recorder.calls:
        assert not (mask & ~visible[:, None]).any(), "selected a future or padded token"
        assert (counts >= 1).all()
        if not get_method_class(method).consumes_top_p:
            budgets = expected_budget(config, visible.sum(-1))[:, None].expand_as(counts)
            assert (counts <= budgets).all(), f"{method} selected more than its budget"
        first = visible.float().argmax(-1)  # sink: first visible token
        assert mask.gather(-1, first[:, None, :, None].expand(-1, mask.shape[1], -1, 1)).all()


@pytest.mark.parametrize("method", METHODS)
def test_budget_covering_the_context_reproduces_dense(tiny, method):
    if getattr(get_method_class(method), "lossy", False):
        pytest.skip(f"{method} stores a lossy cache")
    ids = random_ids(tiny, 2, TOTAL, seed=2)
    dense, _ = run_chunks(tiny, SparseConfig(method="dense"), ids, PREFIX, chunk=8)
    exact = {"top_p": 1.0} if get_method_class(method).consumes_top_p else {}
    sparse, _ = run_chunks(tiny, make_config(method, budget=10_000, **exact), ids, PREFIX, chunk=8)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-9)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gqa", ["group", "head"])
def test_chunked_decode_equals_token_by_token(tiny_gqa, method, gqa):
    config = make_config(method, budget=0.3, gqa=gqa)
    ids = random_ids(tiny_gqa, 2, TOTAL, seed=3)
    chunked_logits, chunked = run_chunks(tiny_gqa, config, ids, PREFIX, chunk=TOTAL - PREFIX)
    stepped_logits, stepped = run_chunks(tiny_gqa, config, ids, PREFIX, chunk=1)
    torch.testing.assert_close(chunked_logits, stepped_logits, rtol=0, atol=1e-9)
    chunked_layers, stepped_layers = chunked.per_layer(), stepped.per_layer()
    assert chunked_layers.keys() == stepped_layers.keys()
    for layer, calls in chunked_layers.items():
        (chunk_mask, _, _), = calls
        step_masks = [torch.nn.functional.pad(m, (0, TOTAL - m.shape[-1])) for m, _, _ in stepped_layers[layer]]
        assert torch.equal(chunk_mask, torch.cat(step_masks, dim=2)), f"layer {layer}: selections differ"


@pytest.mark.parametrize("method", METHODS)
def test_batch_with_padding_equals_each_sequence_alone(tiny_gqa, method):
    config = make_config(method, budget=0.3)
    lengths, new = (30, 21), 8
    width = max(lengths)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    alone = []
    for row, length in enumerate(lengths):
        seq = random_ids(tiny_gqa, 1, length, seed=10 + row)
        ids[row, width - length :] = seq[0]
        mask[row, width - length :] = 1
        logits, _ = run_chunks(tiny_gqa, config, seq, length - new, chunk=4)
        alone.append(logits[0])
    batched, _ = run_chunks(tiny_gqa, config, ids, width - new, chunk=4, attention_mask=mask)
    for row in range(2):
        torch.testing.assert_close(batched[row], alone[row], rtol=0, atol=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic(tiny_gqa, method):
    config = make_config(method, budget=0.25)
    ids = random_ids(tiny_gqa, 2, TOTAL, seed=4)
    first, rec_a = run_chunks(tiny_gqa, config, ids, PREFIX, chunk=8)
    second, rec_b = run_chunks(tiny_gqa, config, ids, PREFIX, chunk=8)
    assert torch.equal(first, second)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(rec_a.calls, rec_b.calls))


# ------------------------------------------------------------- model.generate(): the user's path


def generate(model, config: SparseConfig | None, ids, mask=None, new: int = 6, **kwargs):
    """Greedy `model.generate` (under sparsekv when `config` is given) -> (tokens [B, new], logits [B, new, V],
    the SparseCache used)."""
    import sparsekv

    def run():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kwargs)
        return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)

    if config is None:
        return (*run(), None)
    with sparsekv.enabled(model, config):
        tokens, logits = run()
        return tokens, logits, sparsekv.last_cache(model)


def left_padded(model, lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    rows = []
    for row, length in enumerate(lengths):
        seq = random_ids(model, 1, length, seed=seed + row)
        ids[row, width - length :], mask[row, width - length :] = seq[0], 1
        rows.append(seq)
    return ids, mask, rows


@pytest.mark.parametrize("method", METHODS)
def test_generate_decodes_with_the_sparse_cache(tiny_gqa, method, caplog):
    """The test that fails when model.generate() does not use the SparseCache (e.g. a transformers release that
    passes the cache under another name): the stats must show sparse steps keeping fewer tokens than they see."""
    import sparsekv
    from sparsekv.config import ConfigError

    config = make_config(method, budget=0.25)
    ids = random_ids(tiny_gqa, 2, 48, seed=5)
    if get_method_class(method).rewrites_prompt:
        with pytest.raises(ConfigError, match="rewrites the prompt"):
            sparsekv.enable(tiny_gqa, config)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' deprecations (e.g. of past_key_values)
        tokens, logits, cache = generate(tiny_gqa, config, ids)
    assert "ignoring" not in caplog.text and "deprecated" not in caplog.text
    assert tokens.shape == (2, 6) and torch.isfinite(logits).all()
    assert isinstance(cache, sparsekv.SparseCache)
    assert cache.layers[0]._key_buffer.shape[-2] == 48 + 6  # allocated once at prompt + max_new_tokens
    summary = cache.stats.summary()
    if get_method_class(method).dense:
        assert summary["avg_budget_tokens"] is None
        return
    sparse_layers = [i for i in range(tiny_gqa.config.num_hidden_layers) if i not in config.dense_layers]
    assert sorted(summary["per_layer_avg_tokens"]) == sparse_layers
    kept, _ = cache.stats.layer_counts(sparse_layers[0])
    assert len(kept) == 2 * 5 * tiny_gqa.config.num_key_value_heads  # rows x decode steps x kv heads
    assert summary["avg_budget_tokens"] < summary["avg_context_tokens"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("prompt, chunk", [(45, 16), (49, 16)])  # the last chunk: 13 tokens, then a single one
def test_chunked_prefill_gives_the_unchunked_tokens(tiny_gqa, method, prompt, chunk):
    if get_method_class(method).rewrites_prompt:
        pytest.skip("refused under model.generate (test above)")
    config = make_config(method, budget=0.25)
    ids = random_ids(tiny_gqa, 2, prompt, seed=6)
    whole, whole_logits, whole_cache = generate(tiny_gqa, config, ids)
    chunked, chunked_logits, chunked_cache = generate(tiny_gqa, config, ids, prefill_chunk_size=chunk)
    assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked_logits, whole_logits, rtol=0, atol=1e-9)
    assert chunked_cache.stats.summary() == whole_cache.stats.summary()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dense_layers", [(), (0,)])
def test_generate_decodes_each_padded_row_as_alone(tiny_gqa, method, dense_layers):
    if get_method_class(method).rewrites_prompt:
        pytest.skip("refused under model.generate (test above)")
    config = make_config(method, budget=0.3, dense_layers=dense_layers)
    ids, mask, rows = left_padded(tiny_gqa, (37, 22), seed=20)
    batched, batched_logits, _ = generate(tiny_gqa, config, ids, mask)
    assert torch.isfinite(batched_logits).all()
    for row, seq in enumerate(rows):
        alone, alone_logits, _ = generate(tiny_gqa, config, seq)
        assert torch.equal(batched[row], alone[0]), f"row {row} decodes differently in the padded batch"
        torch.testing.assert_close(batched_logits[row], alone_logits[0], rtol=0, atol=1e-8)
