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


# lsh with 256 bits: its CPU scoring unpacks every key's bits each step, and 1,024 made each case about five
# minutes; streaming (the GPU benchmarks' draft method) is verified on the tiny models' fixed-shape rounds and in
# the sampling test
@pytest.mark.parametrize("method,budget", [("lsh", 0.02), ("lsh", 0.1), ("spotlight", 0.02), ("spotlight", 0.1),
                                           ("quest", 0.02), ("quest", 0.1), ("self-index", 0.02),
                                           ("self-index", 0.1)])  # fmt: skip
def test_lossless_output_is_dense_token_for_token(real_model, long_prompt, dense_tokens, method, budget):
    model, tokenizer = real_model
    options = {"bits": 256} if method == "lsh" else {}
    result = sparsekv.generate(model, tokenizer, long_prompt, SparseConfig(method=method, budget=budget,
                               options=options), max_new_tokens=128, lossless=True)  # fmt: skip
    assert result.new_token_ids == dense_tokens.new_token_ids
    assert 0 < result.acceptance_rate <= 1 and result.tokens_per_verification > 1
    assert result.avg_budget_tokens < 0.2 * result.avg_context_tokens  # the drafts really were sparse


def test_lossy_decoding_differs_where_lossless_does_not(real_model, long_prompt, dense_tokens):
    """The check above can fail: plain quest at 2% leaves dense's trajectory on this prompt."""
    model, tokenizer = real_model
    lossy = sparsekv.generate(model, tokenizer, long_prompt, SparseConfig(method="quest", budget=0.02),
                              max_new_tokens=128)  # fmt: skip
    assert lossy.new_token_ids != dense_tokens.new_token_ids


def test_model_generate_in_lossless_mode_is_hf_dense_generate_token_for_token(real_model, long_prompt):
    """`enabled(..., lossless=True)`: `model.generate()` itself drafts sparsely and verifies densely, and its output
    is plain transformers greedy generation's; the same method without lossless leaves that trajectory."""
    model, tokenizer = real_model
    ids = tokenizer(long_prompt, return_tensors="pt").input_ids[:, :1024]
    dense = model.generate(ids, max_new_tokens=32, do_sample=False)
    config = SparseConfig(method="quest", budget=0.02)
    with sparsekv.enabled(model, config):
        lossy = model.generate(ids, max_new_tokens=32, do_sample=False)
    with sparsekv.enabled(model, config, lossless=True, draft_tokens=3) as runtime:
        lossless = model.generate(ids, max_new_tokens=32, do_sample=False)
        kept = sparsekv.last_cache(model).stats.summary()
    assert torch.equal(lossless, dense) and not torch.equal(lossy, dense)
    drafts = runtime.drafts
    assert drafts.verifications > 0 and drafts.drafted <= 3 * drafts.verifications
    assert 0 < drafts.acceptance_rate < 1 and drafts.tokens_per_verification > 1
    assert kept["avg_budget_tokens"] < 0.05 * kept["avg_context_tokens"]  # the drafts really were sparse


def test_lossless_model_generate_refuses_what_it_does_not_do(real_model):
    model, tokenizer = real_model
    ids = tokenizer("The lighthouse keeper climbed the stairs.", return_tensors="pt").input_ids
    with sparsekv.enabled(model, SparseConfig(method="lsh", budget=0.1), lossless=True):
        with pytest.raises(ConfigError, match="greedily"):
            model.generate(ids, max_new_tokens=4, do_sample=True)
        with pytest.raises(ConfigError, match="use_cache"):
            model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
        with pytest.raises(ConfigError, match="num_beams"):
            model.generate(ids, max_new_tokens=4, do_sample=False, num_beams=2)
        with pytest.raises(ConfigError, match="left-padded"):
            model.generate(ids, attention_mask=torch.cat([ids.new_ones(1, 3), ids.new_zeros(1, ids.shape[1] - 3)], 1),
                           max_new_tokens=4, do_sample=False)  # fmt: skip
        with pytest.raises(ConfigError, match="prefill_chunk_size must be an int >= 1"):
            model.generate(ids, max_new_tokens=4, do_sample=False, prefill_chunk_size=0)
        assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)
    with pytest.raises(ConfigError, match="densely"):
        sparsekv.enable(model, SparseConfig(method="dense"), lossless=True)
    for bad in (0, "many", 2.5):
        with pytest.raises(ConfigError, match="draft_tokens"):
            sparsekv.enable(model, SparseConfig(method="lsh"), lossless=True, draft_tokens=bad)


