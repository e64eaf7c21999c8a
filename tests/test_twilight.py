"""Twilight: the top-p pruner (low-bit key estimate, bisection threshold, varlen per group/head) and the
`twilight` method. The shared method matrix covers causality / batch invariance / chunking of `twilight`."""

from __future__ import annotations

import warnings

import pytest
import torch

from sparsekv import SparseConfig
from sparsekv.config import ConfigError
from sparsekv.hf_compat import cache_kwargs
from sparsekv.pruners.top_p import (
    TopPPruner,
    budget_report,
    candidate_weights,
    compact,
    dequantize_keys,
    estimate_qk_reference,
    quantize_keys,
    top_p_threshold_reference,
)
from sparsekv.registry import available_methods, get_method_class
from sparsekv.selectors.base import topk_selection
from sparsekv.selectors.oracle import exact_weights, top_p_selection
from sparsekv.step import DecodeStep, LayerInfo, Selection
from tests.helpers import run_chunks

LAYER = LayerInfo(layer_idx=2, num_layers=4, num_heads=6, num_kv_heads=2, head_dim=16, scaling=16**-0.5)


def minimal_count(weights: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """Size of the smallest set with mass >= p of the valid total, by sorting (the definition)."""
    w = torch.where(valid, weights, torch.zeros_like(weights))
    ranked = w.sort(-1, descending=True).values
    before = ranked.cumsum(-1) - ranked
    return (before < p * w.sum(-1, keepdim=True)).sum(-1).clamp(min=1)


def random_weights(rows: int, width: int, seed: int, sharpness: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=g, dtype=torch.float64) * sharpness
    return torch.softmax(logits, -1)


def make_step(batch=2, q_len=3, n=40, gqa="group", seed=0, sink=0, local=0, layer=LAYER, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, layer.num_heads, q_len, layer.head_dim, generator=g, dtype=dtype) * 2
    keys = torch.randn(batch, layer.num_kv_heads, n, layer.head_dim, generator=g, dtype=dtype) * 2
    values = torch.randn(batch, layer.num_kv_heads, n, layer.head_dim, generator=g, dtype=dtype)
    pos = torch.arange(n - q_len, n)
    visible = (torch.arange(n)[None, :] <= pos[:, None])[None].expand(batch, -1, -1)
    rank = visible.cumsum(-1)
    forced = visible & ((rank <= sink) | (rank > rank[..., -1:] - local))
    budgets = torch.full((batch, q_len), n, dtype=torch.long).minimum(visible.sum(-1))
    return DecodeStep(query, keys, values, visible, forced, budgets, layer, gqa)


def make_pruner(step: DecodeStep, p: float, **kwargs) -> TopPPruner:
    config = SparseConfig(method="oracle-topk", top_p=p, gqa=step.gqa)
    pruner = TopPPruner(config, step.layer, **kwargs)
    pruner.prefill(step.keys, step.values, step.query)
    return pruner


# ------------------------------------------------------------------------------------------ quantized keys


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_is_asymmetric_per_token_and_packed(bits):
    keys = torch.randn(2, 3, 17, 64) * 3 + 1
    codes, scale, zero = quantize_keys(keys, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 17, 64 * bits // 8)
    assert scale.shape == zero.shape == (2, 3, 17)
    restored = dequantize_keys(codes, scale, zero, bits)
    error = (restored - keys).abs().amax(-1)
    assert (error <= scale.float() * 0.5 + 2e-2 * keys.abs().amax(-1)).all()  # half a step, + fp16 params
    assert torch.allclose(restored.amin(-1), keys.amin(-1), atol=1e-2)  # zero = per-token min


def test_incremental_state_equals_quantizing_everything_at_once():
    step = make_step(n=50)
    pruner = make_pruner(step, 0.9)
    fresh = TopPPruner(pruner.config, LAYER)
    fresh.prefill(step.keys[..., :20, :], None, None)
    for lo in range(20, 50, 7):
        fresh.append(step.keys[..., lo : lo + 7, :], None)
    for a, b in zip(pruner.quantized(), fresh.quantized()):
        assert torch.equal(a, b)
    assert pruner.state_bytes() == 2 * 2 * 50 * (16 // 2 + 2 + 2)  # B * Hkv * N * (codes + fp16 scale + zero)


def test_estimate_gathers_the_candidates_of_each_query_head():
    step = make_step(gqa="group")
    pruner = make_pruner(step, 0.9, bits=8)
    candidates = topk_selection(exact_weights(step), step)
    estimate = estimate_qk_reference(step.query, *pruner.quantized(), candidates.indices, 8)
    keys = step.keys.repeat_interleave(3, dim=1)
    exact = torch.matmul(step.query, keys.transpose(-1, -2)).gather(
        -1, candidates.indices.repeat_interleave(3, 1)
    )
    assert estimate.shape == (2, 6, 3, candidates.indices.shape[-1])
    torch.testing.assert_close(estimate.double(), exact, atol=0.3, rtol=0.05)


# ------------------------------------------------------------------------------------------ bisection


@pytest.mark.parametrize("p", [0.5, 0.8, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("sharpness", [0.5, 3.0])
def test_threshold_reaches_p_and_is_minimal(p, sharpness):
    weights = random_weights(64, 200, seed=int(p * 100), sharpness=sharpness)
    valid = torch.rand(64, 200, generator=torch.Generator().manual_seed(1)) < 0.8
    keep = top_p_threshold_reference(weights, valid, p, eps=1e-13)
    assert not (keep & ~valid).any()
    kept_mass = (weights * keep).sum(-1)
    assert (kept_mass >= p * (weights * valid).sum(-1) - 1e-12).all()
    assert torch.equal(keep.sum(-1), minimal_count(weights, valid, p))


def test_default_gap_overshoots_only_by_tokens_within_the_gap():
    weights = random_weights(64, 300, seed=5, sharpness=1.0)
    valid = torch.ones_like(weights, dtype=torch.bool)
    keep = top_p_threshold_reference(weights, valid, 0.9)  # eps = 1e-5
    assert ((weights * keep).sum(-1) >= 0.9 - 1e-12).all()
    minimal = minimal_count(weights, valid, 0.9)
    threshold = weights.sort(-1, descending=True).values.gather(-1, (minimal - 1)[:, None])
    in_gap = (weights < threshold) & (weights > threshold - 1e-5)
    extra = keep.sum(-1) - minimal
    assert (extra >= 0).all() and (extra <= in_gap.sum(-1)).all()


def test_p_one_keeps_every_candidate_and_tiny_p_keeps_the_heaviest():
    weights = random_weights(8, 50, seed=2)
    weights[0, :10] = 0.0  # underflowed weights are still candidates at p = 1
    valid = torch.ones_like(weights, dtype=torch.bool)
    valid[1, 25:] = False
    assert torch.equal(top_p_threshold_reference(weights, valid, 1.0), valid)
    keep = top_p_threshold_reference(weights, valid, 1e-9)
    assert torch.equal(keep.sum(-1), torch.ones(8, dtype=torch.long))
    assert torch.equal(keep.float().argmax(-1), weights.masked_fill(~valid, -1).argmax(-1))


def test_forced_tokens_are_kept_and_count_toward_p():
    weights = random_weights(4, 30, seed=3)
    valid = torch.ones_like(weights, dtype=torch.bool)
    forced = torch.zeros_like(valid)
    forced[:, 0] = True
    keep = top_p_threshold_reference(weights, valid, 0.7, forced=forced, eps=1e-13)
    assert keep[:, 0].all()
    others = weights.clone()
    others[:, 0] = float("inf")  # forced first, then by weight: the minimal set containing the forced token
    order = others.sort(-1, descending=True).indices
    w = weights.gather(-1, order)
    need = ((w.cumsum(-1) - w) < 0.7).sum(-1)
    assert torch.equal(keep.sum(-1), need)
    # forced tokens that alone reach p: nothing else is kept
    heavy = torch.zeros(1, 5, dtype=torch.float64)
    heavy[0, 0], heavy[0, 1:] = 0.96, 0.01
    keep = top_p_threshold_reference(heavy, torch.ones_like(heavy, dtype=torch.bool), 0.95, forced[:1, :5])
    assert keep.tolist() == [[True, False, False, False, False]]


def test_compact_keeps_order_and_distinct_indices():
    indices = torch.tensor([[[[5, 3, 9, 1]]]])
    selection = Selection(indices=indices, valid=torch.tensor([[[[True, True, True, False]]]]))
    out = compact(selection, torch.tensor([[[[False, True, True, True]]]]))
    assert out.indices.tolist() == [[[[3, 9]]]] and out.valid.all()
    assert len(set(out.indices.flatten().tolist())) == out.indices.numel()


# ------------------------------------------------------------------------------------------ the pruner


@pytest.mark.parametrize("gqa", ["group", "head"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_estimated_kept_mass_reaches_p(gqa, bits):
    step = make_step(gqa=gqa, n=64, q_len=4, sink=1, local=2)
    step.budgets.fill_(24)
    candidates = topk_selection(exact_weights(step), step)
    pruner = make_pruner(step, 0.85, bits=bits)
    keep, weights = pruner.keep_mask(step, candidates)
    assert (
        weights.shape == candidates.valid.shape == (2, step.selection_heads, 4, candidates.indices.shape[-1])
    )
    assert ((weights * keep).sum(-1) >= 0.85 - 1e-5).all()
    pruned = pruner.prune(step, candidates)
    assert (pruned.counts() >= 1).all() and (pruned.counts() <= candidates.counts()).all()
    mask, cand_mask = pruned.to_mask(64), candidates.to_mask(64)
    assert not (mask & ~cand_mask).any()
    assert (mask | ~step.forced[:, None]).all(), "a sink/local token was pruned"


@pytest.mark.parametrize("gqa", ["group", "head"])
def test_exact_estimate_over_all_tokens_equals_oracle_topp(gqa):
    step = make_step(gqa=gqa, n=48, q_len=5, seed=7)
    everything = topk_selection(exact_weights(step), step)  # budget = visible: all tokens are candidates
    pruner = make_pruner(step, 0.9, exact=True, eps=1e-13)
    ours = pruner.prune(step, everything).to_mask(48)
    oracle = top_p_selection(exact_weights(step), step, 0.9).to_mask(48)
    assert torch.equal(ours, oracle)


def test_group_policy_shares_one_budget_per_kv_head_and_head_policy_does_not():
    step = make_step(gqa="group", n=64, q_len=2)
    group = make_pruner(step, 0.9).prune(step, topk_selection(exact_weights(step), step))
    assert group.indices.shape[1] == LAYER.num_kv_heads
    head_step = make_step(gqa="head", n=64, q_len=2)
    head = make_pruner(head_step, 0.9).prune(head_step, topk_selection(exact_weights(head_step), head_step))
    assert head.indices.shape[1] == LAYER.num_heads
    assert len(set(head.counts().flatten().tolist())) > 1, "per-head budgets should differ"


def test_candidate_weights_are_normalised_softmax_over_the_candidates():
    step = make_step(gqa="group", n=30, q_len=2)
    candidates = topk_selection(exact_weights(step), step)
    logits = torch.randn(2, 6, 2, candidates.indices.shape[-1], dtype=torch.float64)
    weights = candidate_weights(logits, candidates, step, 1.0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 2, dtype=torch.float64))
    assert (weights[~candidates.valid] == 0).all()


def test_bad_settings_raise():
    config = SparseConfig(method="oracle-topk", top_p=0.9)
    with pytest.raises(ConfigError, match="supports"):
        TopPPruner(config, LAYER, bits=3)
    with pytest.raises(ConfigError, match="bits must be one of"):
        SparseConfig(method="twilight", options={"bits": 5})
    with pytest.raises(ConfigError, match="cannot provide candidates"):
        SparseConfig(method="twilight", options={"base": "dense"})
    with pytest.raises(ConfigError, match="known methods"):
        SparseConfig(method="twilight", options={"base": "nope"})


def test_default_twilight_is_lsh_candidates_at_a_quarter_pruned_at_p_095():
    """The default base is lsh (the best oracle-free base on held-out text, results/twilight_bases_4k.md): the
    candidates of `method="twilight"` with nothing set are exactly a plain lsh selector's at 25%."""
    from sparsekv.selectors.twilight import DEFAULT_BASE, TwilightSelector

    config = SparseConfig(method="twilight")
    assert DEFAULT_BASE == "lsh" and config.budget == 0.25
    selector = TwilightSelector(config, LAYER)
    assert selector.base == "lsh" and selector.pruner.p == 0.95 and selector.pruner.bits == 4
    lsh = get_method_class("lsh")(SparseConfig(method="lsh", budget=0.25), LAYER)
    step = make_step(n=64, q_len=4, seed=3)
    step = step.replace(
        budgets=torch.tensor([[config.tokens_for(int(v)) for v in row] for row in step.visible.sum(-1)])
    )
    for method in (selector, lsh):
        method.prefill(step.keys[..., :60, :], step.values[..., :60, :], step.query)
        method.append(step.keys[..., 60:, :], step.values[..., 60:, :])
    candidates, expected = selector.candidates(step), lsh.select(step)
    assert torch.equal(candidates.indices, expected.indices) and torch.equal(candidates.valid, expected.valid)
    pruned = selector.select(step)
    assert (pruned.counts() <= candidates.counts()).all() and (pruned.counts() < candidates.counts()).any()


# ------------------------------------------------------------------------------------------ on a tiny model


@pytest.fixture(scope="module")
def tiny():
    from sparsekv.models import random_model

    return random_model("tiny-llama", dtype=torch.float64, seed=0)


def composable_methods() -> list[str]:
    out = []
    for name in available_methods():
        cls = get_method_class(name)
        if not (cls.dense or cls.consumes_top_p or cls.stores_kv or name in {"gemfilter"}):
            out.append(name)
    return out


@pytest.mark.parametrize("method", composable_methods())
def test_top_p_composes_with_every_selector(tiny, method):
    try:
        config = SparseConfig(method=method, budget=0.5, top_p=0.8, dense_layers=(0,), sink=1)
    except ConfigError as error:
        pytest.skip(f"{method} cannot run with defaults: {error}")
    ids = torch.randint(0, tiny.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    _, recorder = run_chunks(tiny, config, ids, 24, chunk=8)
    assert recorder.calls
    for _, mask, visible, counts in recorder.calls:
        assert not (mask & ~visible[:, None]).any()
        budgets = torch.tensor([config.tokens_for(int(n)) for n in visible.sum(-1).flatten()]).view(2, -1)
        assert (counts >= 1).all() and (counts <= budgets[:, None]).all()


def test_twilight_method_prunes_below_its_candidates_and_reports_budgets(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = SparseConfig(method="twilight", budget=0.5, top_p=0.5, dense_layers=(0,), local=1)
    ids = torch.randint(0, tiny.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    from sparsekv.cache import SparseCache

    cache = SparseCache.for_model(tiny, config)
    import sparsekv

    with sparsekv.enabled(tiny, config), torch.inference_mode():
        tiny(input_ids=ids[:, :32], **cache_kwargs(tiny, cache), use_cache=True)
        tiny(input_ids=ids[:, 32:], **cache_kwargs(tiny, cache), use_cache=True)
    report = budget_report(cache)
    layers = [i for i in range(tiny.config.num_hidden_layers) if i != 0]
    assert sorted(report["layers"]) == layers
    assert report["mean_kept"] < report["mean_candidates"]
    assert 0 < report["mean_fraction"] < 0.5 + 1 / 32
    assert len(report["per_step_mean_kept"]) == 32
    layer = report["layers"][layers[0]]
    assert len(layer["per_head_mean_kept"]) == tiny.config.num_key_value_heads
    summary = cache.stats.summary()
    assert summary["avg_budget_tokens"] == pytest.approx(report["mean_kept"])


def test_references_agree_with_the_kernels_package():
    kernels_top_p = pytest.importorskip("sparsekv.kernels.top_p")
    kernels_qk = pytest.importorskip("sparsekv.kernels.int4_qk")
    weights = random_weights(32, 100, seed=9, sharpness=2.0).float()
    valid = torch.rand(32, 100, generator=torch.Generator().manual_seed(2)) < 0.9
    # p = 0.9 only: at p = 0.5 / 0.99 the two differ on one row each (the kernels reference tests w >= mid but
    # keeps w > low, so a bisection midpoint landing exactly on a weight drops it below p; its gap is absolute)
    ours = top_p_threshold_reference(weights, valid, 0.9)
    assert torch.equal(ours, kernels_top_p.top_p_threshold_reference(weights, valid, 0.9))
    step = make_step(gqa="group", n=40, dtype=torch.float32)
    pruner = make_pruner(step, 0.9, bits=4)
    candidates = topk_selection(exact_weights(step), step)
    codes, scale, zero = pruner.quantized()
    theirs = kernels_qk.int4_qk_reference(step.query, codes, scale.float(), zero.float(), candidates.indices)
    ours = estimate_qk_reference(step.query, codes, scale, zero, candidates.indices, 4)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    packed, _, _ = kernels_qk.quantize_int4(step.keys)
    assert (packed.int() - codes.int()).abs().le(17).all()  # same layout (codes differ only by fp16 rounding)
