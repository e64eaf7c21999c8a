"""End-to-end bench (CPU-sized) and the CUDA fast path of decode selection, checked against the CPU rule.

The histogram select runs on CUDA, or here under the Triton CPU interpreter in a child process."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsekv import SparseConfig
from sparsekv.attention import forced_tokens, step_hints, token_budgets
from sparsekv.bench.e2e import COMPILE_RECOMPILE_LIMIT, greedy_match, run_e2e, synthetic_fill
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs
from sparsekv.selectors.base import _uniform_topk, host_budget, topk_selection
from sparsekv.step import DecodeStep, LayerInfo, StepHints

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("budget", [0.02, 0.5, 0.99, 1, 7, 300])
@pytest.mark.parametrize("sink,local", [(0, 0), (1, 4), (3, 0), (0, 9)])
def test_host_budget_equals_token_budgets(budget, sink, local):
    if isinstance(budget, int) and sink + local > budget:
        pytest.skip("config rejects it")
    config = SparseConfig(method="spotlight", budget=budget, sink=sink, local=local)
    for n in (1, 2, 5, 13, 100, 257):
        visible = torch.ones(2, 1, n, dtype=torch.bool)
        expected = token_budgets(config, visible, forced_tokens(visible, sink, local))
        assert (expected == host_budget(config, n)).all(), (n, expected, host_budget(config, n))
        hints = step_hints(config, None, 1, n)
        assert hints.uniform and hints.max_budget == host_budget(config, n)
    # padded or chunked rows see fewer keys: the bound must still hold
    assert not step_hints(config, torch.zeros(1, 1, 1, 5), 1, 5).uniform
    assert not step_hints(config, None, 3, 5).uniform


def _step(scores_shape, k, sink, local, gqa="group"):
    b, _, q, n = scores_shape
    layer = LayerInfo(0, 1, 8, 2, 16, 0.25)
    visible = torch.ones(b, q, n, dtype=torch.bool)
    forced = forced_tokens(visible, sink, local)
    hints = StepHints(max_budget=k, uniform=True, sink=sink, local=local)
    keys = torch.zeros(b, 2, n, 16)
    return DecodeStep(
        torch.zeros(b, 8, q, 16), keys, keys, visible, forced, torch.full((b, q), k), layer, gqa, hints
    )


@pytest.mark.parametrize("k,sink,local", [(5, 0, 0), (9, 2, 3), (40, 1, 1), (64, 0, 0)])
def test_uniform_float_path_matches_cpu_rule(k, sink, local):
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(2, 2, 1, 64, generator=gen)  # distinct scores: no tie ambiguity
    step = _step(scores.shape, k, sink, local)
    ref = topk_selection(scores, step)  # CPU: hints ignored
    fast = _uniform_topk(scores.clone(), step)
    assert torch.equal(ref.to_mask(64), fast.to_mask(64))
    assert int(ref.counts().sum()) == int(fast.counts().sum())


def test_step_masks_are_built_once_on_first_read():
    calls = []

    def visible():
        calls.append(1)
        return torch.ones(1, 1, 5, dtype=torch.bool)

    step = _step((1, 2, 1, 5), 2, 0, 0)
    lazy = DecodeStep(step.query, step.keys, step.values, visible, step.forced, step.budgets, step.layer, "group")
    rotated = lazy.replace(query=step.query + 1)  # e.g. self-index's rotated query: still nothing built
    assert calls == [] and torch.equal(rotated.query, step.query + 1) and rotated.keys is lazy.keys
    assert lazy.visible.all() and lazy.visible is lazy.visible and calls == [1]
    copy = dataclasses.replace(lazy, query=step.query + 1)
    assert copy.visible is lazy.visible and calls == [1]
    assert rotated.visible.all() and calls == [1, 1]  # its own copy of the function, built on its own read
    with pytest.raises(TypeError):
        DecodeStep(step.query, step.keys, step.values)  # the masks have no default
    with pytest.raises(TypeError, match="no field quuery"):
        lazy.replace(quuery=step.query)


def test_cpu_selection_ignores_hints():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 9, (1, 2, 1, 50), generator=gen)
    with_hints = _step(scores.shape, 7, 1, 2)
    without = DecodeStep(*[getattr(with_hints, f) for f in ("query", "keys", "values", "visible", "forced",
                                                            "budgets", "layer", "gqa")])  # fmt: skip
    from sparsekv.selectors.spotlight import hamming_topk

    a, b = hamming_topk(scores, with_hints, value_range=(0, 8)), hamming_topk(scores, without)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.valid, b.valid)


INTERP_CHECK = r"""
import torch
from sparsekv.selectors.base import _int_topk_core
from sparsekv.step import DecodeStep, LayerInfo, StepHints
from sparsekv.selectors.spotlight import hamming_topk
from sparsekv.attention import forced_tokens
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
layer = LayerInfo(0, 1, 8, 2, 16, 0.25)
for n, k, sink, local, hi in [(300, 17, 0, 0, 512), (301, 40, 2, 3, 512), (129, 128, 1, 1, 64), (77, 5, 0, 4, 8),
                              (1000, 20, 0, 0, 3), (50, 50, 0, 0, 3)]:
    scores = torch.randint(0, hi + 1, (2, 2, 1, n), generator=g, dtype=torch.int32)
    visible = torch.ones(2, 1, n, dtype=torch.bool)
    step = DecodeStep(torch.zeros(2, 8, 1, 16), torch.zeros(2, 2, n, 16), torch.zeros(2, 2, n, 16), visible,
                      forced_tokens(visible, sink, local), torch.full((2, 1), k), layer, "group",
                      StepHints(max_budget=k, uniform=True, sink=sink, local=local))
    ref = hamming_topk(scores, step)
    fast = _int_topk_core(scores.to(dev), step, (0, hi))
    assert fast.valid.all() and fast.indices.shape[-1] == k
    assert torch.equal(ref.to_mask(n), fast.to_mask(n).cpu()), (n, k, sink, local, hi)

