"""GemFilter: the filter pass stops at the filter layer, scores are layer r's last-query logits, the selection is
sorted, holds the last token and never padding, and keeping the whole prompt is exactly dense generation."""

from __future__ import annotations

import pytest
import torch
from transformers import BatchEncoding

import sparsekv
from sparsekv import ConfigError, SparseConfig
from sparsekv.eval.gemfilter_scan import ProbeResult, recommend_layer, selection_distance
from sparsekv.prefill.gemfilter import (
    PAPER_OPTIONS,
    GemFilter,
    decoder_layers,
    default_filter_layer,
    gem_filter,
    kept_counts,
    last_selection,
    layer_scores,
    render_selection,
    resolve_filter_layer,
)


class ByteTokenizer:
    """Just enough tokenizer for `sparsekv.generate` on tiny random models: one token per byte (+3)."""

    pad_token = eos_token = "<eos>"
    pad_token_id = eos_token_id = 2
    padding_side = "left"

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=False):
        rows = [[b + 3 for b in text.encode()] for text in texts]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_token_id)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})

    def decode(self, ids, skip_special_tokens=True):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(max(0, min(255, i - 3)) for i in ids if i >= 3).decode(errors="replace")


def tiny(shape="tiny-llama", layers=6, dtype=torch.float64):
    from sparsekv.models import random_model

    return random_model(shape, dtype=dtype, seed=0, num_hidden_layers=layers)


def random_ids(batch, length, seed):
    return torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


PROMPTS = [
    "The quick brown fox jumps over the lazy dog; then it runs far away into the woods.",
    "short one here",
]


def test_registered_and_options():
    assert "gemfilter" in sparsekv.available_methods()
    config = SparseConfig(method="gemfilter", options={"keep": 0.25, "filter_layer": 3, "pool": 3})
    assert GemFilter.options_of(config) == {"keep": 0.25, "filter_layer": 3, "pool": 3, "window": 8}
    assert GemFilter.options_of(SparseConfig(method="gemfilter")) == {
        "keep": 1024,
        "filter_layer": None,
        "pool": 31,
        "window": 8,
    }
    assert PAPER_OPTIONS == {"window": 1, "pool": 5, "filter_layer": 0.4}
    SparseConfig(method="gemfilter", options=PAPER_OPTIONS)
    assert GemFilter.dense


def test_cache_keys_keep_the_filter_options():
    """gemfilter decodes densely, but its options change the output: two configs must not share cached cells."""
    from sparsekv.eval.common import config_key

    default = config_key(SparseConfig(method="gemfilter", options={"keep": 256}))
    paper = config_key(SparseConfig(method="gemfilter", options={"keep": 256, **PAPER_OPTIONS}))
    assert default != paper
    assert default != config_key(SparseConfig(method="gemfilter", options={"keep": 512}))


@pytest.mark.parametrize(
    "options",
    [
        {"keep": 0},
        {"keep": 1.5},
        {"keep": "all"},
        {"keep": True},
        {"pool": 4},
        {"pool": 0},
        {"filter_layer": -1},
        {"window": 0},
        {"unknown": 1},
        {"filter_layer": 1.5},
        {"filter_layer": 0.0},
        {"filter_layer": "12"},
    ],
)
def test_bad_options_are_rejected(options):
    with pytest.raises(ConfigError):
        SparseConfig(method="gemfilter", options=options)


def test_filter_layer_out_of_range():
    model = tiny(layers=4)
    with pytest.raises(ConfigError, match="out of range"):
        gem_filter(model, random_ids(1, 20, 0), keep=5, filter_layer=4)


def test_default_filter_layer_is_60_percent_of_depth_and_the_paper_40():
    assert default_filter_layer(30) == 18
    assert default_filter_layer(32) == 19
    assert default_filter_layer(2) == 1
    assert [resolve_filter_layer(0.4, n) for n in (30, 32, 40)] == [12, 13, 16]
    assert resolve_filter_layer(None, 30) == 18 and resolve_filter_layer(7, 30) == 7
    with pytest.raises(ConfigError, match="out of range"):
        resolve_filter_layer(30, 30)


def test_kept_counts():
    assert kept_counts(10, [5, 30]) == [5, 10]
    assert kept_counts(0.25, [10, 40, 1]) == [3, 10, 1]
    assert kept_counts(1.0, [7]) == [7]


