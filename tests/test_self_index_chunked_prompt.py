"""Self-index stores a prompt that arrives in chunks (transformers' `prefill_chunk_size`) chunk by chunk: the
16-bit prompt is held only until every row has `prompt_stats_tokens` real tokens, later chunks attend over the
stored ones, the sinks are chosen when the prompt ends."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from sparsekv import SparseConfig
from sparsekv.cache import SparseLayer
from sparsekv.config import ConfigError
from sparsekv.selectors.self_index.scoring import SENTINEL, rank_sink_pool
from tests.test_method_matrix import generate, left_padded, random_ids

PROMPT, CHUNK, STATS = 100, 16, 32


@pytest.fixture(scope="module")
def tiny():
    from sparsekv.models import random_model

    return random_model("tiny-llama", dtype=torch.float64, seed=0)


def config(**options) -> SparseConfig:
    return SparseConfig(method="self-index", budget=0.25, dense_layers=(0,),
                        options={"fp_dtype": "input", "prompt_stats_tokens": STATS, **options})  # fmt: skip


def test_a_long_chunked_prompt_never_lies_in_the_cache_at_16_bit(tiny):
    grown = []
    original = SparseLayer._grow

    def recording_grow(self, buffer, like, capacity):
        grown.append((self.selector is not None, capacity))
        return original(self, buffer, like, capacity)

    ids = random_ids(tiny, 2, PROMPT, seed=6)
    with patch.object(SparseLayer, "_grow", recording_grow):
        tokens, logits, cache = generate(tiny, config(), ids, prefill_chunk_size=CHUNK)
    assert torch.isfinite(logits).all() and tokens.shape == (2, 6)
    sparse = [capacity for is_sparse, capacity in grown if is_sparse]
    dense = [capacity for is_sparse, capacity in grown if not is_sparse]
    assert sparse and max(sparse) <= STATS  # held until the statistics' tokens, then stored chunk by chunk
    assert max(dense) >= PROMPT  # the dense layer holds the whole prompt (what the sparse ones would without this)
    for layer in cache.layers[1:]:
        store = layer.selector.kv
        assert layer._key_buffer is None and layer.prompt_tokens == PROMPT
        assert store.decode_start == STATS  # the statistics came from the first STATS tokens
        assert store.rows.length == PROMPT + 5  # every prompt token stored, then the decode tokens
        slack = store.k_group  # whole K blocks are rewritten in fixed-shape steps (`begin_fixed`)
        assert store.rows.tensors["sign_bits"].shape[2] == PROMPT + 6 + slack  # room for the generation, made once
        assert store.tail.length <= store.residual  # one residual block at 16-bit, not the last chunk


def test_later_chunks_read_the_earlier_ones_back_exactly_at_16_bits(tiny):
    """kv_bits=16 stores K/V exactly (rotated): the prompt's dense attention, and so the first token's logits,
    equal plain transformers' chunked prefill."""
    ids = random_ids(tiny, 2, PROMPT, seed=6)
    _, logits, _ = generate(tiny, config(kv_bits=16), ids, prefill_chunk_size=CHUNK)
    _, dense_logits, _ = generate(tiny, None, ids, prefill_chunk_size=CHUNK)
    torch.testing.assert_close(logits[:, 0], dense_logits[:, 0], rtol=0, atol=1e-10)


def test_compressed_chunks_change_the_prompt_a_little(tiny):
    """2-bit: the later chunks attend over the earlier ones dequantized (close to dense, not equal)."""
    ids = random_ids(tiny, 2, PROMPT, seed=6)
    _, logits, _ = generate(tiny, config(), ids, prefill_chunk_size=CHUNK)
    _, dense_logits, _ = generate(tiny, None, ids, prefill_chunk_size=CHUNK)
    error = (logits[:, 0] - dense_logits[:, 0]).abs().max()
    assert 0 < error < 0.1 * dense_logits[:, 0].abs().max()


def test_prompt_stats_tokens_0_holds_the_whole_prompt(tiny):
    ids = random_ids(tiny, 2, PROMPT, seed=6)
    whole, whole_logits, _ = generate(tiny, config(prompt_stats_tokens=0), ids)
    chunked, chunked_logits, cache = generate(tiny, config(prompt_stats_tokens=0), ids, prefill_chunk_size=CHUNK)
    assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked_logits, whole_logits, rtol=0, atol=1e-9)
    assert cache.layers[1].selector.kv.decode_start == PROMPT


