"""`model.generate()` through `sparsekv.graph_decode`: the fixed-shape decode step (what a CUDA graph replays) gives
the eager path's tokens and stats; forwards it cannot take run eagerly and say why.

On CPU the fixed-shape step runs without a graph (`graph_decode=True`); on CUDA the same tests capture and replay
it (random-weight model)."""

from __future__ import annotations

import pytest
import torch

import sparsekv
from sparsekv import ConfigError, SparseConfig
from sparsekv.hf_compat import cache_kwargs
from sparsekv.models import random_model

FIXED_SHAPE_METHODS = [("dense", None), ("oracle-topk", 0.05), ("spotlight", 0.05), ("lsh", 0.05), ("quest", 0.05),
                       ("double-sparsity", 0.05), ("twilight", 0.25), ("self-index", 0.05), ("streaming", 0.05)]  # fmt: skip
STEPS = 64


def _config(method: str, budget: float | None) -> SparseConfig:
    # dense_below=0: the method's own step also where its measured crossover (CUDA) would decode densely
    if budget is None:
        return SparseConfig(method=method)
    return SparseConfig(method=method, budget=budget, local=4, dense_below=0)


def _generate(model, ids, config: SparseConfig, graph_decode, steps: int = STEPS, **kwargs):
    with sparsekv.enabled(model, config, graph_decode=graph_decode) as runtime:
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, **kwargs)
        return out[:, ids.shape[1] :], dict(runtime.graph.steps), sparsekv.last_cache(model)


@pytest.fixture(scope="module")
def prompt(real_model):
    _, tokenizer = real_model
    text = "The committee met on Tuesday to review the budget. " * 40 + "The secret code is 4711. " * 3
    return tokenizer([text], return_tensors="pt").input_ids


@pytest.mark.parametrize("budget,sink,local", [(0.02, 2, 8), (0.1, 8, 0), (6, 2, 4), (3, 0, 0)])
def test_streaming_fixed_shape_window_equals_the_eager_rule(real_model, prompt, budget, sink, local):
    """Streaming's fixed-shape step computes its sinks and window from the step's slot: the eager rule's set for
    budgets above the 4 sinks and the forced tokens, at the forced tokens (6 = 2 sinks + 4 local: the other sinks
    do not fit) and below the sinks (3 tokens: the first 3 sinks)."""
    model, _ = real_model
    config = SparseConfig(method="streaming", budget=budget, sink=sink, local=local, dense_below=0)
    eager, _, eager_cache = _generate(model, prompt, config, graph_decode=False, steps=24)
    fixed, fixed_steps, fixed_cache = _generate(model, prompt, config, graph_decode=True, steps=24)
    assert torch.equal(fixed, eager) and fixed_steps["fixed-shape"] == 22
    for key in ("avg_budget_tokens", "avg_context_tokens"):
        assert fixed_cache.stats.summary()[key] == pytest.approx(eager_cache.stats.summary()[key])


def test_streaming_selects_once_per_fixed_shape_step(real_model, prompt, monkeypatch):
    """Streaming's fixed-shape selection depends on the step's slots alone: the first sparse layer makes it and
    the others attend over the same one (the tokens and stats equal the eager rule's: the test above)."""
    from sparsekv.selectors import streaming

    made = []
    rule = streaming.sinks_and_window
    monkeypatch.setattr(streaming, "sinks_and_window", lambda *args: made.append(1) or rule(*args))
    model, _ = real_model
    sparse_layers = model.config.num_hidden_layers - len(SparseConfig().dense_layers)
    _, steps, _ = _generate(model, prompt, SparseConfig(method="streaming", budget=0.1, dense_below=0),
                            graph_decode=True, steps=8)  # fmt: skip
    assert steps["fixed-shape"] == 6 and sparse_layers > 1 and len(made) == 6


@pytest.mark.parametrize("method,budget", FIXED_SHAPE_METHODS)
def test_fixed_shape_step_equals_eager(real_model, prompt, method, budget):
    model, _ = real_model
    config = _config(method, budget)
    eager, eager_steps, eager_cache = _generate(model, prompt, config, graph_decode=False)
    fixed, fixed_steps, fixed_cache = _generate(model, prompt, config, graph_decode=True)
    assert torch.equal(fixed, eager)
    # the prompt and the first decode step run eagerly, the other 62 steps take the fixed-shape step
    assert fixed_steps == {"eager: prompt or several tokens": 1, "eager: first decode step": 1, "fixed-shape": 62}
    assert eager_steps == {"eager: graph_decode=False": STEPS}
    eager_stats, fixed_stats = eager_cache.stats.summary(), fixed_cache.stats.summary()
    # top-p (twilight) sums its candidates' weights in another order over the fixed-width rows: a candidate
    # within the bisection's gap of the threshold may go either way
    tolerance = 1e-3 if method == "twilight" else 1e-6
    for key in ("avg_budget_tokens", "avg_context_tokens", "avg_budget_fraction"):
        assert fixed_stats[key] == (None if eager_stats[key] is None else pytest.approx(eager_stats[key], rel=tolerance))
    # afterwards the cache is an ordinary one again, at the same length
    layer = fixed_cache.layers[-1]
    assert layer.fixed_position is None and layer.keys.shape[-2] == layer.length == prompt.shape[1] + STEPS - 1


