"""Hand-computed tiny cases for quest, lsh, double-sparsity, snapkv and h2o (the shared matrix covers the
rest)."""

from __future__ import annotations

import math

import pytest
import torch

import sparsekv
from sparsekv import SparseConfig
from sparsekv.config import ConfigError
from sparsekv.step import DecodeStep, LayerInfo


def layer(heads=1, kv_heads=1, dim=2, scaling=1.0) -> LayerInfo:
    return LayerInfo(
        layer_idx=1, num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, scaling=scaling
    )


def make(method: str, info: LayerInfo, **options):
    from sparsekv.registry import get_method_class

    config = SparseConfig(method=method, budget=4, dense_layers=(), options=options)
    return get_method_class(method)(config, info, **options)


def step(query, keys, budgets, info, gqa="group", visible=None) -> DecodeStep:
    """query [B, Hq, Q, d] at the last Q positions of keys [B, Hkv, N, d]; budget per query (int or [B,
    Q])."""
    b, _, q_len, _ = query.shape
    n = keys.shape[2]
    if visible is None:
        pos = torch.arange(n - q_len, n)
        visible = (torch.arange(n)[None, :] <= pos[:, None])[None].expand(b, -1, -1)
    if isinstance(budgets, int):
        budgets = torch.full((b, q_len), budgets)
    return DecodeStep(
        query=query,
        keys=keys,
        values=keys.clone(),
        visible=visible,
        forced=torch.zeros_like(visible),
        budgets=budgets,
        layer=info,
        gqa=gqa,
    )


def selected(selection, b=0, s=0) -> list[list[int]]:
    """Sorted selected positions per query of one (batch, head)."""
    idx, valid = selection.indices[b, s], selection.valid[b, s]
    return [sorted(int(i) for i, v in zip(row, ok) if v) for row, ok in zip(idx, valid)]


# ------------------------------------------------------------------------------------------------- quest


def test_quest_page_scores_match_the_definition():
    from sparsekv.kernels.quest import quest_page_scores

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=gen)
    a, c = torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    hi, lo = torch.maximum(a, c), torch.minimum(a, c)
    qe = q[:, :, :, None, :]
    full_hi, full_lo = hi.repeat_interleave(2, 1)[:, :, None], lo.repeat_interleave(2, 1)[:, :, None]
    expected = torch.maximum(qe * full_hi, qe * full_lo).sum(-1)
    torch.testing.assert_close(quest_page_scores(q, lo, hi, group_reduce="none"), expected)


def test_quest_hand_case():
    from sparsekv.kernels.quest import quest_page_scores

    # pages of 2: [k0 k1] max (1,2) min (-1,0); [k2 k3] max (3,-1) min (0,-4); [k4 k5] holds the query.
    # q = (1,-1): page 0 -> max(1,-1) + max(-2,0) = 1; page 1 -> max(3,0) + max(1,4) = 7
    info = layer()
    keys = torch.tensor([[1.0, 0], [-1, 2], [3, -1], [0, -4], [0.5, 0.5], [2, 2]])[None, None]
    sel = make("quest", info, page_size=2)
    sel.prefill(keys[:, :, :5], keys[:, :, :5], keys[:, :, :5])
    query = torch.tensor([1.0, -1])[None, None, None]
    scores = sel.score(step(query, keys, 4, info))[0, 0, 0]
    assert quest_page_scores(query, sel.page_min[:, :, :2], sel.page_max[:, :, :2]).flatten().tolist() == [1, 7]
    assert scores[5] > scores[4] > scores[3] > scores[2] > scores[1] > scores[0]  # own page, then page 1
    assert selected(sel.select(step(query, keys, 4, info))) == [[2, 3, 4, 5]]
    assert selected(sel.select(step(query, keys, 3, info))) == [[3, 4, 5]]  # rest of the budget: recent first
    assert selected(sel.select(step(query, keys, 1, info))) == [[5]]  # the budget beats the own page