def test_a_prompt_shorter_than_its_statistics_is_stored_whole(tiny):
    ids = random_ids(tiny, 2, 30, seed=6)
    whole, whole_logits, _ = generate(tiny, config(), ids)
    chunked, chunked_logits, _ = generate(tiny, config(), ids, prefill_chunk_size=CHUNK)
    assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked_logits, whole_logits, rtol=0, atol=1e-9)


def test_left_padded_rows_wait_for_their_own_statistics(tiny):
    ids, mask, _ = left_padded(tiny, (PROMPT, 60), seed=20)
    _, logits, cache = generate(tiny, config(), ids, mask, prefill_chunk_size=CHUNK)
    assert torch.isfinite(logits).all()
    # row 1 starts after 40 padding tokens: the prompt opens at the first chunk end giving it STATS real tokens
    assert cache.layers[1].selector.kv.decode_start == 80


def test_the_sinks_are_chosen_among_every_chunks_candidates():
    torch.manual_seed(0)
    b, hkv, hq, d, length = 1, 2, 4, 16, 300
    query = torch.randn(b, hq, 32, d)
    keys = torch.randn(b, hkv, 12, d) * 0.1
    positions = torch.tensor([3, 9, 40, 41, 120, 150, 151, 200, 250, 260, SENTINEL, SENTINEL])
    positions = positions.expand(b, hkv, -1).clone()
    aligned = query.view(b, hkv, 2, 32, d).mean((2, 3))  # the direction the window's queries share
    keys[:, :, 1] = 40 * aligned  # from the first chunk
    keys[:, :, 8] = 30 * aligned  # from a late one
    chosen, rank, index = rank_sink_pool(keys, positions, query, 3, 0.25, length)
    assert chosen.shape == rank.shape == index.shape == (b, hkv, 3)
    assert (chosen[..., :-1] <= chosen[..., 1:]).all()  # ascending, as `snap_sinks` gives them
    for h in range(hkv):
        best = {int(p) for p, r in zip(chosen[0, h], rank[0, h], strict=True) if r < 2}
        assert best == {9, 250}
    assert torch.equal(positions.gather(-1, index), chosen)
    # an empty pool slot is never chosen
    chosen, rank, _ = rank_sink_pool(keys[:, :, 10:], positions[:, :, 10:], query, 2, 0.25, length)
    assert (chosen == SENTINEL).all()


@pytest.mark.parametrize("value", [-1, 8, 31, True])
def test_prompt_stats_tokens_is_checked(value):
    with pytest.raises(ConfigError, match="prompt_stats_tokens"):
        SparseConfig(method="self-index", options={"prompt_stats_tokens": value})


def test_ppl_with_a_chunked_prefix_is_dense_ppl_for_dense(tiny):
    from sparsekv.eval.ppl import window_nll

    ids = random_ids(tiny, 1, 64, seed=3)
    dense = SparseConfig(method="dense")
    whole = window_nll(tiny, ids, dense, prefix=40, chunk=8)
    chunked = window_nll(tiny, ids, dense, prefix=40, chunk=8, prefill_chunk=16)
    assert chunked["nll"] == pytest.approx(whole["nll"], rel=1e-12)