@pytest.mark.parametrize("method", ["h2o", "dense"])
def test_lossless_refuses_methods_that_cannot_be_verified(real_model, method):
    model, tokenizer = real_model
    with pytest.raises(ConfigError, match="lossless|rolled back"):
        sparsekv.generate(model, tokenizer, "hello", SparseConfig(method=method), max_new_tokens=4, lossless=True)


@pytest.mark.parametrize("graph_decode", [None, True])
def test_lossless_pads_a_batch_and_stops_rows_at_eos(real_model, graph_decode):
    """Rows end at EOS or at max_new_tokens, in eager rounds and at fixed shapes (graph_decode=True)."""
    model, tokenizer = real_model
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True),
               "The capital of France is"]  # fmt: skip
    dense = sparsekv.generate(model, tokenizer, prompts, SparseConfig(method="dense"), max_new_tokens=24)
    assert len(dense.new_token_ids[0]) < 12 and len(dense.new_token_ids[1]) == 24  # the answer ends at EOS
    lossless = sparsekv.generate(model, tokenizer, prompts, SparseConfig(method="oracle-topk", budget=0.1),
                                 max_new_tokens=24, lossless=True, draft_tokens=3, graph_decode=graph_decode)  # fmt: skip
    assert lossless.new_token_ids == dense.new_token_ids
    assert (lossless.decode_paths.get("fixed-shape", 0) >= 3) == bool(graph_decode)


@pytest.fixture(scope="module")
def four_prompts(real_model):
    from sparsekv.assets import haystack_text

    _, tokenizer = real_model
    ids = tokenizer(haystack_text()[:200000]).input_ids
    return [tokenizer.decode(ids[start : start + 1000]) for start in (0, 5000, 11000, 17000)]


@pytest.fixture(scope="module")
def four_dense(real_model, four_prompts):
    model, tokenizer = real_model
    return sparsekv.generate(model, tokenizer, four_prompts, SparseConfig(method="dense"), max_new_tokens=32)


def test_lossless_rounds_on_spotlights_device_path_are_dense_token_for_token(real_model, four_prompts, four_dense,
                                                                           monkeypatch):  # fmt: skip
    """What a GPU's captured rounds run for spotlight, here through the ops' references: each draft step hashes its
    new key in the query's launch at its device slot and picks each row's budget by device count; a verification
    selects nothing, so it hashes its drafts' keys on their own (`complete_append`). The output is dense's."""
    from sparsekv.selectors import spotlight
    from sparsekv.selectors.base import _fixed_hamming_core

    def device_select(query_codes, key_codes, bits, step, threshold_hints=None):
        if step.hints is None or not step.hints.fixed:
            return None
        return _fixed_hamming_core(query_codes(), key_codes, bits, step, threshold_hints)

    completed, left_pending = [], []
    complete, append = spotlight.SpotlightSelector.complete_append, spotlight.SpotlightSelector.append_fixed_shape
    monkeypatch.setattr(spotlight.SpotlightSelector, "append_fixed_shape",
                        lambda self, *args: left_pending.append(self._pending is not None) or append(self, *args))
    monkeypatch.setattr(spotlight, "fixed_hamming_selection", device_select)
    monkeypatch.setattr(spotlight.SpotlightSelector, "_defers", lambda self, keys: True)
    monkeypatch.setattr(spotlight.SpotlightSelector, "complete_append",
                        lambda self: completed.append(self._pending_slots is not None) or complete(self))  # fmt: skip
    model, tokenizer = real_model
    result = sparsekv.generate(model, tokenizer, four_prompts, SparseConfig(method="spotlight", budget=0.05),
                               max_new_tokens=32, lossless=True, draft_tokens=4, graph_decode=True)  # fmt: skip
    assert result.new_token_ids == four_dense.new_token_ids
    assert result.decode_paths["fixed-shape"] >= 5 and any(completed)
    assert left_pending and not any(left_pending)  # no step's key codes were still unwritten at the next step