@pytest.mark.parametrize("method,options", [("spotlight", {}), ("self-index", {"residual": 16, "k_group": 8})])
def test_the_cache_decodes_on_after_a_graph_generation(real_model, prompt, method, options):
    """A second generate() continuing the first one's cache: fixed shapes again, same tokens as eager. Self-index
    with small blocks: its K blocks and 16-bit residual blocks fill inside the fixed-shape steps and carry over."""
    model, _ = real_model
    config = SparseConfig(method=method, budget=0.05, local=4, dense_below=0, options=options)
    outputs = []
    for graph_decode in (False, True):
        with sparsekv.enabled(model, config, graph_decode=graph_decode):
            first = model.generate(prompt, max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
            cache = first.past_key_values
            second = model.generate(first.sequences, **cache_kwargs(model, cache), max_new_tokens=40, do_sample=False)
            outputs.append(second)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("budget", [48, 0.05])
def test_spotlight_fixed_step_on_the_device_path_equals_eager(real_model, prompt, monkeypatch, budget):
    """What a CUDA fixed-shape spotlight step runs, here through the ops' references: the new key hashed in the
    query's launch into its device slot (`sign_hash_pair` with key_slots), the fused fixed-shape Hamming select,
    each row's budget picked in it (a budget that stays the same over the run, 48 tokens: every pick, no mask; one
    that grows with the context, 5%: each row's own count, the device budget) and the stats counted on the host
    when the steps end, without kernels in the steps. The eager path's tokens and stats."""
    from sparsekv.selectors import spotlight
    from sparsekv.selectors.base import _fixed_hamming_core

    def device_select(query_codes, key_codes, bits, step, threshold_hints=None):
        if step.hints is None or not step.hints.fixed:
            return None
        return _fixed_hamming_core(query_codes(), key_codes, bits, step, threshold_hints)

    pairs = []
    pair = spotlight.SpotlightSelector._query_codes
    monkeypatch.setattr(spotlight, "fixed_hamming_selection", device_select)
    monkeypatch.setattr(spotlight.SpotlightSelector, "_defers", lambda self, keys: True)
    monkeypatch.setattr(spotlight.SpotlightSelector, "_query_codes",
                        lambda self, query: pairs.append(self._pending_slots is not None) or pair(self, query))
    config = SparseConfig(method="spotlight", budget=budget, local=4, dense_below=0)
    device_adds = _device_path_equals_eager(real_model[0], prompt, config, monkeypatch)
    assert any(pairs) and not device_adds  # slotted pair hashes ran; no layer added stats on the device


def _device_path_equals_eager(model, prompt, config: SparseConfig, monkeypatch) -> list:
    """24 greedy steps of `config` eagerly and through its fixed-shape step: the same tokens and the same stats
    (tokens attended, context, per layer). Returns the stats that layers added on the device in either run
    (`BudgetStats.add_sums`; a fixed step whose counts are known on the host adds none)."""
    from sparsekv.stats import BudgetStats

    device_adds = []
    add = BudgetStats.add_sums
    monkeypatch.setattr(BudgetStats, "add_sums", lambda *args: device_adds.append(args) or add(*args))
    eager, _, eager_cache = _generate(model, prompt, config, graph_decode=False, steps=24)
    fixed, steps, fixed_cache = _generate(model, prompt, config, graph_decode=True, steps=24)
    assert torch.equal(fixed, eager) and steps["fixed-shape"] == 22
    eager_stats, fixed_stats = eager_cache.stats.summary(), fixed_cache.stats.summary()
    for key in ("avg_budget_tokens", "avg_context_tokens", "avg_budget_fraction"):
        assert fixed_stats[key] == pytest.approx(eager_stats[key], rel=1e-9)
    assert fixed_stats["per_layer_avg_tokens"] == pytest.approx(eager_stats["per_layer_avg_tokens"], rel=1e-9)
    return device_adds


@pytest.mark.parametrize("budget", [48, 0.05])
def test_self_index_fixed_step_on_the_device_path_equals_eager(real_model, prompt, monkeypatch, budget):
    """What a CUDA fixed-shape self-index step runs, here through the ops' references: the fused first stage
    keeping each row's own 3 x budget candidates in the select (a budget that stays the same over the run, 48
    tokens: every pick, no mask; 5%: each row's own count), the re-rank, and the stats counted on the host when
    the steps end, without kernels in the steps; the attention over the picks takes their logits from the
    re-rank's scores. The eager path's tokens and stats."""
    from sparsekv.selectors.self_index import device, selector
    from sparsekv.step import DecodeStep

    counted, tails, scored = [], [], []
    monkeypatch.setattr(selector, "_fused_rule", lambda query: True)
    tail_from = device._tail_from
    monkeypatch.setattr(device, "_tail_from", lambda kv, step, dev: tails.append(step.hints) or tail_from(kv, step, dev))
    attend_scored = device.attend_scored
    monkeypatch.setattr(device, "attend_scored", lambda *args: scored.append(args[1].hints) or attend_scored(*args))
    # as on a device: a step's k_max is the host bound (the capacity's budget), not the largest budget read back
    monkeypatch.setattr(DecodeStep, "max_budget",
                        lambda self: self.hints.max_budget if self.hints is not None else int(self.budgets.max()))  # fmt: skip
    fused = selector.lut_topk_fixed
    monkeypatch.setattr(selector, "lut_topk_fixed",
                        lambda *args, **kw: counted.append(kw["counts"] is not None) or fused(*args, **kw))  # fmt: skip
    config = SparseConfig(method="self-index", budget=budget, local=4, dense_below=0)
    device_adds = _device_path_equals_eager(real_model[0], prompt, config, monkeypatch)
    assert counted and all(c == (budget != 48) for c in counted) and not device_adds
    assert len(scored) == len(counted)  # every fused selection attended through its scores
    # the re-rank and the attention of a fixed-shape step's layers read one shared tail start
    fixed_steps = [h for h in tails if h is not None and h.fixed]
    assert fixed_steps and all(len([k for k in h.shared if k[0] == "self-index tail from"]) == 1 for h in fixed_steps)


def test_self_index_fused_step_of_a_bfloat16_model_attends_in_its_dtype(monkeypatch):
    """A 16-bit model's fused self-index step: the attention from the re-rank's scores returns the model's dtype
    (its output goes on to the model's bfloat16 projection), and every fixed-shape step takes it."""
    from sparsekv.selectors.self_index import device, selector

    scored = []
    monkeypatch.setattr(selector, "_fused_rule", lambda query: True)
    attend_scored = device.attend_scored
    monkeypatch.setattr(device, "attend_scored", lambda *args: _record(scored, attend_scored(*args)))
    model = random_model("tiny-llama", dtype=torch.bfloat16, num_hidden_layers=3)
    ids = torch.randint(3, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(0))
    config = SparseConfig(method="self-index", budget=0.2, dense_below=0, options={"residual": 8, "k_group": 4})
    with sparsekv.enabled(model, config, graph_decode=True) as runtime:
        model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        fixed = runtime.graph.steps.get("fixed-shape")
    assert fixed and scored == [torch.bfloat16] * fixed  # layer 2, the one that selects


def _record(seen: list, out: torch.Tensor) -> torch.Tensor:
    seen.append(out.dtype)
    return out


def test_padded_batches_and_methods_without_a_fixed_step_decode_eagerly(real_model):
    model, tokenizer = real_model
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = tokenizer(["A short one.", "A much longer prompt that needs no padding at all here."],
                      return_tensors="pt", padding=True)  # fmt: skip
    with sparsekv.enabled(model, _config("spotlight", 0.2), graph_decode=True) as runtime:
        model.generate(**batch, max_new_tokens=4, do_sample=False)
        assert runtime.graph.steps.get("eager: the batch is padded") == 3
    ids = batch.input_ids[1:]
    with sparsekv.enabled(model, _config("h2o", 0.2), graph_decode=True) as runtime:
        model.generate(ids, max_new_tokens=4, do_sample=False)
        assert runtime.graph.steps.get("eager: h2o has no fixed-shape decode step") == 2


def test_graph_decode_must_be_a_bool_or_none(real_model):
    model, _ = real_model
    with pytest.raises(ConfigError, match="graph_decode"):
        sparsekv.enable(model, _config("spotlight", 0.1), graph_decode="yes")


def test_compile_step_needs_the_fixed_shape_step(real_model):
    model, _ = real_model
    with pytest.raises(ConfigError, match="compile_step"):
        sparsekv.enable(model, _config("spotlight", 0.1), compile_step="yes")
    with pytest.raises(ConfigError, match="graph_decode=False"):
        sparsekv.enable(model, _config("spotlight", 0.1), graph_decode=False, compile_step=True)


def test_compiled_fixed_shape_step_equals_eager():
    """`compile_step=True`: the fixed-shape step's forward goes through torch.compile (every layer compiled, the
    cache update and the attention left to run as they are), with the eager path's tokens and stats."""
    from torch._dynamo.utils import counters

    # more layers than dynamo's default limit of 8 compiles per function: each layer's code compiles once for all
    model = random_model("tiny-llama", dtype=torch.float32, num_hidden_layers=10)
    ids = torch.randint(3, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(0))
    config = _config("spotlight", 0.2)
    eager, _, eager_cache = _generate(model, ids, config, graph_decode=False, steps=12, pad_token_id=0)
    torch._dynamo.reset()
    counters.clear()
    with sparsekv.enabled(model, config, graph_decode=True, compile_step=True) as runtime:
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        compiled_cache = sparsekv.last_cache(model)
        assert runtime.graph.steps.get("fixed-shape") == 10
    assert torch.equal(out[:, ids.shape[1] :], eager)
    # the compiled pieces of the step (around each layer's cache update and attention), not an eager fallback; the
    # layers share them (unspecialised layer indices) instead of compiling once per layer
    assert 2 <= counters["stats"]["unique_graphs"] < model.config.num_hidden_layers
    stats, eager_stats = compiled_cache.stats.summary(), eager_cache.stats.summary()
    assert stats["avg_budget_tokens"] == pytest.approx(eager_stats["avg_budget_tokens"])


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 13),
                    reason="torch's CPU compiler aborts on it before 2.13 (a ConfigError says so: the test below)")