def test_a_batch_chunk_attends_row_by_row_as_the_batch_would(tiny):
    """Dense layers of a SparseCache (here: every layer, the dense method) attend a prompt chunk after the first
    one sequence at a time (`attention._dense_attention`): the logits are plain transformers' chunked ones."""
    ids, mask, _ = left_padded(tiny, (PROMPT, 60), seed=20)
    _, logits, _ = generate(tiny, SparseConfig(method="dense"), ids, mask, prefill_chunk_size=CHUNK)
    _, plain_logits, _ = generate(tiny, None, ids, mask, prefill_chunk_size=CHUNK)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {"k_axis": "token", "k_zero": True},
        {"residual": 0, "k_axis": "token"},
        {"sink_tokens": 0},
        {"kv_bits": 4},
        {"v_rotate": False, "k_rotate": False},
    ],
)
def test_every_layout_stores_a_chunked_prompt(tiny, options):
    """Each stored layout takes a chunked prompt: the prompt's first-token logits stay near plain transformers'
    chunked ones, and the decode that follows is finite."""
    ids = random_ids(tiny, 2, PROMPT, seed=6)
    tokens, logits, cache = generate(tiny, config(**options), ids, prefill_chunk_size=CHUNK)
    _, dense_logits, _ = generate(tiny, None, ids, prefill_chunk_size=CHUNK)
    assert torch.isfinite(logits).all() and tokens.shape == (2, 6)
    assert (logits[:, 0] - dense_logits[:, 0]).abs().max() < 0.1 * dense_logits[:, 0].abs().max()
    store = cache.layers[1].selector.kv
    assert store.decode_start == STATS and store.rows.length == PROMPT + 5
    assert (store.sink_positions is None) == (options.get("sink_tokens", 32) == 0)


@pytest.mark.parametrize("slice_tokens", [5, 32])
@pytest.mark.parametrize("chunk", [48, None])
def test_a_long_chunk_is_stored_in_slices_exactly(tiny, monkeypatch, slice_tokens, chunk):
    """A prompt, or a prompt chunk, longer than `store.APPEND_SLICE` is compressed a slice at a time (bounded work
    tensors): every stored tensor, the sinks and the logits equal those of one pass over it (float64: exact)."""
    from sparsekv.selectors.self_index import store

    ids = random_ids(tiny, 2, PROMPT + 1, seed=6)  # a whole prompt's first K block is 3 tokens short
    options = {"residual": 16, "k_group": 8}  # appends of 5 tokens cut across the residual and K blocks
    tokens, logits, cache = generate(tiny, config(**options), ids, prefill_chunk_size=chunk)
    monkeypatch.setattr(store, "APPEND_SLICE", slice_tokens)
    sliced_tokens, sliced_logits, sliced = generate(tiny, config(**options), ids, prefill_chunk_size=chunk)
    assert torch.equal(tokens, sliced_tokens)
    torch.testing.assert_close(sliced_logits, logits, rtol=0, atol=0)
    for whole, parts in zip(cache.layers[1:], sliced.layers[1:], strict=True):
        a, b = whole.selector.kv, parts.selector.kv
        for buffers in ("rows", "k_blocks", "tail"):
            held, got = getattr(a, buffers), getattr(b, buffers)
            assert held.length == got.length and held.tensors.keys() == got.tensors.keys()
            for name in held.tensors:  # the same values, in buffers of the same room (grown once, not per part)
                assert torch.equal(held.view(name), got.view(name)), (buffers, name)
                assert held.tensors[name].shape == got.tensors[name].shape, (buffers, name)
        for name in ("sink_positions", "sink_keys", "sink_values", "mu", "alpha", "centroids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("chunk", [CHUNK, None])
def test_a_batch_is_summarised_a_few_sequences_at_a_time_exactly(tiny, monkeypatch, chunk):
    """The prompt's statistics and SnapKV votes go through the batch in groups of sequences
    (`scoring.sequence_groups`): one sequence a group stores what the whole batch at once does, left padding
    included (float64: exact)."""
    from sparsekv.selectors.self_index import scoring

    ids, mask, _ = left_padded(tiny, (PROMPT, 60, 90), seed=21)
    tokens, logits, cache = generate(tiny, config(), ids, mask, prefill_chunk_size=chunk)
    monkeypatch.setattr(scoring, "GROUP_ELEMENTS", 1)
    assert [(g.start, g.stop) for g in scoring.sequence_groups(3, 10)] == [(0, 1), (1, 2), (2, 3)]
    grouped_tokens, grouped_logits, grouped = generate(tiny, config(), ids, mask, prefill_chunk_size=chunk)
    assert torch.equal(tokens, grouped_tokens)
    torch.testing.assert_close(grouped_logits, logits, rtol=0, atol=0)
    for whole, parts in zip(cache.layers[1:], grouped.layers[1:], strict=True):
        a, b = whole.selector.kv, parts.selector.kv
        for name in ("sink_positions", "sink_rank", "mu", "alpha", "centroids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for name in a.rows.tensors:
            assert torch.equal(a.rows.view(name), b.rows.view(name)), name