def count_layer_entries(model):
    """Sequence lengths each decoder layer was entered with (a pre-hook fires even if the layer never finishes)."""
    seen: dict[int, list[int]] = {}
    handles = []
    for i, layer in enumerate(decoder_layers(model)):

        def hook(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen.setdefault(i, []).append(hidden.shape[1])

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize(
    ("options", "stop"),
    [
        ({"filter_layer": 2}, 2),
        ({}, 4),
        (PAPER_OPTIONS, 2),
    ],  # default: 60% of 6 layers -> 4; the paper: 40% -> 2
)
def test_full_depth_is_not_run_on_the_long_prompt(options, stop):
    model = tiny(layers=6)
    tokenizer = ByteTokenizer()
    config = SparseConfig(method="gemfilter", options={"keep": 16, **options})
    seen, handles = count_layer_entries(model)
    try:
        result = sparsekv.generate(model, tokenizer, PROMPTS[0], config, max_new_tokens=3)
    finally:
        for handle in handles:
            handle.remove()
    n = len(PROMPTS[0].encode())
    assert n > 16
    for layer in range(6):
        long_calls = [length for length in seen[layer] if length == n]
        assert len(long_calls) == (1 if layer <= stop else 0), (
            f"layer {layer} saw the full prompt {len(long_calls)}x"
        )
        # then the kept prompt once and one token per decode step, in every layer
        assert [length for length in seen[layer] if length != n] == [16] + [1] * (result.new_tokens - 1)
    assert last_selection(model).filter_layer == stop


def test_attention_of_the_filter_layer_does_not_run():
    model = tiny(layers=4)
    ran = []
    handles = [
        layer.self_attn.register_forward_hook(lambda *a, i=i: ran.append(i))
        for i, layer in enumerate(decoder_layers(model))
    ]
    try:
        gem_filter(model, random_ids(1, 30, 1), keep=8, filter_layer=2)
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [0, 1]


def eager_logit_sums(model, ids, layer):
    """Reference: sum over query heads of log softmax weights of the last query (eager attention). It equals
    scaling * sum_h q_h.k_j minus a constant per row, so it checks the scores up to that constant (eager attention
    takes the softmax in float32, hence the tolerance)."""
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")
    weights = out.attentions[layer][:, :, -1, :]  # [B, H, N]
    return weights.log().sum(1)


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-llama-mha", "tiny-qwen2", "tiny-mistral"])
def test_scores_are_the_last_query_logits_summed_over_heads(shape):
    model = tiny(shape, layers=4)
    ids = random_ids(2, 25, 2)
    for layer in (0, 2, 3):
        mine = layer_scores(model, ids, None, [layer])[layer].double()
        reference = eager_logit_sums(model, ids, layer) / model.model.layers[layer].self_attn.scaling
        difference = reference - mine  # constant along the keys
        assert mine.std(-1).min() > 0.1  # the scores do vary along the keys
        torch.testing.assert_close(difference, difference[:, :1].expand_as(difference), rtol=0, atol=1e-4)


@pytest.mark.parametrize("paper", [False, True])
def test_default_and_paper_scores(paper):
    """The default scores with the last 8 queries' probabilities pooled over 31 positions at 60% depth; the paper's
    options with the last query's logits pooled over 5 at 40%. The two pick different tokens."""
    from sparsekv.prefill.gemfilter import pool_scores

    model = tiny(layers=5)
    ids = random_ids(1, 60, 6)
    valid = torch.ones_like(ids, dtype=torch.bool)
    result = gem_filter(model, ids, keep=20, **(PAPER_OPTIONS if paper else {}))
    layer, window, pool = (2, 1, 5) if paper else (3, 8, 31)
    assert result.filter_layer == layer
    expected = pool_scores(layer_scores(model, ids, None, [layer], window=window)[layer], valid, pool)
    torch.testing.assert_close(result.scores, expected)
    other = gem_filter(model, ids, keep=20, **({} if paper else PAPER_OPTIONS))
    assert not torch.equal(result.kept[0], other.kept[0])


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-mistral"])  # GQA groups of 2 and 4
def test_window_scores_are_summed_attention_probabilities(shape):
    model = tiny(shape, layers=3)
    ids = random_ids(2, 25, 5)
    model.set_attn_implementation("eager")
    try:
        reference = (
            model(input_ids=ids, output_attentions=True, use_cache=False).attentions[1][:, :, -6:].sum((1, 2))
        )
    finally:
        model.set_attn_implementation("sdpa")
    mine = layer_scores(model, ids, None, [1], window=6)[1]
    torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [1, 8])