@pytest.mark.parametrize("rule", ["device", "fused"])
def test_self_index_compiled_fixed_shape_step_equals_eager(monkeypatch, rule):
    """`compile_step=True` with self-index: the store's token encoding and open K block, and (with the device rule,
    substituted here on CPU) the selection around the re-rank run through torch.compile; with the fused first
    stage (CUDA's, its op's reference here), the LUT's quantization and the re-rank's scores. Same tokens and
    stats as the eager path."""
    from sparsekv.selectors.self_index import selector

    monkeypatch.setattr(selector, "_device_rule" if rule == "device" else "_fused_rule", lambda scores: True)
    model = random_model("tiny-llama", dtype=torch.float32, num_hidden_layers=3)
    ids = torch.randint(3, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(0))
    config = SparseConfig(method="self-index", budget=0.2, dense_below=0, options={"residual": 8, "k_group": 4})
    eager, _, eager_cache = _generate(model, ids, config, graph_decode=False, steps=12, pad_token_id=0)
    torch._dynamo.reset()
    with sparsekv.enabled(model, config, graph_decode=True, compile_step=True) as runtime:
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        compiled_cache = sparsekv.last_cache(model)
        assert runtime.graph.steps.get("fixed-shape") == 10
    assert torch.equal(out[:, ids.shape[1] :], eager)
    from sparsekv.selectors.base import COMPILED

    pieces = {"_fixed_candidates", "_fixed_rerank"} if rule == "device" else {"_first_stage_inputs", "_second_stage"}
    # the rotations of the step's query, key, value and output too (multiply-sums fused by inductor, `store._times`)
    assert {fn.__name__ for fn in COMPILED} >= {"_write_token", "rotate_keys", "_output_rows",
                                                *pieces}  # fmt: skip
    stats, eager_stats = compiled_cache.stats.summary(), eager_cache.stats.summary()
    assert stats["avg_budget_tokens"] == pytest.approx(eager_stats["avg_budget_tokens"])