def test_quest_pages_start_at_the_first_real_token():
    info = layer()
    keys = torch.tensor([[9.0, 9], [1, 0], [-1, 2], [3, -1], [0, -4], [2, 2]])[None, None]  # position 0 = pad
    sel = make("quest", info, page_size=2)
    sel.prefill(keys[:, :, :5], keys[:, :, :5], keys[:, :, :5])
    visible = torch.tensor([[[False, True, True, True, True, True]]])
    sel.select(step(torch.tensor([1.0, -1])[None, None, None], keys, 3, info, visible=visible))
    torch.testing.assert_close(sel.page_max[0, 0, :2], torch.tensor([[1.0, 2], [3, -1]]))
    torch.testing.assert_close(sel.page_min[0, 0, :2], torch.tensor([[-1.0, 0], [0, -4]]))


# --------------------------------------------------------------------------------------------------- lsh


def test_lsh_hand_case_with_identity_projection():
    info = layer(dim=4)
    sel = make("lsh", info, bits=4, center_keys=False)
    sel.projection = torch.eye(4)  # code bit i = sign of channel i
    keys = torch.tensor([[1.0, -1, 1, -1], [-1, 1, -1, 1], [1, 1, 1, 1], [1, -1, -1, -1], [-1, 1, -1, 1]])
    keys = keys[None, None]
    sel.prefill(keys[:, :, :4], keys[:, :, :4], keys[:, :, :4])
    query = torch.tensor([2.0, -3, 0.5, -1])[None, None, None]
    s = step(query, keys, 2, info)
    assert sel.score(s)[0, 0, 0].tolist() == [4, 0, 2, 3, 0]  # matching bits
    assert selected(sel.select(s)) == [[0, 3]]
    assert selected(sel.select(step(query, keys, 4, info))) == [[0, 2, 3, 4]]  # tie 1 vs 4: the recent one


def test_lsh_group_scores_sum_over_the_query_group():
    info = layer(heads=2, kv_heads=1, dim=4)
    sel = make("lsh", info, bits=4, center_keys=False)
    sel.projection = torch.eye(4)
    keys = torch.tensor([[1.0, 1, 1, 1], [-1, -1, -1, -1]])[None, None]
    sel.prefill(keys[:, :, :1], keys[:, :, :1], keys[:, :, :1])
    query = torch.tensor([[1.0, 1, 1, -1], [1, -1, -1, -1]])[None, :, None]
    assert sel.score(step(query, keys, 1, info))[0, 0, 0].tolist() == [3 + 1, 1 + 3]
    sel = make("lsh", info, bits=4, center_keys=False)
    sel.projection = torch.eye(4)
    sel.prefill(keys[:, :, :1], keys[:, :, :1], keys[:, :, :1])
    per_head = sel.score(step(query, keys, 1, info, gqa="head"))
    assert per_head[0, :, 0].tolist() == [[3, 1], [1, 3]]


def test_lsh_centring_uses_only_real_prompt_keys():
    info = layer(dim=4)
    sel = make("lsh", info, bits=8)
    keys = torch.tensor([[100.0, 100, 100, 100], [1, 2, 3, 4], [3, 2, 1, 0], [1, 1, 1, 1]])[None, None]
    sel.prefill(keys[:, :, :3], keys[:, :, :3], keys[:, :, :3])
    visible = torch.tensor([[[False, True, True, True]]])
    sel.select(step(torch.ones(1, 1, 1, 4), keys, 2, info, visible=visible))
    torch.testing.assert_close(sel.key_mean[0, 0, 0], torch.tensor([2.0, 2, 2, 2]))