def test_selection_is_sorted_holds_the_last_token_and_no_padding(window):
    model = tiny(layers=4)
    ids = random_ids(3, 40, 3)
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    mask[2, :34] = 0  # 6 tokens: fewer than keep, kept whole
    result = gem_filter(model, ids, mask, keep=10, filter_layer=1, window=window)
    assert result.filtered
    assert [len(k) for k in result.kept] == [10, 10, 6]
    for row, kept in enumerate(result.kept):
        assert torch.equal(kept, kept.sort().values) and len(set(kept.tolist())) == len(kept)
        assert int(kept[-1]) == 39, "the last prompt token must be kept"
        assert mask[row, kept].all(), "a padding position was selected"
        assert torch.equal(result.input_ids[row, -len(kept) :], ids[row, kept])
    assert torch.equal(result.kept[2], torch.arange(34, 40))
    assert result.attention_mask.sum(-1).tolist() == [10, 10, 6]
    assert torch.isinf(result.scores[1, :15]).all()


@pytest.mark.parametrize("window", [1, 8])
def test_batch_selection_equals_each_row_alone(window):
    model = tiny(layers=4)
    lengths = (40, 27)
    ids = torch.full((2, 40), 0)
    mask = torch.zeros(2, 40, dtype=torch.long)
    rows = [random_ids(1, n, 10 + i) for i, n in enumerate(lengths)]
    for i, (row, n) in enumerate(zip(rows, lengths)):
        ids[i, 40 - n :] = row[0]
        mask[i, 40 - n :] = 1
    batched = gem_filter(model, ids, mask, keep=0.3, filter_layer=2, window=window)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        alone = gem_filter(model, row, None, keep=0.3, filter_layer=2, window=window)
        assert torch.equal(batched.kept[i] - (40 - n), alone.kept[0])


def test_keep_covering_the_prompt_is_dense():
    model = tiny(layers=3)
    tokenizer = ByteTokenizer()
    dense = sparsekv.generate(model, tokenizer, PROMPTS, SparseConfig(method="dense"), max_new_tokens=5)
    for keep in (10_000, len(PROMPTS[0].encode()), 1.0):
        seen, handles = count_layer_entries(model)
        try:
            config = SparseConfig(method="gemfilter", options={"keep": keep, "filter_layer": 1})
            result = sparsekv.generate(model, tokenizer, PROMPTS, config, max_new_tokens=5)
        finally:
            for handle in handles:
                handle.remove()
        assert result.new_token_ids == dense.new_token_ids
        assert not last_selection(model).filtered
        assert len(seen[0]) == result.new_tokens, "no filter pass when nothing is dropped"


def test_generation_runs_the_full_model_on_the_kept_tokens():
    model = tiny(layers=4)
    tokenizer = ByteTokenizer()
    config = SparseConfig(method="gemfilter", options={"keep": 12, "filter_layer": 1})
    result = sparsekv.generate(model, tokenizer, PROMPTS, config, max_new_tokens=4)
    selection = last_selection(model)
    assert selection.filtered and [len(k) for k in selection.kept] == [12, 12]
    kept_texts = [
        tokenizer.decode(selection.input_ids[row][selection.attention_mask[row].bool()]) for row in range(2)
    ]
    for row, text in enumerate(kept_texts):
        alone = sparsekv.generate(model, tokenizer, text, SparseConfig(method="dense"), max_new_tokens=4)
        assert alone.new_token_ids[0] == result.new_token_ids[row]


def test_render_selection_marks_the_gaps():
    tokenizer = ByteTokenizer()
    batch = tokenizer(["abcdefghij"])
    model = tiny(layers=2)
    result = gem_filter(model, batch["input_ids"], batch["attention_mask"], keep=4, filter_layer=1)
    result.kept[0] = torch.tensor([0, 1, 5, 9])
    assert render_selection(tokenizer, result, gap="|") == "ab|f|j"
    result.kept[0] = torch.tensor([3, 9])
    assert render_selection(tokenizer, result, gap="|") == "|d|j"


def test_selection_distance_and_recommendation():
    assert selection_distance(torch.tensor([1, 5, 30]), (10, 14)) == (5, 0.0)
    assert selection_distance(torch.tensor([1, 11, 12, 30]), (10, 14)) == (0, 0.5)
    probes = [ProbeResult(1000, d, 1000, (5, 9), [9, 0, 0, 0], [0.0, 0.25, 1.0, 1.0]) for d in (0.2, 0.8)]
    assert recommend_layer(probes) == 2
    probes[1].coverage[2] = 0.0
    probes[1].distance[2] = 3
    assert recommend_layer(probes) == 3


def test_cli_commands_registered():
    import typer

    from sparsekv.cli_methods import register

    app = typer.Typer()
    register(app)
    names = {command.name for command in app.registered_commands}
    assert {"gemfilter-scan", "gemfilter-generate"} <= names
    from typer.testing import CliRunner

    for name in ("gemfilter-scan", "gemfilter-generate"):
        result = CliRunner().invoke(app, [name, "--help"])
        assert result.exit_code == 0, result.output
    assert "--show-selected" in CliRunner().invoke(app, ["gemfilter-generate", "--help"]).output