def test_self_index_compiled_on_an_old_cpu_torch_is_a_clear_error(monkeypatch):
    """torch 2.11's CPU compiler aborts the process on self-index's compiled token encoding: a ConfigError instead."""
    from sparsekv.selectors.self_index import store

    monkeypatch.setattr(store.torch, "__version__", "2.11.0+cpu")
    model = random_model("tiny-llama", dtype=torch.float32, num_hidden_layers=3)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    config = SparseConfig(method="self-index", budget=0.2, dense_below=0, options={"residual": 8, "k_group": 4})
    needs = "compile_step with self-index on CPU needs torch >= 2.13"
    with sparsekv.enabled(model, config, graph_decode=True, compile_step=True), pytest.raises(ConfigError, match=needs):
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,budget", FIXED_SHAPE_METHODS)
def test_cuda_graph_replays_equal_eager(method, budget):
    model = random_model("tiny-llama", dtype=torch.float32, device="cuda", num_hidden_layers=4)
    ids = torch.randint(3, model.config.vocab_size, (2, 700), generator=torch.Generator().manual_seed(0)).cuda()
    config = _config(method, budget)
    eager, _, eager_cache = _generate(model, ids, config, graph_decode=False, pad_token_id=0)
    graphed, steps, graph_cache = _generate(model, ids, config, graph_decode=None, pad_token_id=0)
    assert steps.get("graph") == STEPS - 2, steps
    assert torch.equal(graphed, eager)
    eager_stats, graph_stats = eager_cache.stats.summary(), graph_cache.stats.summary()
    tolerance = 1e-3 if method == "twilight" else 1e-6
    assert graph_stats["avg_budget_tokens"] == pytest.approx(eager_stats["avg_budget_tokens"], rel=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,budget", [("dense", None), ("oracle-topk", 0.1)])
def test_cuda_graph_sliding_window_layers_read_their_window(method, budget):
    """Gemma 3's shape with 256-channel heads (window 16, a 300-token prompt): the captured step's sliding layers
    read their window from its first slot (`sparse_attention`'s `start`) and give the eager steps' tokens, which
    attend through the model's own sliding mask."""
    model = random_model("tiny-gemma3", dtype=torch.float32, device="cuda", head_dim=256)
    ids = torch.randint(3, model.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
    config = _config(method, budget)
    eager, _, _ = _generate(model, ids, config, graph_decode=False, steps=24, pad_token_id=0)
    graphed, steps, _ = _generate(model, ids, config, graph_decode=None, steps=24, pad_token_id=0)
    assert steps.get("graph") == 22, steps
    assert torch.equal(graphed, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("budget", [0.02, 0.1])
def test_self_index_captured_float32_step_on_the_embedded_model_equals_the_cpu_rule(budget):
    """The embedded model in float32 (d = 64, 9 query heads on 3 kv heads), one row of 1,000 tokens of held-out
    essays: the captured self-index step (the fused first stage, Triton kernels) gives the tokens of the same
    fixed-shape step on the CPU (the ops' references). At 10% each row keeps its own count of the first stage's
    picks, one budget shared by the rows as a stride-0 view: the kernels read it as one count per row."""
    from sparsekv.models import load_model
    from sparsekv.training.capture import haystack_split

    model, tokenizer = load_model("default", dtype=torch.float32, device="cpu")
    ids = tokenizer(haystack_split()[1], return_tensors="pt").input_ids[:, :1000]
    config = SparseConfig(method="self-index", budget=budget, dense_below=0)
    reference, _, _ = _generate(model, ids, config, graph_decode=True, steps=16)
    graphed, steps, _ = _generate(model.cuda(), ids.cuda(), config, graph_decode=None, steps=16)
    assert steps.get("graph") == 14, steps
    assert torch.equal(graphed.cpu(), reference)


def _to_meta(state) -> None:
    """Every tensor a selector holds, in its attributes and in the objects and dicts below them, moved to meta."""
    items = state.items() if isinstance(state, dict) else vars(state).items()
    for name, value in list(items):
        if isinstance(value, torch.Tensor):
            value = value.to("meta")
            if isinstance(state, dict):
                state[name] = value
            else:
                setattr(state, name, value)
        elif isinstance(value, dict) or (hasattr(value, "__dict__") and not isinstance(value, (type, SparseConfig))):
            _to_meta(value)


@pytest.mark.parametrize("method,options", [("quest", {"page_size": 4}), ("quest", {"page_size": 16}),
                                            ("double-sparsity", {"precision": "int8"}),
                                            ("double-sparsity", {"precision": "fp8"}),
                                            ("double-sparsity", {"precision": "bf16"}), ("self-index", {}),
                                            # small blocks: several K blocks and residual blocks fill in the steps
                                            ("self-index", {"residual": 8, "k_group": 4, "sink_tokens": 4}),
                                            ("self-index", {"k_axis": "token", "residual": 0, "sink_tokens": 4}),
                                            ("self-index", {"kv_bits": 16, "rescore": 0})])  # fmt: skip
@pytest.mark.parametrize("gqa", ["group", "head"])
@pytest.mark.parametrize("sink,local", [(2, 3), (0, 0)])  # quest without forced tokens: its page-level path
def test_selector_fixed_shape_step_keeps_the_eager_set_and_reads_no_device_value(method, options, gqa, sink, local,
                                                                                budget=0.2, held=False):  # fmt: skip
    """The selector alone, on random keys: each fixed-shape step keeps the ordinary step's tokens, and the step
    runs on meta tensors too, which fail on any host read of a device value (what CUDA graph capture forbids).
    held: the steps say how many slots are written at least (`StepHints.min_written`)."""
    import copy

    from sparsekv.attention import forced_tokens, token_budgets
    from sparsekv.registry import get_method_class
    from sparsekv.selectors.base import host_budget
    from sparsekv.step import DecodeStep, LayerInfo, StepHints

    config = SparseConfig(method=method, budget=budget, sink=sink, local=local, gqa=gqa, options=options)
    layer = LayerInfo(2, 4, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25)
    cls = get_method_class(method)
    eager, fixed = cls(config=config, layer=layer, **options), cls(config=config, layer=layer, **options)
    generator = torch.Generator().manual_seed(0)
    batch, prompt, total, capacity = 2, 37, 70, 75
    keys = torch.randn(batch, 2, total, 16, generator=generator)
    queries = torch.randn(batch, 4, total, 16, generator=generator)
    for selector in (eager, fixed):
        selector.prefill(keys[..., :prompt, :], keys[..., :prompt, :], queries[..., :prompt, :])

    def store(selector, n):  # a compressing selector (self-index) keeps token n - 1 itself
        if cls.stores_kv:
            selector.store(keys[..., n - 1 : n, :], keys[..., n - 1 : n, :])

    def ordinary_step(n):
        visible = torch.ones(batch, 1, n, dtype=torch.bool)
        forced = forced_tokens(visible, config.sink, config.local)
        hints = StepHints(max_budget=host_budget(config, n), uniform=False, sink=config.sink, local=config.local)
        return DecodeStep(queries[..., n - 1 : n, :], keys[..., :n, :], keys[..., :n, :], visible, forced,
                          token_budgets(config, visible, forced), layer, gqa, hints)  # fmt: skip

    def fixed_step(n, buffer, device="cpu"):
        visible = (torch.arange(capacity) < n).expand(batch, 1, capacity)
        forced = forced_tokens(visible, config.sink, config.local)
        budgets = token_budgets(config, visible, forced)
        hints = StepHints(max_budget=host_budget(config, capacity), uniform=False, sink=config.sink,
                          local=config.local, fixed=True, min_budget=host_budget(config, prompt + 2),
                          written=torch.full((1,), n, device=device), min_written=prompt + 2 if held else None)  # fmt: skip
        on = lambda t: t.to(device)
        return DecodeStep(on(queries[..., n - 1 : n, :]), on(buffer), on(buffer), on(visible), on(forced),
                          on(budgets), layer, gqa, hints)  # fmt: skip

    for selector in (fixed, eager):  # the first decode step completes the state
        store(selector, prompt + 1)
        selector.select(ordinary_step(prompt + 1))
    fixed.begin_fixed_shape(capacity)
    buffer = torch.zeros(batch, 2, capacity, 16)
    buffer[..., : prompt + 1, :] = keys[..., : prompt + 1, :]
    for n in range(prompt + 2, total + 1):
        buffer[..., n - 1, :] = keys[..., n - 1, :]
        if n == total:  # the last step once more on meta tensors: any host read of a device value fails there
            meta = copy.deepcopy(fixed)
            _to_meta(meta)
            meta.append_fixed_shape(keys[..., n - 1 : n, :].to("meta"), keys[..., n - 1 : n, :].to("meta"),
                                    torch.full((1,), n - 1, device="meta"))  # fmt: skip
            assert meta.select(fixed_step(n, buffer, "meta")).indices.is_meta
        position = torch.full((1,), n - 1)
        fixed.append_fixed_shape(keys[..., n - 1 : n, :], keys[..., n - 1 : n, :], position)
        got = fixed.select(fixed_step(n, buffer)).to_mask(capacity)
        store(eager, n)
        want = eager.select(ordinary_step(n)).to_mask(n)
        assert not got[..., n:].any()
        assert torch.equal(got[..., :n], want), n
    fixed.end_fixed_shape(total)
    # back to ordinary steps: the state carries over
    if cls.stores_kv:  # one more token, so that the compressing selector's ordinary append runs too
        keys = torch.cat([keys, torch.randn(batch, 2, 1, 16, generator=generator)], dim=2)
        queries = torch.cat([queries, torch.randn(batch, 4, 1, 16, generator=generator)], dim=2)
        total += 1
        store(fixed, total)
        store(eager, total)
    more = ordinary_step(total)
    assert torch.equal(fixed.select(more).to_mask(total), eager.select(more).to_mask(total))


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("gqa", ["group", "head"])
def test_quest_fixed_shape_step_with_the_device_select_keeps_the_eager_set(monkeypatch, page_size, gqa):
    """On CUDA quest's fixed-shape step selects with the integer histogram select; here its reference rule runs in
    its place (off CUDA the selector ranks the whole row instead)."""
    from sparsekv.selectors import quest
    from sparsekv.selectors.base import _fixed_int_topk_core

    ranges = []

    def device_select(scores, step, value_range):
        ranges.append(value_range)
        return _fixed_int_topk_core(scores, step, value_range)

    monkeypatch.setattr(quest, "fixed_int_topk_selection", device_select)
    # sink and local tokens: the token-level path (without them quest picks pages and never calls the select)
    test_selector_fixed_shape_step_keeps_the_eager_set_and_reads_no_device_value("quest", {"page_size": page_size}, gqa,
                                                                                 sink=2, local=3)  # fmt: skip
    assert ranges and all(hi == ((75 - 1) // page_size + 3) * page_size - 1 for _, hi in ranges)  # capacity 75


@pytest.mark.parametrize("options", [{}, {"rescore": 0}, {"residual": 8, "k_group": 4, "sink_tokens": 4},
                                     {"rescore_group": "softmax"}])
@pytest.mark.parametrize("gqa", ["group", "head"])
def test_self_index_fixed_shape_device_rule_keeps_the_eager_set(monkeypatch, options, gqa):
    """On CUDA self-index's fixed-shape step ranks with unsorted top-k and drops each row's surplus over its own
    budget (`_best_within`); here that rule runs in place of the CPU's stable sort of whole rows."""
    from sparsekv.selectors.self_index import selector

    calls = []
    monkeypatch.setattr(selector, "_device_rule", lambda scores: calls.append(scores.shape) or True)
    test_selector_fixed_shape_step_keeps_the_eager_set_and_reads_no_device_value("self-index", options, gqa,
                                                                                 sink=2, local=3)  # fmt: skip
    assert calls and all(shape[-1] == 75 for shape in calls)  # the whole buffer (capacity 75)


@pytest.mark.parametrize("options", [{}, {"rescore": 0}, {"residual": 8, "k_group": 4, "sink_tokens": 4},
                                     {"sink_tokens": 8, "sink_share": 0.5}, {"rescore_group": "softmax"}])
@pytest.mark.parametrize("gqa", ["group", "head"])
@pytest.mark.parametrize("held", [False, True])
def test_self_index_fused_first_stage_keeps_the_eager_set(monkeypatch, options, gqa, held):
    """On CUDA a fixed-shape self-index step scores, forces and picks its candidates in one op (`lut_topk_fixed`);
    here that op's reference runs in its place: the same tokens as the CPU rule, sinks that only some budgets force
    included (sink_share 0.5 of a 15-token budget: 7 of 8). gqa="head" with 2 heads per kv head keeps the CPU
    rule (the op sums a group's queries). held: every pick is a written key (`StepHints.picks_held`, budget 10%
    so that 3 x the budget fits the prompt), so the op keeps each row's own count and the selection its exact
    budget."""
    from sparsekv.kernels import lut_score
    from sparsekv.selectors.self_index import selector

    calls, exact = [], []
    monkeypatch.setattr(selector, "_fused_rule", lambda query: True)
    monkeypatch.setattr(selector, "lut_topk_fixed",
                        lambda *args, **kw: calls.append((args[2], kw["counts"])) or lut_score.lut_topk_fixed(*args, **kw))  # fmt: skip
    fused = selector.SelfIndexSelector._select_fused
    monkeypatch.setattr(selector.SelfIndexSelector, "_select_fused",
                        lambda *args: (chosen := fused(*args), exact.append(chosen.exact_budgets))[0])  # fmt: skip
    budget = 0.1 if held else 0.2
    test_selector_fixed_shape_step_keeps_the_eager_set_and_reads_no_device_value("self-index", options, gqa,
                                                                                 sink=2, local=3, budget=budget,
                                                                                 held=held)  # fmt: skip
    assert bool(calls) == (gqa == "group")  # the fused op ran, picking rescore x the step's budget at most
    most = 8 if held else 15  # the budget of the whole buffer (75 slots)
    assert not calls or max(k for k, _ in calls) == (most if options.get("rescore") == 0 else 3 * most)
    # held (budgets that grow from 5 to 8 tokens), the op keeps each row's count and the selection exactly its budget
    assert all((counts is not None) == held for _, counts in calls)
    assert len(exact) == len(calls) and all(e == held for e in exact)


def test_best_within_keeps_each_rows_budget_of_its_best_values():
    from sparsekv.selectors.self_index.selector import _best_within

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3, 2, 1, 40, generator=generator)
    values[0, 0, 0, :5] = float("-inf")  # never valid, and they take no budget
    budgets = torch.tensor([30, 36, 40]).view(3, 1, 1, 1)
    kept = _best_within(values, budgets, min_budget=30)
    ranked = values.sort(dim=-1, descending=True).indices
    want = torch.zeros_like(kept).scatter(-1, ranked, (torch.arange(40) < budgets).expand_as(kept))
    want &= values > float("-inf")
    assert torch.equal(kept, want)
    assert kept.sum(-1).flatten().tolist() == [30, 30, 36, 36, 40, 40]


def test_sparsekv_generate_decodes_through_the_same_path(real_model):
    model, tokenizer = real_model
    text = "Write a long story about a lighthouse keeper and a storm. " * 20
    config = _config("spotlight", 0.05)
    eager = sparsekv.generate(model, tokenizer, [text], config, max_new_tokens=16, graph_decode=False)
    fixed = sparsekv.generate(model, tokenizer, [text], config, max_new_tokens=16, graph_decode=True)
    assert fixed.new_token_ids == eager.new_token_ids
    assert fixed.avg_budget_tokens == pytest.approx(eager.avg_budget_tokens)
    steps = sum(fixed.decode_paths.values())  # the decode steps after the prefill's token
    assert steps == len(fixed.new_token_ids[0]) - 1 and fixed.decode_paths["fixed-shape"] == steps - 1
    assert eager.decode_paths == {"eager: graph_decode=False": steps}
    lossless = sparsekv.generate(model, tokenizer, [text], config, max_new_tokens=8, lossless=True)
    # lossless rounds: the first eagerly, the others at fixed shapes on CUDA only (graph_decode None)
    assert set(lossless.decode_paths) == {"eager: first round", "eager: no CUDA device"}


@pytest.mark.parametrize("method", ["dense", "oracle-topk"])
def test_sliding_window_layers_keep_their_window_in_fixed_shape_steps(method, monkeypatch):
    """Gemma 3's sliding-window layers (window 16 here, a 60-token prompt) see only their window in the fixed-shape
    step too: the same tokens as the eager steps, which attend through the model's own sliding mask. A dense
    layer's read of the whole buffer passes no index list (the kernel reads the slots in order), a window's read
    from its first slot a list."""
    from sparsekv import attention

    model = random_model("tiny-gemma3", dtype=torch.float32)
    assert {i.window for i in sparsekv.cache.layer_infos(model) if i.sliding} == {16}
    ids = torch.randint(3, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    config = _config(method, None if method == "dense" else 0.2)
    eager, _, _ = _generate(model, ids, config, graph_decode=False, steps=8, pad_token_id=0)
    reads = []
    op = attention.sparse_attention
    monkeypatch.setattr(attention, "sparse_attention", lambda *args, **kw: reads.append(
        (args[3] is None, kw.get("start") is not None)) or op(*args, **kw))  # fmt: skip
    tokens, steps, _ = _generate(model, ids, config, graph_decode=True, steps=8, pad_token_id=0)
    assert steps.get("fixed-shape") == 6 and torch.equal(tokens, eager)
    if method == "dense":  # every layer reads its buffer: the global ones whole, the sliding ones from a start
        assert set(reads) == {(True, False), (False, True)}


@pytest.mark.parametrize("method,budget", [("lsh", 0.05), ("twilight", 0.25)])
def test_dense_fallback_decodes_densely_below_its_threshold(real_model, prompt, method, budget):
    """A batch holding fewer cached tokens than `dense_below` takes the captured dense step alone: dense's tokens,
    every visible token counted as attended; the method's state (lsh's codes, the pruner's INT4 keys) takes the
    fallback's tokens when the generation ends, and the next decode step selects from a complete state."""
    from sparsekv.pruners.top_p import quantize_keys
    from sparsekv.selectors.lsh import hash_codes

    model, _ = real_model
    steps = 12
    dense, _, _ = _generate(model, prompt, SparseConfig(method="dense"), graph_decode=True, steps=steps)
    config = SparseConfig(method=method, budget=budget, dense_below=prompt.shape[1] + steps)
    fallback, paths, cache = _generate(model, prompt, config, graph_decode=True, steps=steps)
    assert torch.equal(fallback, dense)
    assert paths["fixed-shape (dense fallback)"] == steps - 2 and "fixed-shape" not in paths
    stats = cache.stats.summary()
    assert stats["avg_budget_tokens"] == pytest.approx(stats["avg_context_tokens"])
    assert stats["avg_context_tokens"] == pytest.approx(prompt.shape[1] + steps / 2)  # the mean step's keys
    # one more (eager) decode step: the selector's state covers every cached key
    with sparsekv.enabled(model, config, graph_decode=False):
        model(input_ids=fallback[:, -1:], **cache_kwargs(model, cache), use_cache=True)
    for layer in cache.layers:
        if layer.selector is not None:
            lsh = layer.selector.inner if method == "twilight" else layer.selector
            assert lsh.key_codes.length == layer.length
            assert torch.equal(lsh.key_codes.view(), hash_codes(layer.keys.float() - lsh.key_mean, lsh.projection))
            if method == "twilight":
                pruner = layer.selector.pruner
                assert pruner.length == layer.length
                assert torch.equal(pruner.quantized()[0], quantize_keys(layer.keys, pruner.bits)[0])
    # just at the threshold the method's own step runs
    at = SparseConfig(method=method, budget=budget, dense_below=prompt.shape[1])
    _, paths, _ = _generate(model, prompt, at, graph_decode=True, steps=steps)
    assert paths["fixed-shape"] == steps - 2


def test_dense_fallback_defaults_to_the_methods_crossover_on_cuda_only():
    config = SparseConfig(method="spotlight")
    from sparsekv.registry import get_method_class

    assert config.fallback_threshold("cpu") == 0
    assert config.fallback_threshold("cuda") == get_method_class("spotlight").dense_below
    assert SparseConfig(method="spotlight", dense_below=0).fallback_threshold("cuda") == 0
    for bad in (-1, 1.5, True, "32k"):
        with pytest.raises(ConfigError, match="dense_below"):
            SparseConfig(method="spotlight", dense_below=bad)
    assert SparseConfig(method="self-index").fallback_threshold("cuda") == get_method_class("self-index").dense_below


def test_self_index_dense_fallback_keeps_16_bit_kv_for_the_whole_generation(real_model, prompt):
    """Self-index keeps no 16-bit K/V, so its fallback is decided before the prompt is cached: below the threshold
    its layers keep 16-bit K/V and attend densely (dense's tokens and memory, every visible token counted in the
    stats, captured and eager); at the threshold the compressed cache decodes."""
    from sparsekv.cache import cache_memory

    model, tokenizer = real_model
    steps = 12
    dense, _, _ = _generate(model, prompt, SparseConfig(method="dense"), graph_decode=True, steps=steps)
    below = SparseConfig(method="self-index", budget=0.05, dense_below=prompt.shape[1] + 2)
    tokens, paths, cache = _generate(model, prompt, below, graph_decode=True, steps=steps)
    assert torch.equal(tokens, dense)
    assert paths["fixed-shape (dense fallback)"] == steps - 2 and "fixed-shape" not in paths
    fell_back = [layer for layer in cache.layers if layer.dense_from is not None]
    assert len(fell_back) == len(cache.layers) - len(below.dense_layers)
    assert all(layer.selector is None and layer.dense_from == prompt.shape[1] for layer in fell_back)
    assert cache_memory(cache)["compressed_layers"] == 0
    stats = cache.stats.summary()
    assert stats["avg_budget_tokens"] == pytest.approx(stats["avg_context_tokens"])
    assert stats["avg_context_tokens"] == pytest.approx(prompt.shape[1] + steps / 2)
    assert len(stats["per_layer_avg_tokens"]) == len(fell_back)
    # a chunked prefill: decided from the whole prompt's length at its first chunk, the same generation
    chunked, paths, cache = _generate(model, prompt, below, graph_decode=True, steps=steps, prefill_chunk_size=64)
    assert torch.equal(chunked, dense) and paths["fixed-shape (dense fallback)"] == steps - 2
    assert {layer.dense_from for layer in cache.layers} == {None, prompt.shape[1]}
    # eager steps (a padded batch): the same fallback, counted per step
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    text = tokenizer.decode(prompt[0])
    batch = tokenizer([text, text[: len(text) // 2]], return_tensors="pt", padding=True)
    padded = SparseConfig(method="self-index", budget=0.05, dense_below=10**9)
    with sparsekv.enabled(model, padded, graph_decode=True) as runtime:
        model.generate(**batch, max_new_tokens=4, do_sample=False)
        assert runtime.graph.steps.get("eager: the batch is padded") == 3
        cache = sparsekv.last_cache(model)
    assert all(layer.selector is None for layer in cache.layers)
    stats = cache.stats.summary()
    assert stats["avg_budget_tokens"] == pytest.approx(stats["avg_context_tokens"])
    assert len(stats["per_layer_avg_tokens"]) == len(cache.layers) - len(padded.dense_layers)
    # at the threshold: the compressed cache
    at = SparseConfig(method="self-index", budget=0.05, dense_below=prompt.shape[1] + 1)
    _, paths, cache = _generate(model, prompt, at, graph_decode=True, steps=steps)
    assert paths["fixed-shape"] == steps - 2
    assert cache_memory(cache)["compressed_layers"] == len(cache.layers) - len(at.dense_layers)


def test_self_index_dense_fallback_through_sparsekv_generate(real_model, prompt):
    """`sparsekv.generate` prefills before its decode steps go through the graphs: the fallback is decided before
    the prompt is cached there too (dense's tokens). A compressed prompt that is cached already cannot fall back
    (nothing at 16 bits to attend over): the method decodes with its own step."""
    model, tokenizer = real_model
    text = tokenizer.decode(prompt[0])
    below = SparseConfig(method="self-index", budget=0.05, dense_below=10**9)
    dense = sparsekv.generate(model, tokenizer, [text], SparseConfig(method="dense"), max_new_tokens=8)
    result = sparsekv.generate(model, tokenizer, [text], below, max_new_tokens=8, graph_decode=True)
    assert result.texts == dense.texts and result.decode_paths["fixed-shape (dense fallback)"] >= 1
    with sparsekv.enabled(model, below, graph_decode=False):
        model.generate(prompt, max_new_tokens=2, do_sample=False)
        cache = sparsekv.last_cache(model)
    cache.settle_fallback("cuda", 1, cache.layers[-1].length)
    assert cache.fallback_threshold == 0 and all(layer.dense_from is None for layer in cache.layers)
    assert sum(layer.selector is not None for layer in cache.layers) == len(cache.layers) - len(below.dense_layers)


def test_a_method_with_top_p_takes_the_fixed_shape_step(real_model, prompt):
    """`top_p` on a plain method adds the pruner to each sparse layer: its key copy and its pruning have a
    fixed-shape step too (dropped candidates become invalid entries instead of a compaction)."""
    model, _ = real_model
    config = SparseConfig(method="lsh", budget=0.25, top_p=0.9, local=4)
    eager, _, eager_cache = _generate(model, prompt, config, graph_decode=False, steps=16)
    fixed, paths, fixed_cache = _generate(model, prompt, config, graph_decode=True, steps=16)
    assert paths["fixed-shape"] == 14 and torch.equal(fixed, eager)
    kept, eager_kept = fixed_cache.stats.summary()["avg_budget_tokens"], eager_cache.stats.summary()["avg_budget_tokens"]
    assert kept == pytest.approx(eager_kept, rel=1e-3) and kept < 0.2 * prompt.shape[1]  # pruned below the candidates
    layer = next(layer for layer in fixed_cache.layers if layer.pruner is not None)
    assert layer.pruner.length == layer.length and not layer.pruner.fixed


def test_quest_page_level_fixed_step_gives_the_eager_tokens(real_model, prompt):
    """Without sink/local tokens quest's fixed-shape step picks pages (own page, best pages, the next one's most
    recent tokens) instead of ranking every token: the same tokens and budgets as the eager step."""
    model, _ = real_model
    config = SparseConfig(method="quest", budget=0.05, dense_below=0)
    eager, _, eager_cache = _generate(model, prompt, config, graph_decode=False, steps=24)
    fixed, paths, fixed_cache = _generate(model, prompt, config, graph_decode=True, steps=24)
    assert paths["fixed-shape"] == 22 and torch.equal(fixed, eager)
    kept, eager_kept = fixed_cache.stats.summary(), eager_cache.stats.summary()
    assert kept["avg_budget_tokens"] == pytest.approx(eager_kept["avg_budget_tokens"])


def test_methods_command_lists_each_methods_dense_fallback_and_decode_paths(monkeypatch):
    from typer.testing import CliRunner

    from sparsekv import cli
    from sparsekv.registry import get_method_class

    # rich's global console reads COLUMNS once, when a test before this one may have made it: its width directly
    monkeypatch.setattr(cli.console, "_width", 240)
    result = CliRunner().invoke(cli.app, ["methods"])
    assert result.exit_code == 0, result.output
    rows = {line.lstrip("│ ").split()[0]: line for line in result.output.splitlines() if line.startswith("│ ")}
    assert f"below {get_method_class('spotlight').dense_below:,} cached tokens" in rows["spotlight"]
    # the decode paths: captured lossless rounds for slot-state methods, eager ones otherwise, none where refused
    assert rows["streaming"].rstrip(" │").endswith("captured") and rows["quest"].rstrip(" │").endswith("eager")
    assert rows["h2o"].rstrip(" │").endswith("no") and rows["self-index"].split("│")[5].strip() == "eager"