@pytest.mark.parametrize("bits", [128, 256, 512, 1024])
def test_lsh_projections(bits):
    from sparsekv.selectors.lsh import hash_codes, projection_matrix

    rotation = projection_matrix(64, bits, "rotation", seed=3)
    assert rotation.shape == (64, bits)
    block = rotation[:, :64].double()
    torch.testing.assert_close(block.T @ block, torch.eye(64, dtype=torch.float64), atol=1e-5, rtol=0)
    assert torch.linalg.det(block) > 0
    simhash = projection_matrix(64, bits, "simhash", seed=3)
    assert torch.equal(simhash, projection_matrix(64, bits, "simhash", seed=3))
    assert hash_codes(torch.randn(2, 3, 64), simhash).shape == (2, 3, bits // 32)


def test_lsh_rejects_bad_options():
    with pytest.raises(ConfigError, match="bits"):
        SparseConfig(method="lsh", options={"bits": 0})
    with pytest.raises(ConfigError, match="variant"):
        SparseConfig(method="lsh", options={"variant": "cosine"})


# ---------------------------------------------------------------------------------------- double sparsity


def test_double_sparsity_calibrates_on_the_prompt_and_scores_label_channels():
    info = layer(dim=4)
    sel = make("double-sparsity", info, channels=2, precision="fp32")
    # mean|q| = (1, 3, 1, 2), mean|k| = (1, 1, 4, 3) -> channel scores (1, 3, 4, 6): labels = channels 3, 2
    prompt_q = torch.tensor([[1.0, 3, 1, 2], [-1, -3, 1, -2]])[None, None]
    keys = torch.tensor([[1.0, 1, 4, 3], [-1, -1, -4, -3], [5, 7, 1, 2], [0, 9, -2, 1]])[None, None]
    sel.prefill(keys[:, :, :2], keys[:, :, :2], prompt_q)
    query = torch.tensor([2.0, 1, -1, 3])[None, None, None]
    s = step(query, keys, 2, info)
    scores = sel.score(s)[0, 0, 0]
    assert sorted(sel.selected[0, 0].tolist()) == [2, 3]
    # q2*k2 + q3*k3 per key: (-4+9, 4-9, -1+6, 2+3)
    assert scores.tolist() == [5.0, -5.0, 5.0, 5.0]
    assert selected(sel.select(s)) == [[2, 3]]  # three-way tie at 5: the recent ones


def test_double_sparsity_int8_labels_are_close():
    from sparsekv.selectors.double_sparsity import dequantize_labels, quantize_labels

    x = torch.randn(3, 5, 8) * 10
    for precision, tol in (("int8", 0.01), ("fp8", 0.07), ("bf16", 0.01)):
        stored, scale = quantize_labels(x, precision)
        back = dequantize_labels(stored, scale, torch.float32)
        assert ((back - x).abs() <= tol * x.abs().amax(-1, keepdim=True)).all(), precision


@pytest.fixture(scope="module")
def tiny():
    from sparsekv.models import random_model

    return random_model("tiny-llama", seed=0)


def test_double_sparsity_channels_file_round_trip(tiny, tmp_path):
    from sparsekv.fingerprint import model_fingerprint
    from sparsekv.models import random_model
    from sparsekv.selectors.double_sparsity import (
        DoubleSparsitySelector,
        calibrate_channels,
        load_channels,
        save_channels,
    )

    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    scores = calibrate_channels(tiny, list(ids.split(24, dim=1)))
    assert scores.shape == (2, 2, 32) and (scores > 0).all()
    path = tmp_path / "ds.safetensors"
    save_channels(path, scores, {"fingerprint": model_fingerprint(tiny)})
    ranking, _ = load_channels(path)
    assert torch.equal(ranking[..., 0], scores.argmax(-1))
    config = SparseConfig(
        method="double-sparsity", dense_layers=(), options={"channels_file": str(path), "channels": 4}
    )
    sparsekv.enable(tiny, config)  # same model: fine
    sparsekv.disable(tiny)
    other = random_model("tiny-llama", seed=1)
    with pytest.raises(ConfigError, match="another model"):
        sparsekv.enable(other, config)
    with pytest.raises(ConfigError, match="another model"):
        DoubleSparsitySelector(config, LayerInfo(1, 3, 4, 2, 32, 1.0), **config.options)
    with pytest.raises(ConfigError, match="not found"):
        SparseConfig(method="double-sparsity", options={"channels_file": str(tmp_path / "none")})


def test_double_sparsity_with_a_file_decodes(tiny, tmp_path):
    import sparsekv
    from sparsekv.fingerprint import model_fingerprint
    from sparsekv.selectors.double_sparsity import calibrate_channels, save_channels

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "ds.safetensors"
    save_channels(path, calibrate_channels(tiny, [ids[:1]]), {"fingerprint": model_fingerprint(tiny)})
    config = SparseConfig(
        method="double-sparsity", budget=8, dense_layers=(0,), options={"channels_file": str(path)}
    )
    with torch.inference_mode(), sparsekv.enabled(tiny, config):
        out = tiny.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 43)


# ------------------------------------------------------------------------------------------------ snapkv