@pytest.mark.parametrize("method", ["spotlight", "oracle-topk"])
def test_lossless_rounds_at_fixed_shapes_are_dense_token_for_token(real_model, four_prompts, four_dense, method):
    """After the first round, the draft step and the verification run at fixed shapes (what CUDA graphs replay;
    graph_decode=True runs them on CPU): drafts write slots that the verification rewrites, each row masks what it
    rejected. The output is dense's, and the rounds took that path."""
    model, tokenizer = real_model
    result = sparsekv.generate(model, tokenizer, four_prompts, SparseConfig(method=method, budget=0.05),
                               max_new_tokens=32, lossless=True, draft_tokens=4, graph_decode=True)  # fmt: skip
    assert result.new_token_ids == four_dense.new_token_ids
    assert result.decode_paths["eager: first round"] == 1 and result.decode_paths["fixed-shape"] >= 5
    assert result.tokens_per_verification > 2
    assert result.avg_budget_tokens < 0.1 * result.avg_context_tokens  # the drafts were sparse


def test_captured_rounds_queue_the_next_round_before_reading_one_back(real_model, four_prompts, four_dense,
                                                                     monkeypatch):  # fmt: skip
    """A round goes to the device before the host reads the previous one's tokens back (the host's bookkeeping
    overlaps the device's work), except after a round that may finish every row; no round is wasted, no buffer
    grows when the rounds begin, and the output is dense's."""
    from sparsekv.cache import SparseLayer
    from sparsekv.lossless import CapturedRounds

    calls, grown = [], []
    launch, finish, grow = CapturedRounds.launch, CapturedRounds.finish, SparseLayer._grow
    monkeypatch.setattr(CapturedRounds, "launch", lambda self, *args: calls.append(1) or launch(self, *args))
    monkeypatch.setattr(CapturedRounds, "finish", lambda self, *args: calls.append(-1) or finish(self, *args))
    monkeypatch.setattr(SparseLayer, "_grow", lambda self, buffer, *args: grown.append(buffer is not None) or grow(
        self, buffer, *args))  # fmt: skip
    model, tokenizer = real_model
    result = sparsekv.generate(model, tokenizer, four_prompts, SparseConfig(method="oracle-topk", budget=0.05),
                               max_new_tokens=32, lossless=True, draft_tokens=4, graph_decode=True)  # fmt: skip
    assert result.new_token_ids == four_dense.new_token_ids
    in_flight = [sum(calls[: i + 1]) for i in range(len(calls))]
    assert sum(calls) == 0 and max(in_flight) == 2  # every round read back once, at most one queued ahead
    assert in_flight.count(2) >= 3 and in_flight[-2:] == [1, 0]  # ahead while rows go on, not once they may end
    assert grown and not any(grown)  # the prompt's buffers held the rounds' drafts from the start


def test_a_lossless_cache_is_allocated_once_for_its_fixed_shape_rounds(tiny, monkeypatch):
    """The prompt's buffers hold the rounds' drafts too: none grows (a copy of the whole cache) when the rounds
    begin at fixed shapes."""
    from sparsekv.cache import SparseLayer

    grown = []
    grow = SparseLayer._grow
    monkeypatch.setattr(SparseLayer, "_grow", lambda self, buffer, *args: grown.append(buffer is not None) or grow(
        self, buffer, *args))  # fmt: skip
    config = SparseConfig(method="streaming", budget=0.2, dense_layers=(0,))
    ids = torch.randint(3, tiny.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    plain = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    with sparsekv.enabled(tiny, config, lossless=True, draft_tokens=3, graph_decode=True) as runtime:
        out = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)  # fmt: skip
    assert torch.equal(out, plain) and runtime.drafts.paths.get("fixed-shape", 0) >= 2
    assert grown and not any(grown)  # every buffer allocated once, when the prompt came in