# the fused Hamming select (scoring + forcing + ties + select in the kernels) == the CPU rule on the scores
from sparsekv.kernels.hamming import hamming_scores_reference
from sparsekv.selectors import base
from sparsekv.selectors.base import RowBuffer, _fused_hamming_core
base.WINDOW_MIN_KEYS = 0  # the window at every size
for n, k, sink, local, bits in [(300, 17, 0, 0, 128), (301, 40, 2, 3, 64), (1000, 20, 1, 0, 32), (60, 60, 0, 0, 32)]:
    w = bits // 32
    qc = torch.randint(-2**31, 2**31 - 1, (2, 8, 1, w), generator=g, dtype=torch.int32)
    kc = torch.randint(-2**31, 2**31 - 1, (2, 2, n, w), generator=g, dtype=torch.int32)
    kc[:, :, n // 2 :] = kc[:, :, : n - n // 2]  # repeated codes: many equal scores
    visible = torch.ones(2, 1, n, dtype=torch.bool)
    step = DecodeStep(torch.zeros(2, 8, 1, 16), torch.zeros(2, 2, n, 16), torch.zeros(2, 2, n, 16), visible,
                      forced_tokens(visible, sink, local), torch.full((2, 1), k), layer, "group",
                      StepHints(max_budget=k, uniform=True, sink=sink, local=local))
    ref = hamming_topk(hamming_scores_reference(qc, kc, bits=bits), step)
    unread = lambda: (_ for _ in ()).throw(AssertionError("the fused path built a per-key mask"))
    lean = DecodeStep(step.query, step.keys, step.values, unread, unread, unread, layer, "group", step.hints)
    fast = _fused_hamming_core(qc.to(dev), kc.to(dev), bits, lean)
    assert torch.equal(ref.to_mask(n), fast.to_mask(n).cpu()), (n, k, sink, local, bits)
    hints = RowBuffer()  # the selectors' threshold window: a first (cold) and a second (warm) step
    for _ in range(2):
        fast = _fused_hamming_core(qc.to(dev), kc.to(dev), bits, step, hints)
        assert torch.equal(ref.to_mask(n), fast.to_mask(n).cpu()), (n, k, sink, local, bits, "hints")

# the fixed-shape select (a buffer of n slots, the first `length` written, per-row budgets under the buffer's) ==
# the CPU rule on the written slots
from sparsekv.attention import token_budgets
from sparsekv.config import SparseConfig
from sparsekv.selectors.base import _fixed_int_topk_core, host_budget
for n, length, budget, sink, local, hi, start in [(300, 211, 0.05, 0, 0, 512, 200), (301, 301, 0.1, 2, 3, 512, None),
                                                  (129, 40, 7, 1, 1, 64, 30), (1000, 999, 0.02, 4, 16, 3, 900),
                                                  (640, 500, 0.05, 0, 2, 8, None)]:
    config = SparseConfig(method="spotlight", budget=budget, sink=sink, local=local)
    scores = torch.randint(0, hi + 1, (2, 2, 1, n), generator=g, dtype=torch.int32)
    visible = (torch.arange(n) < length).expand(2, 1, n)
    forced = forced_tokens(visible, sink, local)
    hints = StepHints(max_budget=host_budget(config, n), uniform=False, sink=sink, local=local, fixed=True,
                      min_budget=None if start is None else host_budget(config, start))
    step = DecodeStep(torch.zeros(2, 8, 1, 16), torch.zeros(2, 2, n, 16), torch.zeros(2, 2, n, 16), visible,
                      forced, token_budgets(config, visible, forced), layer, "group", hints)
    ref = hamming_topk(scores, step)
    on_dev = step.replace(visible=visible.to(dev), forced=forced.to(dev), budgets=step.budgets.to(dev))
    fast = _fixed_int_topk_core(scores.to(dev), on_dev, (0, hi))
    assert torch.equal(ref.to_mask(n), fast.to_mask(n).cpu()), (n, length, budget, sink, local, hi)
    assert torch.equal(ref.counts(), fast.counts().cpu())

# the fused fixed-shape Hamming select (empty slots and the local window at the written end handled in the scoring
# kernel) == the CPU rule on the written slots
from sparsekv.selectors.base import _fixed_hamming_core
for n, length, budget, sink, local, bits, start in [(300, 211, 0.05, 0, 0, 128, 200), (301, 301, 0.1, 2, 3, 64, None),
                                                    (1000, 640, 0.02, 4, 16, 32, 600), (129, 40, 7, 1, 1, 96, 30)]:
    config = SparseConfig(method="spotlight", budget=budget, sink=sink, local=local)
    w = (bits + 31) // 32
    qc = torch.randint(-2**31, 2**31 - 1, (2, 8, 1, w), generator=g, dtype=torch.int32)
    kc = torch.randint(-2**31, 2**31 - 1, (2, 2, n, w), generator=g, dtype=torch.int32)
    kc[:, :, n // 2 :] = kc[:, :, : n - n // 2]  # repeated codes: many equal scores
    visible = (torch.arange(n) < length).expand(2, 1, n)
    forced = forced_tokens(visible, sink, local)
    hints = StepHints(max_budget=host_budget(config, n), uniform=False, sink=sink, local=local, fixed=True,
                      min_budget=None if start is None else host_budget(config, start),
                      written=torch.tensor([length], device=dev))
    step = DecodeStep(torch.zeros(2, 8, 1, 16), torch.zeros(2, 2, n, 16), torch.zeros(2, 2, n, 16), visible,
                      forced, token_budgets(config, visible, forced), layer, "group", hints)
    ref = hamming_topk(hamming_scores_reference(qc, kc, bits=bits), step)
    on_dev = step.replace(visible=visible.to(dev), forced=forced.to(dev), budgets=step.budgets.to(dev))
    thresholds = RowBuffer()  # a captured step's buffer: the second call starts from the first one's thresholds
    for hint in (None, thresholds, thresholds):
        fast = _fixed_hamming_core(qc.to(dev), kc.to(dev), bits, on_dev, hint)
        assert torch.equal(ref.to_mask(n), fast.to_mask(n).cpu()), (n, length, budget, sink, local, bits, hint)
        assert torch.equal(ref.counts(), fast.counts().cpu())
    assert thresholds.buffer is not None and thresholds.buffer.shape == (2 * 2,)
print("OK")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_histogram_fast_path_equals_cpu_tie_rule():
    """Reversed scores + the histogram select's lowest-position rule == ties to the more recent key."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", INTERP_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_synthetic_fill_equals_one_shot_prefill():
    from sparsekv.models import random_model

    model = random_model("tiny-llama", dtype=torch.float32, seed=0)
    config = SparseConfig(method="spotlight", budget=0.1, dense_layers=())
    chunked = SparseCache.for_model(model, config, initial_capacity=40)
    synthetic_fill(model, chunked, 2, 37, chunk=8, seed=5)
    for a in chunked.layers:
        assert a.length == 37 and a.keys.shape[-2] == 37
        codes = a.selector._hash(a.keys, "k")
        assert torch.equal(a.selector.key_codes, codes)  # every chunk reached the selector
    assert chunked.layers[0]._key_buffer.shape[-2] == 40  # preallocated, no growth


def test_synthetic_fill_stores_a_compressing_selectors_prompt_chunk_by_chunk(monkeypatch):
    """Self-index takes a synthetic prompt as it takes a chunked prefill: once `prompt_stats_tokens` are in, the
    later chunks are compressed as they come, so no layer holds the whole prompt at 16 bits (what would decide
    the largest batch a throughput search finds); the stored prompt then decodes."""
    import sparsekv
    from sparsekv.cache import SparseLayer
    from sparsekv.hf_compat import cache_kwargs
    from sparsekv.models import random_model

    model = random_model("tiny-llama", dtype=torch.float32, seed=0)
    config = SparseConfig(method="self-index", budget=0.1, dense_layers=(), options={"prompt_stats_tokens": 64})
    grown, grow = [], SparseLayer._grow
    monkeypatch.setattr(SparseLayer, "_grow",
                        lambda self, buf, like, cap: grown.append(cap) or grow(self, buf, like, cap))  # fmt: skip
    cache = SparseCache.for_model(model, config, initial_capacity=260)
    synthetic_fill(model, cache, 2, 250, chunk=32, seed=5)
    assert grown and max(grown) < 250  # the first chunks only, never the whole prompt
    assert all(layer.length == 250 and not layer.prompt_open for layer in cache.layers)
    ids = torch.randint(3, 500, (2, 251), generator=torch.Generator().manual_seed(2))
    with sparsekv.enabled(model, config):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             pad_token_id=0, **cache_kwargs(model, cache))  # fmt: skip
    assert out.shape == (2, 254) and cache.layers[0].length == 253


@pytest.mark.parametrize("prefill", ["model", "synthetic"])
def test_run_e2e_small_cpu(prefill):
    result = run_e2e("tiny-llama", context=48, batch=2, method="spotlight", budget=0.25, new_tokens=2,
                     warmup=1, prefill=prefill, device="cpu")  # fmt: skip
    dense, method = result["runs"]["dense"], result["runs"]["method"]
    assert result["layers"] == 2 and result["prefill"] == prefill and result["dense_layers"] == []
    assert dense["cached_tokens"] == method["cached_tokens"] == 48
    assert dense["tpot_ms"] > 0 and method["tokens_per_s"] > 0
    assert dense["avg_budget_tokens"] is None
    assert method["avg_budget_tokens"] == pytest.approx(0.25 * 48, abs=2)
    assert method["cache_bytes"] > dense["cache_bytes"] > 0  # K/V plus the hash codes
    json.dumps(result)


def test_run_e2e_gemfilter_needs_model_prefill():
    from sparsekv.config import ConfigError

    with pytest.raises(ConfigError):
        run_e2e("tiny-llama", context=32, batch=1, method="gemfilter", prefill="synthetic", device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": 0}, "context must be >= 1"),
        ({"batch": 0}, "batch must be >= 1"),
        ({"new_tokens": 0}, "new_tokens must be >= 1"),
        ({"layers": 0}, "layers must be >= 1"),
        ({"method": "nope"}, "unknown method 'nope'"),
    ],
)
def test_run_e2e_rejects_bad_arguments_before_building(kwargs, message, monkeypatch):
    from sparsekv.bench import e2e_model, e2e_run
    from sparsekv.config import ConfigError

    for module in (e2e_model, e2e_run):  # run_e2e builds the model, check_fits its meta-device copy
        monkeypatch.setattr(module, "build_model", lambda *a, **k: pytest.fail("built a model for bad arguments"))
    with pytest.raises(ConfigError, match=message):
        run_e2e("tiny-llama", **{"context": 32, "batch": 1, "device": "cpu", **kwargs})


def test_run_e2e_refuses_a_model_larger_than_free_memory(monkeypatch):
    """llama3-8b in float32 on a CPU: an error naming the sizes, not the out-of-memory killer."""
    from sparsekv.bench import e2e_model
    from sparsekv.config import ConfigError

    monkeypatch.setattr(e2e_model, "_available_bytes", lambda device: 8 * 2**30)
    with pytest.raises(ConfigError, match=r"needs about 32\.1 GB of weights .* 8\.6 GB free"):
        run_e2e("llama3-8b-random", context=64, batch=1, device="cpu")
    result = run_e2e("tiny-llama", context=32, batch=1, new_tokens=1, warmup=0, device="cpu")  # fits: runs
    assert result["runs"]["method"]["tpot_ms"] > 0


def test_bench_generate_checks_a_dense_cache_only_for_rows_that_keep_one(monkeypatch):
    """A compressed cache's rows alone (self-index) are not refused for a dense cache they never hold; a run with
    any row that keeps 16-bit K/V (HF, dense, the other methods, lossless) is."""
    import torch

    from sparsekv.bench import e2e_model
    from sparsekv.bench.generate import keeps_dense_cache
    from sparsekv.config import ConfigError

    assert not keeps_dense_cache("self-index@compile") and not keeps_dense_cache("self-index:0.1")
    for row in ("hf-dense", "hf-static-compile", "dense@compile", "spotlight", "quest@eager", "self-index@lossless",
                "self-index@lossless-compile"):  # fmt: skip
        assert keeps_dense_cache(row), row
    # 2 layers of llama3-8b in float32: about 5.9 GB of weights (embeddings included); their 128K x B4 dense
    # cache: 8.6 GB; 6 layers: about 9.4 GB of weights
    monkeypatch.setattr(e2e_model, "_available_bytes", lambda device: 8 * 2**30)
    shape = {"layers": 2, "dtype": torch.float32, "device": torch.device("cpu"), "batch": 4, "context": 131072}
    with pytest.raises(ConfigError, match=r"needs about 5\.9 GB of weights and 8\.6 GB of dense KV cache"):
        e2e_model.check_fits("llama3-8b-random", **shape)
    e2e_model.check_fits("llama3-8b-random", **shape, dense_cache=False)  # the weights fit
    with pytest.raises(ConfigError, match=r"needs about 9\.4 GB of weights, but cpu has 8\.6 GB free"):
        e2e_model.check_fits("llama3-8b-random", **{**shape, "layers": 6}, dense_cache=False)


@pytest.mark.parametrize("weights", ["random", "real"])
def test_greedy_match_harness_cpu(weights):
    """The harness end to end (CPU against CPU); "real": the embedded model and text prompts."""
    # 4 layers: the default dense layers 0 and 1 leave two that select
    report = greedy_match(("dense", "spotlight"), prompt_lengths=(20, 33), new_tokens=3, device="cpu",
                          model_name="tiny-llama", weights=weights, layers=None if weights == "real" else 4)  # fmt: skip
    assert ("embedded" in report["model"]) == (weights == "real")
    for method in ("dense", "spotlight"):
        entry = report["methods"][method]
        assert entry["matched"] == entry["total"] == 4  # two prompts alone + a padded batch of two


def test_greedy_match_rejects_unknown_weights():
    from sparsekv.config import ConfigError

    with pytest.raises(ConfigError, match="random or real"):
        greedy_match(("dense",), device="cpu", weights="pretrained")


def test_cli_e2e(tmp_path):
    from typer.testing import CliRunner

    from sparsekv.bench.cli import app

    out = tmp_path / "e2e.json"
    res = CliRunner().invoke(app, ["e2e", "--model", "tiny-llama", "--context", "40", "--batch", "1",
                                   "--method", "streaming", "--budget", "16", "--new-tokens", "2",
                                   "--output", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["runs"]["method"]["method"] == "streaming"


def test_decode_mask_equals_sdpa_mask_outside_capture(monkeypatch):
    """The mask hook only differs from sdpa_mask while a CUDA graph is captured (where transformers keeps a mask)."""
    from transformers.masking_utils import sdpa_mask

    from sparsekv import attention
    from sparsekv.bench.e2e import greedy_ids
    from sparsekv.models import random_model

    seen = []
    original = attention.decode_mask

    def spy(*args, **kwargs):
        got = original(*args, **kwargs)
        ref = sdpa_mask(*args, **kwargs)
        seen.append(
            got is None and ref is None or (got is not None and ref is not None and torch.equal(got, ref))
        )
        return got

    monkeypatch.setattr(attention, "decode_mask", spy)
    model = random_model("tiny-llama", dtype=torch.float32, seed=0)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    config = SparseConfig(method="spotlight", budget=0.5, dense_layers=())
    greedy_ids(model, config, ids[:1], None, 2)
    greedy_ids(model, config, ids, mask, 2)
    assert len(seen) >= 4 and all(seen)


@pytest.mark.parametrize("method", ["dense", "spotlight", "self-index"])
def test_compiled_decode_matches_eager(method):
    """torch.compile around the model, as `bench e2e --compile` runs it (synthetic fill, then only compiled
    calls): the sparse path runs (the forward pre-hook that attaches the cache is part of the compiled call),
    every layer shares one graph (more layers than dynamo's recompile limit of 8), no recompiles once warm, and
    the greedy tokens equal the eager ones."""
    from sparsekv.api import enabled
    from sparsekv.bench.e2e import compiled_forward
    from sparsekv.models import random_model

    torch._dynamo.reset()
    model = random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=3, num_hidden_layers=10)
    config = SparseConfig(method=method, budget=0.25)

    def decode(forward, steps=6):
        with torch.inference_mode(), enabled(model, config):
            cache = SparseCache.for_model(model, config, initial_capacity=80)
            synthetic_fill(model, cache, 2, 64)
            tok = torch.tensor([[5], [7]])
            tokens = []
            for i in range(steps):
                pos = torch.full((2, 1), 64 + i)
                with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, error_on_recompile=i >= 3):
                    logits = forward(input_ids=tok, position_ids=pos, **cache_kwargs(model, cache), use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)
                tokens.append(tok.flatten().tolist())
            kept = cache.stats.summary()["avg_budget_fraction"]
            assert kept is None if method == "dense" else kept < 0.5  # the sparse path ran, not SDPA
            return tokens

    # aot_eager: the graphs pass through AOTAutograd as with inductor, without inductor's compile time
    assert decode(compiled_forward(model, backend="aot_eager")) == decode(model)


def test_model_compile_then_generate_stays_sparse():
    """The README's recipe: `model.compile()` with unspecialised layer indices; `generate` keeps the sparse path
    (enable's pre-hook runs inside the compiled call) and its tokens."""
    import sparsekv
    from sparsekv.models import random_model

    torch._dynamo.reset()
    model = random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=3, num_hidden_layers=10)
    config = SparseConfig(method="spotlight", budget=0.25, dense_layers=())
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.inference_mode(), sparsekv.enabled(model, config):
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
            return out, sparsekv.last_cache(model).stats.summary()["avg_budget_fraction"]

    eager, kept_eager = run()
    model.compile(backend="aot_eager")
    # recompile_limit: see the README's recipe (transformers' argument-renaming wrapper, one entry per forward)
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, fail_on_recompile_limit_hit=True,
                                    recompile_limit=COMPILE_RECOMPILE_LIMIT):
        compiled, kept = run()
    assert torch.equal(compiled, eager) and kept == kept_eager < 0.5


def test_bench_generate_times_every_row_through_model_generate(tmp_path):
    """`sparsekv bench generate` on CPU: HF dense and methods through model.generate(), chunked prefill, JSON."""
    import json
    import subprocess
    import sys

    out = tmp_path / "generate.json"
    result = subprocess.run(
        [sys.executable, "-m", "sparsekv.cli", "bench", "generate", "--model", "tiny-llama", "--layers", "3",
         "--context", "96", "--batch", "2", "--rows", "hf-dense,oracle-topk,self-index", "--budget", "0.1",
         "--new-tokens", "4", "--warmup", "1", "--prefill-chunk-size", "40", "--profile-step", "3",
         "--dense-layers", "1", "--output", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    rows = {r["row"]: r for r in payload["summary"]}
    assert set(rows) == {"hf-dense", "oracle-topk", "self-index"}
    # nothing captured on CPU, so no step to profile: said per row, and null in the JSON
    assert result.stdout.count("no captured step to profile") == 3
    assert all(r["step_profile"] is None for r in rows.values())
    assert all(r["tpot_ms"] > 0 for r in rows.values())
    assert rows["hf-dense"]["vs_hf_best_dense"] == 1.0 and rows["hf-dense"]["avg_budget_tokens"] is None
    assert payload["dense_layers"] == [1]
    for method in ("oracle-topk", "self-index"):
        assert rows[method]["sparse_layers"] == [0, 2]  # --dense-layers 1 (the default keeps 0 and 1 dense)
        assert 0 < rows[method]["avg_budget_tokens"] < 0.2 * rows[method]["avg_context_tokens"]
    assert all(r["step_ms"] is None for r in rows.values())  # no CUDA graph to replay alone on CPU


def test_bench_generate_synthetic_prefill_continues_from_the_same_kv():
    """`--prefill synthetic`: transformers' DynamicCache and a SparseCache get the same random K/V, generate()
    continues from either with the same tokens (HF dense vs sparsekv's dense step), and every row of the bench
    decodes from its filled cache; the rows and models it cannot fill are refused before any model loads."""
    import sparsekv
    from sparsekv.bench.e2e_run import synthetic_fill, synthetic_hf_cache
    from sparsekv.bench.generate import run_generate
    from sparsekv.cache import SparseCache
    from sparsekv.config import ConfigError
    from sparsekv.hf_compat import cache_kwargs
    from sparsekv.models import random_model

    model = random_model("tiny-llama", dtype=torch.float32, seed=0)
    hf = synthetic_hf_cache(model, 2, 50, chunk=16, seed=3)
    ours = SparseCache.for_model(model, SparseConfig(method="dense"), initial_capacity=60)
    synthetic_fill(model, ours, 2, 50, chunk=16, seed=3)
    for mine, theirs in zip(ours.layers, hf.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    ids = torch.randint(3, 500, (2, 51), generator=torch.Generator().manual_seed(1))
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(ids, **cache_kwargs(model, hf), **kwargs)
    with sparsekv.enabled(model, SparseConfig(method="dense")):
        assert torch.equal(model.generate(ids, **cache_kwargs(model, ours), **kwargs), plain)

    result = run_generate("tiny-llama", layers=3, context=96, batch=2, rows=("hf-dense", "dense", "self-index"),
                          budget=0.1, new_tokens=4, warmup=1, device="cpu", prefill="synthetic")  # fmt: skip
    rows = {r["row"]: r for r in result["summary"]}
    assert result["prefill"] == "synthetic" and all(r["tpot_ms"] > 0 for r in rows.values())
    assert 96 < rows["self-index"]["avg_context_tokens"] < 96 + 7  # the filled prompt, then the new tokens
    for rows_, kwargs_, message in [
        (("hf-static-compile",), {}, "hf-static-compile"),
        (("lsh@lossless",), {}, "lsh@lossless"),
        (("dense",), {"prefill_chunk_size": 16}, "--prefill-chunk-size"),
        (("dense",), {"prefill": "disk"}, "prefill must be one of"),
    ]:
        with pytest.raises(ConfigError, match=message):
            run_generate("tiny-llama", layers=2, context=64, rows=rows_, device="cpu",
                         **{"prefill": "synthetic", **kwargs_})  # fmt: skip
    with pytest.raises(ConfigError, match="real weights"):
        run_generate("embedded", context=64, rows=("dense",), device="cpu", prefill="synthetic")


def test_bench_generate_rows_name_their_path_and_budget():
    from sparsekv.bench.generate import config_for, decode_path, parse_row
    from sparsekv.config import ConfigError

    assert parse_row("twilight@compile:0.25") == ("twilight", "@compile", 0.25)
    assert parse_row("lsh@eager") == ("lsh", "@eager", None) and parse_row("quest") == ("quest", "", None)
    assert parse_row("lsh@lossless") == ("lsh", "@lossless", None)
    assert parse_row("streaming@lossless-compile:0.1") == ("streaming", "@lossless-compile", 0.1)
    assert config_for("twilight@compile:0.25", 0.02, None).budget == 0.25
    assert config_for("lsh", 0.02, None, dense_below=0).dense_below == 0
    with pytest.raises(ConfigError, match="budget after ':'"):
        parse_row("lsh:x")
    from sparsekv.bench.generate import run_generate

    for real in ("embedded", "gemma3-270m"):  # the real models run whole: refused before anything loads
        with pytest.raises(ConfigError, match=f"--model {real} runs the whole real model"):
            run_generate(real, layers=2, context=64, rows=("dense",), device="cpu")
    paths = {"eager: prompt or several tokens": 1, "eager: first decode step": 1, "graph (dense fallback)": 18}
    assert decode_path(paths) == "graph 18/19, 18 dense fallback"


def test_bench_generate_lossless_rows_report_their_drafts():
    """`<method>@lossless` and `@lossless-compile` rows: `model.generate()` in lossless mode (the compiled one after
    an untimed generation), with their acceptance and rounds (eager on CPU: fixed-shape rounds need CUDA there)."""
    from sparsekv.bench.generate import run_generate

    result = run_generate("tiny-llama", layers=3, context=96, batch=2,
                          rows=("streaming@lossless:0.5", "streaming@lossless-compile:0.5"),
                          new_tokens=12, warmup=2, device="cpu", profile_step=3)  # fmt: skip
    for row in result["summary"]:
        assert row["step_profile"] is None and row["verify_profile"] is None  # no CUDA graphs to profile on CPU
        assert row["tpot_ms"] > 0 and row["tokens_per_verification"] >= 1 and row["acceptance_rate"] is not None
        assert row["timed_rounds"] >= 1 and row["capture_rounds_left_out"] == 0  # CPU: nothing captured
        assert row["decode_paths"]["eager: first round"] == 1 and row["decode_paths"]["eager: no CUDA device"] >= 1


def test_bench_generate_lossless_rows_draft_the_count_they_are_given():
    """--draft-tokens: the rounds of a lossless row draft that many tokens (auto chooses round by round); a bad
    count is refused before the model is built."""
    from sparsekv.bench.generate import run_generate
    from sparsekv.config import ConfigError

    result = run_generate("tiny-llama", layers=3, context=96, batch=2, rows=("streaming@lossless:0.5",),
                          new_tokens=12, warmup=2, device="cpu", draft_tokens=3)  # fmt: skip
    drafts = result["summary"][0]["drafts_per_round"]  # the last round may draft fewer: the tokens left
    assert max(drafts) == 3 and drafts[3] >= 2 and result["draft_tokens"] == 3
    with pytest.raises(ConfigError, match="draft_tokens must be an int >= 1 or 'auto', got 0"):
        run_generate("tiny-llama", layers=3, context=96, rows=("streaming@lossless",), device="cpu", draft_tokens=0)


def test_bench_generate_reports_the_rows_so_far_after_each_row():
    """`on_row` (the CLI's --output) gets the payload after every row, marked incomplete until the last: a run
    stopped in a later row keeps the rows it measured."""
    from sparsekv.bench.generate import run_generate

    seen = []
    result = run_generate("tiny-llama", layers=3, context=64, batch=1, rows=("hf-dense", "streaming"),
                          new_tokens=3, warmup=1, device="cpu", on_row=seen.append)  # fmt: skip
    assert [len(p["results"]) for p in seen] == [1, 2] and not any(p["complete"] for p in seen)
    assert [r["row"] for r in seen[0]["summary"]] == ["hf-dense"] and seen[0]["context"] == 64
    assert result["complete"] and result["results"] == seen[-1]["results"]


def test_bench_generate_frees_the_compiled_forward_of_an_hf_static_compile_row(monkeypatch):
    """transformers keeps the forward it compiled for a static cache on the model, with the CUDA graphs that hold
    that row's cache: the row drops it, so the rows after it do not start with its memory taken."""
    from sparsekv.bench import generate
    from sparsekv.models import random_model

    model = random_model("tiny-llama", num_hidden_layers=2)
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    ids = torch.randint(3, model.config.vocab_size, (1, 32))
    for row in ("hf-dense", "hf-static-compile"):
        model._compiled_call = model.__call__  # as transformers leaves it after compiling
        result = generate.time_generate(model, ids, row, budget=0.1, top_p=None, new_tokens=2, warmup=1,
                                        prefill_chunk_size=None)  # fmt: skip
        assert result["tpot_ms"] > 0
        assert hasattr(model, "_compiled_call") == (row == "hf-dense")
    assert resets == [True]


def test_lossless_tpot_leaves_out_the_warm_up_finished_rows_and_capture_rounds():
    """Two rows, first tokens at t=0: round 1 (warm-up) and round 3 (a capture) are left out, round 5 has a
    finished row; rounds 2 and 4 count: 0.3 s for 2 x 4 tokens, 0.075 s a token of a row."""
    from sparsekv.bench.generate import rounds_tpot

    timeline = [(1.0, 4, 2, True), (1.1, 4, 2, True), (2.0, 8, 2, False), (2.2, 4, 2, True), (2.3, 4, 1, True)]
    assert rounds_tpot(timeline, batch=2, warmup=1, first_token_at=0.0) == (pytest.approx(0.075), 2, 1, 8)
    assert rounds_tpot(timeline[:1], batch=2, warmup=1, first_token_at=0.0)[0] is None


def test_bench_generate_lossless_rows_keep_the_dense_layers_and_top_p_they_are_given(monkeypatch):
    from sparsekv.bench import generate

    made = []
    real = generate.config_for
    monkeypatch.setattr(generate, "config_for", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    generate.run_generate("tiny-llama", layers=3, context=96, batch=2, rows=("streaming@lossless:0.5",),
                          new_tokens=4, warmup=1, device="cpu", dense_layers=(), top_p=0.9)  # fmt: skip
    assert len(made) >= 2 and all(c.dense_layers == () and c.top_p == 0.9 for c in made)


def test_bench_generate_times_the_step_alone_after_the_last_token():
    from sparsekv.bench.generate import _TokenClock

    calls = []
    clock = _TokenClock(torch.device("cpu"), puts=4, at_last=lambda: calls.append(len(clock.times)))
    for _ in range(4):
        clock.put(None)
    assert calls == [4]


def test_bench_rows_keep_the_dense_layers_they_are_given():
    from sparsekv.bench.generate import config_for
    from sparsekv.config import ConfigError

    assert config_for("self-index", 0.02, None).dense_layers == (0, 1)
    assert config_for("self-index@compile:0.1", 0.02, None, dense_layers=()).dense_layers == ()
    assert config_for("hf-dense", 0.02, None, dense_layers=()) is None
    with pytest.raises(ConfigError, match="dense_layers"):
        config_for("lsh", 0.02, None, dense_layers=(-1,))


def test_bench_generate_gives_each_row_its_methods_options():
    from sparsekv.bench.generate import config_for, run_generate
    from sparsekv.config import ConfigError
    from sparsekv.registry import options_by_method

    options = options_by_method(["self-index", "lsh", "dense"], {"self-index:rescore_group": "softmax", "bits": 256})
    assert options == {"self-index": {"rescore_group": "softmax"}, "lsh": {"bits": 256}, "dense": {}}
    assert config_for("self-index@compile", 0.02, None, options=options["self-index"]).options == {
        "rescore_group": "softmax"}  # fmt: skip
    # refused before any model is built: a bad value, and an option none of the rows' methods has
    with pytest.raises(ConfigError, match="rescore_group"):
        run_generate(rows=("dense", "self-index"), options={"rescore_group": "max"})
    with pytest.raises(ConfigError, match="none of dense, lsh has it"):
        run_generate(rows=("hf-dense", "dense", "lsh@compile"), options={"rescore": 8})


def test_bench_generate_kernel_profile_sums_and_ranks_a_steps_kernels():
    from types import SimpleNamespace

    from sparsekv.bench.generate import kernel_profile

    events = [SimpleNamespace(key="attention", count=20, self_device_time_total=400.0),
              SimpleNamespace(key="cudaGraphLaunch", count=10, self_device_time_total=0.0),  # host-side: no kernel
              SimpleNamespace(key="select", count=40, self_device_time_total=100.0),
              SimpleNamespace(key="gemm", count=70, self_device_time_total=900.0)]  # fmt: skip
    profile = kernel_profile(events, replays=10, top=2)
    assert profile["kernels_per_step"] == 13 and profile["kernel_us_per_step"] == 140
    assert [k["kernel"] for k in profile["top"]] == ["gemm", "attention"]
    assert profile["top"][1] == {"kernel": "attention", "us_per_step": 40.0, "launches_per_step": 2.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_bench_generate_reports_the_captured_step_alone_on_cuda():
    from sparsekv.bench.generate import run_generate

    result = run_generate("tiny-llama", layers=3, context=256, batch=2, rows=("dense", "spotlight"), new_tokens=8,
                          warmup=2, device="cuda", profile_step=5)  # fmt: skip
    for row in result["summary"]:
        assert 0 < row["step_ms"] <= row["tpot_ms"], row
        assert row["step_profile"]["kernels_per_step"] > 0 and len(row["step_profile"]["top"]) == 5, row