def _snapkv_votes(keys: list[float], window: int) -> list[float]:
    """Sum over the last `window` prompt queries (q = 1, d = 1, scale 1) of causal softmax(k)."""
    votes = [0.0] * len(keys)
    for row in range(len(keys) - window, len(keys)):
        norm = sum(math.exp(k) for k in keys[: row + 1])
        for j in range(row + 1):
            votes[j] += math.exp(keys[j]) / norm
    return votes


@pytest.mark.parametrize("kernel", [1, 3])
def test_snapkv_hand_case(kernel):
    info = layer(dim=1)
    prompt = [3.0, 0.0, 0.0, 2.0, 0.0, -1.0, 1.0, 0.0]
    keys = torch.tensor(prompt + [0.5, 0.5])[None, None, :, None]
    sel = make("snapkv", info, window=2, kernel=kernel)
    sel.prefill(keys[:, :, :8], keys[:, :, :8], torch.ones(1, 1, 8, 1))
    votes = _snapkv_votes(prompt, window=2)[:6]
    if kernel == 3:
        padded = [0.0, *votes, 0.0]
        votes = [sum(padded[i : i + 3]) / 3 for i in range(6)]
    query = torch.ones(1, 1, 1, 1)
    scores = sel.score(step(query, keys[:, :, :9], 5, info))[0, 0, 0]
    torch.testing.assert_close(scores[:6].double(), torch.tensor(votes, dtype=torch.float64))
    best = sorted(sorted(range(6), key=lambda i: -votes[i])[:2])
    assert selected(sel.select(step(query, keys[:, :, :9], 5, info))) == [[*best, 6, 7, 8]]
    # one more generated token displaces the weaker of the two voted prompt tokens, for good
    weakest_kept = max(best, key=lambda i: -votes[i])
    again = selected(sel.select(step(query, keys, 5, info)))[0]
    assert again == sorted({*best, 6, 7, 8, 9} - {weakest_kept})


# --------------------------------------------------------------------------------------------------- h2o


def test_h2o_hand_case_and_permanent_eviction():
    # q = 1, scale 1, k0 = 10 dominates: token 0 gathers ~1 attention per query; the others ~e^-10 per query,
    # so older tokens (seen by more queries) are heavier. Budget 3 with recent_ratio 0.5 -> 1 recent + 2
    # heavy.
    info = layer(dim=1)
    keys = torch.tensor([10.0, 0, 0, 0, 0, 0, 0])[None, None, :, None]
    query = torch.ones(1, 1, 3, 1)
    stepped = make("h2o", info)
    stepped.prefill(keys[:, :, :4], keys[:, :, :4], torch.ones(1, 1, 4, 1))
    rows = [
        selected(stepped.select(step(query[:, :, i : i + 1], keys[:, :, : 5 + i], 3, info)))[0]
        for i in range(3)
    ]
    assert rows == [[0, 1, 4], [0, 1, 5], [0, 1, 6]]  # 4 and 5 are light once they leave the recent window
    assert not stepped.cached[0, 0, 2:6].any()
    chunked = make("h2o", info)
    chunked.prefill(keys[:, :, :4], keys[:, :, :4], torch.ones(1, 1, 4, 1))
    assert selected(chunked.select(step(query, keys, 3, info))) == rows


def test_h2o_keeps_everything_within_budget():
    info = layer(dim=1)
    keys = torch.randn(1, 1, 6, 1, generator=torch.Generator().manual_seed(0))
    sel = make("h2o", info)
    sel.prefill(keys[:, :, :4], keys[:, :, :4], torch.randn(1, 1, 4, 1))
    assert selected(sel.select(step(torch.ones(1, 1, 2, 1), keys, 10, info))) == [
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4, 5],
    ]


# ------------------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_each_baseline_generates_on_the_default_model(real_model):
    import sparsekv
    from sparsekv.eval.haystack import needle_prompt
    from sparsekv.models import chat_prompt

    model, tokenizer = real_model
    prompt = chat_prompt(tokenizer, needle_prompt(tokenizer, context_tokens=400, depth=0.5))
    for method in ("quest", "double-sparsity", "lsh", "snapkv", "h2o"):
        options = {"bits": 256} if method == "lsh" else {}
        config = SparseConfig(method=method, budget=0.25, options=options)
        result = sparsekv.generate(model, tokenizer, prompt, config, max_new_tokens=4)
        assert result.new_tokens == 4 and result.texts[0].strip(), method
        assert result.avg_budget_fraction <= 0.26, method