def test_auto_draft_counts_follow_measured_acceptance_and_step_times(real_model, four_prompts):
    """draft_tokens="auto": the fixed-shape rounds draft AUTO_EAGER_DRAFTS until both steps are timed, then the
    count that `best_draft_count` gives for what was measured so far (0 or one of AUTO_DRAFT_CHOICES), and the
    output stays dense's."""
    from sparsekv.lossless import AUTO_DRAFT_CHOICES, AUTO_EAGER_DRAFTS

    model, tokenizer = real_model
    config = SparseConfig(method="oracle-topk", budget=0.05)
    tokenizer.padding_side = "left"
    batch = tokenizer(four_prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    plain = model.generate(**batch, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with sparsekv.enabled(model, config, lossless=True, graph_decode=True) as runtime:  # draft_tokens "auto"
        out = model.generate(**batch, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(out, plain)
    drafts = runtime.drafts
    assert drafts.paths["eager: first round"] == 1 and drafts.paths["fixed-shape"] >= 2
    assert set(drafts.drafts_per_round) <= {0, *AUTO_DRAFT_CHOICES} and drafts.draft_cost > 0
    assert drafts.drafts_per_round[AUTO_EAGER_DRAFTS] >= 1  # the first fixed-shape round, before any timing


def test_row_masked_fixed_steps_count_each_rows_own_visible_tokens():
    """Stats of a fixed-shape step whose rows see slots of their own (`BudgetStats.row_sums`): a row's masked draft
    slots are not part of its context, as in an eager step's `record`."""
    from sparsekv.stats import BudgetStats
    from sparsekv.step import Selection

    visible = torch.zeros(2, 1, 10, dtype=torch.bool)
    visible[0, 0, :8] = True  # row 0 sees 8 slots
    visible[1, 0, [0, 1, 2, 3, 6]] = True  # row 1: 5 (slots 4 and 5 are its rejected drafts)
    indices = torch.tensor([0, 1, 4, 5]).expand(2, 3, 1, 4)  # 3 selection heads
    selection = Selection(indices, visible[:, None].expand(-1, 3, -1, -1).gather(-1, indices))
    fixed, eager = BudgetStats(1), BudgetStats(1)
    fixed.prepare_sums(torch.device("cpu"))
    fixed.add_sums(0, BudgetStats.row_sums(selection, *BudgetStats.row_step_stats(visible, 3)))
    eager.record(0, selection, visible)
    for name in ("avg_budget_tokens", "avg_context_tokens", "avg_budget_fraction"):
        assert fixed.summary()[name] == pytest.approx(eager.summary()[name])
    assert fixed.summary()["avg_context_tokens"] == pytest.approx(6.5)  # (8 + 5) / 2, not the 8 written slots
    assert fixed.summary()["avg_budget_tokens"] == pytest.approx(3.0)  # row 1's slots 4 and 5 are not attended


def test_best_draft_count_weighs_acceptance_against_draft_cost():
    from sparsekv.lossless import best_draft_count

    assert best_draft_count(0.99, 0.01, 8) == 8  # cheap drafts that hold: draft the most
    assert best_draft_count(0.0, 0.1, 8) == 0  # drafts never hold: plain dense steps
    assert best_draft_count(0.9, 1.0, 8) == 0  # a draft step costs a whole verification: no gain
    assert best_draft_count(1.0, 0.2, 4) == 4
    # between: a = 0.8 and drafts at a quarter of a verification: of the choices, 4 (3.36 tokens / 2 = 1.68 a
    # verification) beats 2 (2.44 / 1.5 = 1.63) and 8 (4.33 / 3 = 1.44)
    assert best_draft_count(0.8, 0.25, 8) == 4
    assert best_draft_count(0.5, 0.1, 8) == 2  # 1.75 / 1.2 = 1.46 beats 1 (1.36) and 4 (1.94 / 1.4 = 1.38)


def test_lossless_rounds_say_why_they_run_eagerly(real_model, four_prompts):
    model, tokenizer = real_model
    result = sparsekv.generate(model, tokenizer, four_prompts[:1], SparseConfig(method="quest", budget=0.05),
                               max_new_tokens=8, lossless=True, graph_decode=True)  # fmt: skip
    assert "eager: quest keeps state that a slot written again does not replace" in result.decode_paths


def test_each_row_of_a_batch_takes_its_own_accepted_drafts(real_model, four_prompts, four_dense):
    """Rows accept different numbers of drafts per verification. Each row takes its own (the slots of the drafts it
    rejected are masked for it alone), so a batch gets about as many tokens per dense forward as its rows alone
    (2.3-3.1 here); a batch-wide shortest accepted prefix gave 1.23. Every row is still dense's greedy output,
    through `sparsekv.generate` and through `model.generate()`."""
    model, tokenizer = real_model
    prompts, dense = four_prompts, four_dense
    config = SparseConfig(method="quest", budget=0.05)
    lossless = sparsekv.generate(model, tokenizer, prompts, config, max_new_tokens=32, lossless=True)
    assert lossless.new_token_ids == dense.new_token_ids
    assert lossless.tokens_per_verification > 2
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # left-padded
    assert not bool(batch["attention_mask"].all())
    plain = model.generate(**batch, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with sparsekv.enabled(model, config, lossless=True) as runtime:
        ours = model.generate(**batch, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(ours, plain)
    assert runtime.drafts.tokens_per_verification > 2


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


def test_self_index_drafts_from_its_compressed_cache_and_rolls_back_only_in_lossless_decoding(tiny):
    """Lossless `model.generate()` keeps the 16-bit K/V beside self-index's compressed cache: the drafts read the
    compressed cache, the verification the 16-bit K/V, a rejection rebuilds the store, and the output is plain
    greedy's. Prompt lookup, whose cache holds only the compressed K/V, is a clear error."""
    config = SparseConfig(method="self-index", budget=0.2, dense_layers=(0,), options={"residual": 8, "k_group": 8})
    ids = torch.randint(3, tiny.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(2))
    plain = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    with sparsekv.enabled(tiny, config, lossless=True, draft_tokens=4) as runtime:
        out = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(out, plain)
    assert runtime.drafts.acceptance_rate < 1  # some drafts were rejected: the store was rolled back
    repeated = torch.cat([ids, ids[:, :12]], dim=1)
    with pytest.raises(ConfigError, match="self-index"):
        _greedy(tiny, config, repeated, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("method,options", [("lsh", {}), ("self-index", {"residual": 8, "k_group": 8})])
def test_lossless_generate_prefills_in_chunks(tiny, method, options):
    """`prefill_chunk_size` (transformers' chunked prefill) in lossless `model.generate()`: every chunk of the
    prompt attends densely (a chunk that attended sparsely would leave K/V that the dense verification does not
    reproduce), and a left-padded batch gives plain greedy's tokens."""
    ids = torch.randint(3, tiny.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding: the row's first two chunks are padding alone
    kwargs = {"attention_mask": mask, "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    plain = tiny.generate(ids, **kwargs)
    config = SparseConfig(method=method, budget=0.1, dense_layers=(0,), options=options)
    with sparsekv.enabled(tiny, config, lossless=True, draft_tokens=3) as runtime:
        assert torch.equal(tiny.generate(ids, prefill_chunk_size=16, **kwargs), plain)
    assert runtime.drafts.verifications > 0


SLOT_STATE_METHODS = [m for m in available_methods() if get_method_class(m).slot_state]


@pytest.mark.parametrize("method", SLOT_STATE_METHODS)
def test_every_slot_state_method_runs_lossless_rounds_at_fixed_shapes(tiny, method):
    """The methods whose state is one entry per slot take several tokens at once in `append_fixed_shape` (the
    verification) and a slot written again replaces its entry: their fixed-shape rounds give plain greedy's
    tokens for a batch whose rows accept different drafts."""
    ids = torch.randint(3, tiny.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(4))
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    plain = tiny.generate(ids, **kwargs)
    config = SparseConfig(method=method, budget=0.5, dense_layers=(0,))
    with sparsekv.enabled(tiny, config, lossless=True, draft_tokens=3, graph_decode=True) as runtime:
        assert torch.equal(tiny.generate(ids, **kwargs), plain)
    assert runtime.drafts.paths.get("fixed-shape", 0) >= 2 and runtime.drafts.accepted > 0


def test_compiled_lossless_rounds_equal_plain_greedy(tiny):
    """`compile_step=True` with lossless=True: the fixed-shape rounds' draft step and verifications run the
    model's forward through torch.compile (`GraphDecode.step_forward`), with plain greedy's tokens."""
    from torch._dynamo.utils import counters

    ids = torch.randint(3, tiny.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    plain = tiny.generate(ids, **kwargs)
    config = SparseConfig(method="streaming", budget=0.5, dense_layers=(0,))
    torch._dynamo.reset()
    counters.clear()
    with sparsekv.enabled(tiny, config, lossless=True, draft_tokens=2, graph_decode=True, compile_step=True) as runtime:
        assert torch.equal(tiny.generate(ids, **kwargs), plain)
    assert runtime.drafts.paths.get("fixed-shape", 0) >= 2 and runtime.drafts.accepted > 0
    assert counters["stats"]["unique_graphs"] >= 2  # the layers' compiled pieces ran, not the eager forward


@pytest.mark.parametrize("graph_decode", [False, True])
def test_a_sliding_window_model_decodes_losslessly(graph_decode):
    """Gemma 3's sliding windows: eager rounds go through transformers' masks, whose windows count cache slots, so
    a batch takes its shortest accepted prefix there (with per-row masked slots this batch's output differed);
    fixed-shape rounds count each row's own positions (`attention._window_start`), so every row takes its own drafts.
    Both give plain greedy's output."""
    from sparsekv.models import random_model

    model = random_model("tiny-gemma3", dtype=torch.float64, seed=0)  # window 16
    ids = torch.randint(3, model.config.vocab_size, (4, 60), generator=torch.Generator().manual_seed(3))
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(ids, **kwargs)
    config = SparseConfig(method="oracle-topk", budget=0.5, dense_layers=())
    with sparsekv.enabled(model, config, lossless=True, draft_tokens=3, graph_decode=graph_decode) as runtime:
        assert torch.equal(model.generate(ids, **kwargs), plain)
    drafts = runtime.drafts
    assert drafts.accepted > 0
    if graph_decode:
        assert drafts.paths.get("fixed-shape", 0) >= 3 and drafts.rejected > 0  # rows took different prefixes
    else:
        assert set(drafts.paths) == {"eager: first round", "eager: graph_decode=False"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured rounds need a GPU")
def test_captured_rounds_of_a_sliding_window_model_with_wide_heads_equal_plain_greedy():
    """Gemma 3's shape with 256-channel heads on CUDA: captured rounds of 8 drafts (a verification of 9 queries x
    4 heads, 32 tokens a step) whose sliding layers read from their window's first slot, rows accepting different
    drafts: plain greedy's tokens."""
    from sparsekv.models import random_model

    model = random_model("tiny-gemma3", dtype=torch.float32, device="cuda", seed=0, head_dim=256)
    ids = torch.randint(3, model.config.vocab_size, (4, 200), generator=torch.Generator().manual_seed(3)).cuda()
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 40, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(ids, **kwargs)
    config = SparseConfig(method="streaming", budget=0.1, dense_layers=())
    with sparsekv.enabled(model, config, lossless=True, draft_tokens=8) as runtime:
        assert torch.equal(model.generate(ids, **kwargs), plain)
    assert runtime.drafts.paths.get("graph", 0) >= 2 and runtime.drafts.accepted > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured rounds need a GPU")
def test_a_profiled_round_records_its_draft_steps_and_verification_apart_and_is_not_timed():
    from sparsekv.models import random_model

    model = random_model("tiny-llama", dtype=torch.float32, device="cuda", seed=0)
    ids = torch.randint(3, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(4)).cuda()
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 40, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(ids, **kwargs)
    config = SparseConfig(method="streaming", budget=0.1, dense_layers=())
    with sparsekv.enabled(model, config, lossless=True, draft_tokens=2) as runtime:
        runtime.profile_round_after = 1
        assert torch.equal(model.generate(ids, **kwargs), plain)
    drafts = runtime.drafts
    (draft_events, draft_steps), (verify_events, verify_steps) = drafts.step_profiles["draft"], drafts.step_profiles["verify"]
    assert (draft_steps, verify_steps) == (2, 1) and set(drafts.step_profiles) == {"draft", "verify"}
    assert sum(e.self_device_time_total for e in draft_events) > 0 and sum(e.count for e in verify_events) > 0
    # rounds: the first (eager), the capture, timed ones (the profiled round is decided once one was read back, so
    # the one queued by then is timed too), the profiled one, then timed ones
    steady = [s for *_, s in drafts.timeline]
    assert steady[:3] == [True, False, True] and steady.count(False) == 2 and drafts.verify_steps == len(steady) - 3


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


# ------------------------------------------------------------- sampling keeps the dense distribution


class _DigitTokenizer:
    """Prompts of space-separated token ids, for a tiny random model (no special tokens)."""

    padding_side, pad_token, eos_token, eos_token_id = "left", "0", None, None

    def __call__(self, prompts, return_tensors=None, padding=True, add_special_tokens=False):
        ids = torch.tensor([[int(t) for t in p.split()] for p in prompts])
        return _Batch(input_ids=ids, attention_mask=torch.ones_like(ids))

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Batch(dict):
    def to(self, _device):
        return self


def test_lossless_sampling_draws_from_the_dense_distribution():
    """6,000 independent rows of one prompt, 3 sampled tokens each: per position, the lossless tokens' histogram is
    as close to dense sampling's as sampling noise allows, while plain sparse sampling is measurably off."""
    from sparsekv.models import random_model

    model = random_model("tiny-llama", dtype=torch.float64, seed=0, vocab_size=16, num_hidden_layers=3)
    ids = torch.randint(3, 16, (24,), generator=torch.Generator().manual_seed(0))
    prompts = [" ".join(map(str, ids.tolist()))] * 6000
    sparse = SparseConfig(method="streaming", budget=3, dense_layers=())

    paths = {}

    def histograms(config, seed, **kwargs):
        result = sparsekv.generate(model, _DigitTokenizer(), prompts, config, max_new_tokens=3, do_sample=True,
                                   temperature=0.7, seed=seed, **kwargs)  # fmt: skip
        paths.update(result.decode_paths or {})
        tokens = torch.tensor(result.new_token_ids)
        return torch.stack([torch.bincount(tokens[:, j], minlength=16) / len(prompts) for j in range(3)])

    def distance(a, b):  # total variation per position
        return 0.5 * (a - b).abs().sum(-1)

    dense = histograms(SparseConfig(method="dense"), seed=1)
    noise = distance(dense, histograms(SparseConfig(method="dense"), seed=2))
    lossless = distance(dense, histograms(sparse, seed=4, lossless=True, draft_tokens=2))
    lossy = distance(dense, histograms(sparse, seed=3))
    assert (lossless < 0.06).all() and (noise < 0.06).all()
    assert lossy[1:].mean() > 0.08 > lossless[1:].mean()  # the drafts alone are off; verified, they are not
    # the rounds at fixed shapes (what CUDA graphs replay) sample the same way: a method with per-slot state
    per_slot = SparseConfig(method="oracle-topk", budget=3, dense_layers=())
    fixed = distance(dense, histograms(per_slot, seed=5, lossless=True, draft_tokens=1, graph_decode=True))
    assert (fixed < 0.06).all() and lossy[1:].mean() > 0.08 > fixed[1:].mean()
    assert paths.get("fixed-shape", 0) >= 1


def test_sampling_is_repeatable_with_a_seed_and_checks_its_temperature(real_model):
    model, tokenizer = real_model
    config = SparseConfig(method="oracle-topk", budget=0.1)
    first, second = (sparsekv.generate(model, tokenizer, "Once upon a time", config, max_new_tokens=8,
                                       do_sample=True, seed=7) for _ in range(2))  # fmt: skip
    assert first.new_token_ids == second.new_token_ids
    with pytest.raises(ConfigError, match="temperature"):
        sparsekv.generate(model, tokenizer, "hi", config, max_new_tokens=2, do_sample=True, temperature=0)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("budget,sink,local", [(0.3, 0, 0), (0.3, 4, 8), (7, 2, 3), (0.9, 30, 30)])
def test_a_fixed_steps_budgets_count_each_rows_kept_slots(tiny, rows, budget, sink, local):
    """The budgets a fixed-shape step shares (`attention._fixed_step_masks`, from each row's slot positions) are
    the eager rule's over the visible slots: a row's masked drafts do not count, and the forced tokens (built on
    first read) are the first `sink` and last `local` visible ones."""
    from sparsekv.attention import _fixed_step_masks, forced_tokens, token_budgets

    config = SparseConfig(method="streaming", budget=budget, sink=sink, local=local, dense_layers=(0,))
    cache = SparseCache.for_model(tiny, config)
    ids = torch.randint(3, tiny.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    with sparsekv.enabled(tiny, config):
        tiny(input_ids=ids, **cache_kwargs(tiny, cache), use_cache=True)
    cache.begin_fixed_shape(60, rows=rows)
    if rows:  # row 1 rejected two drafts of a round and one of the next
        cache.keep_slots(40, torch.tensor([[True] * 6, [True, False, False, True, True, False]]))
    cache.fixed_position.fill_(47)
    cache.prepare_fixed_step()
    shared = _fixed_step_masks(cache, 2, 1)
    visible = shared["visible"]
    forced = forced_tokens(visible, sink, local)
    assert torch.equal(shared["budgets"], token_budgets(config, visible, forced))
    assert torch.equal(shared["forced"](), forced)
    assert visible.sum(-1).tolist() == ([[48], [45]] if rows else [[48], [48]])
