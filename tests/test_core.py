"""The core pipeline on the real embedded model, the public API and the config errors."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch

import sparsekv
from sparsekv import ConfigError, SparseCache, SparseConfig
from sparsekv.hf_compat import cache_kwargs
from sparsekv.models import chat_prompt
from tests.helpers import run_chunks

PROMPT = "Write one sentence about the ocean."


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "nope"}, "known methods: "),
        ({"method": "oracle-topk", "budget": 0}, "budget must be > 0"),
        ({"method": "oracle-topk", "budget": -3}, "budget must be > 0"),
        ({"method": "oracle-topk", "budget": -0.5}, "budget must be > 0"),
        ({"method": "oracle-topk", "budget": 1.0}, "fractional budget must be < 1"),
        ({"method": "oracle-topk", "budget": 2.5}, "fractional budget must be < 1"),
        ({"method": "oracle-topk", "budget": "10"}, "budget must be an int"),
        ({"method": "oracle-topk", "top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"method": "oracle-topk", "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"method": "oracle-topp"}, "oracle-topp needs top_p"),
        ({"method": "oracle-topk", "gqa": "mean"}, "gqa must be one of"),
        ({"method": "oracle-topk", "sink": -1}, "sink must be an int >= 0"),
        ({"method": "oracle-topk", "budget": 8, "sink": 4, "local": 8}, "exceed the budget"),
        ({"method": "oracle-topk", "dense_layers": (-1,)}, "dense_layers must be"),
        ({"method": "streaming", "options": {"bogus": 1}}, "has no option(s) ['bogus']"),
    ],
)
def test_invalid_config_raises_one_clear_error(kwargs, message):
    with pytest.raises(ConfigError) as error:
        SparseConfig(**kwargs)
    assert message in str(error.value)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ConfigError, match="oracle-topk") as error:
        SparseConfig(method="quset")
    assert "dense" in str(error.value)


def test_dense_layer_out_of_range_is_checked_against_the_model(real_model):
    model, _ = real_model
    with pytest.raises(ConfigError, match=r"dense layer\(s\) \[30\] out of range: the model has 30 layers"):
        sparsekv.enable(model, SparseConfig(method="oracle-topk", dense_layers=(0, 30)))
    assert model.config._attn_implementation == "sdpa"


def test_fraction_budget_rounds_up_and_caps():
    config = SparseConfig(method="oracle-topk", budget=0.1)
    assert [config.tokens_for(n) for n in (1, 9, 10, 11, 1000)] == [1, 1, 1, 2, 100]
    assert SparseConfig(method="oracle-topk", budget=64).tokens_for(20) == 20


# ---------------------------------------------------------------- the real model


def real_ids(tokenizer, text: str, length: int) -> torch.Tensor:
    from sparsekv.assets import haystack_text

    ids = tokenizer(text + haystack_text()[:20000], return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length
    return ids


@pytest.mark.parametrize("method", sparsekv.available_methods())
def test_budget_covering_context_reproduces_dense_logits_on_real_model(real_model, method):
    from sparsekv.registry import get_method_class

    if getattr(get_method_class(method), "lossy", False):
        pytest.skip(f"{method} stores a lossy cache")
    model, tokenizer = real_model
    if get_method_class(method).rewrites_prompt:  # runs only where the prompt is filtered first
        with pytest.raises(ConfigError, match=r"model\.generate\(\) cannot do: use sparsekv\.generate"):
            sparsekv.enable(model, SparseConfig(method=method))
        return
    ids = real_ids(tokenizer, "", 160)
    dense, _ = run_chunks(model, SparseConfig(method="dense"), ids, 128, chunk=16)
    exact = {"top_p": 1.0} if get_method_class(method).consumes_top_p else {}
    config = SparseConfig(method=method, budget=100_000, **exact)
    sparse, recorder = run_chunks(model, config, ids, 128, chunk=16)
    if not get_method_class(method).dense:
        assert recorder.calls
    torch.testing.assert_close(sparse, dense, rtol=0, atol=2e-4)


def test_oracle_topk_generous_budget_gives_the_dense_answer(real_model):
    model, tokenizer = real_model
    prompt = chat_prompt(tokenizer, "What is the capital of France? Answer in one word.")
    dense = sparsekv.generate(model, tokenizer, prompt, SparseConfig(method="dense"), max_new_tokens=12)
    sparse = sparsekv.generate(model, tokenizer, prompt, SparseConfig(method="oracle-topk", budget=0.5),
                               max_new_tokens=12)
    assert "Paris" in dense.texts[0]
    assert sparse.texts == dense.texts
    assert sparse.avg_budget_tokens < sparse.avg_context_tokens


def test_sparse_selection_changes_the_output_when_the_budget_is_tiny(real_model):
    """Guards against a pipeline that silently stays dense."""
    model, tokenizer = real_model
    ids = real_ids(tokenizer, "", 200)
    dense, _ = run_chunks(model, SparseConfig(method="dense"), ids, 100, chunk=50)
    sparse, recorder = run_chunks(model, SparseConfig(method="oracle-topk", budget=4), ids, 100, chunk=50)
    assert (sparse - dense).abs().max() > 1e-2
    assert all(int(counts.max()) <= 4 for *_, counts in recorder.calls)


def test_batch_of_different_lengths_equals_each_prompt_alone(real_model):
    model, tokenizer = real_model
    prompts = [chat_prompt(tokenizer, "Name three colours of the rainbow."),
               chat_prompt(tokenizer, "Tell me a fact about the moon and about the sun, briefly please.")]
    config = SparseConfig(method="oracle-topk", budget=0.3)
    batched = sparsekv.generate(model, tokenizer, prompts, config, max_new_tokens=10)
    alone = [sparsekv.generate(model, tokenizer, p, config, max_new_tokens=10) for p in prompts]
    assert batched.new_token_ids == [a.new_token_ids[0] for a in alone]


def test_chunked_decode_equals_token_by_token_on_real_model(real_model_fp64):
    model, tokenizer = real_model_fp64
    ids = real_ids(tokenizer, "", 96)
    config = SparseConfig(method="oracle-topk", budget=0.2, sink=2, local=4)
    chunked, rec_chunked = run_chunks(model, config, ids, 64, chunk=32)
    stepped, rec_stepped = run_chunks(model, config, ids, 64, chunk=1)
    torch.testing.assert_close(chunked, stepped, rtol=0, atol=1e-8)
    for layer, ((mask, _, _),) in rec_chunked.per_layer().items():
        steps = [torch.nn.functional.pad(m, (0, 96 - m.shape[-1])) for m, _, _ in rec_stepped.per_layer()[layer]]
        assert torch.equal(mask, torch.cat(steps, dim=2))


def test_plain_generate_uses_a_sparse_cache_and_disable_restores(real_model):
    model, tokenizer = real_model
    ids = tokenizer(chat_prompt(tokenizer, PROMPT), return_tensors="pt").input_ids
    reference = model.generate(ids, max_new_tokens=6, do_sample=False)
    sparsekv.enable(model, SparseConfig(method="oracle-topk", budget=0.1))
    try:
        assert "generate" in vars(model)  # the instance's generate learns the prompt length; the class is untouched
        assert type(model).generate is not vars(model)["generate"]
        sparse = model.generate(ids, max_new_tokens=6, do_sample=False)
        cache = sparsekv.last_cache(model)
        assert isinstance(cache, SparseCache)
        stats = cache.stats.summary()
        assert stats["avg_budget_tokens"] < stats["avg_context_tokens"]
        assert sorted(stats["per_layer_avg_tokens"]) == list(range(2, 30))
    finally:
        sparsekv.disable(model)
    assert model.config._attn_implementation == "sdpa"
    assert "generate" not in vars(model)
    assert sparse.shape == reference.shape
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), reference)


@pytest.fixture
def transformers_log():
    """What transformers logs during a test (its loggers do not propagate to pytest's caplog)."""
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield stream
    logger.removeHandler(handler)


@pytest.mark.parametrize("method", ["oracle-topk", "lsh"])
def test_generate_on_a_1k_prompt_decodes_sparsely_without_deprecations(real_model, method, transformers_log):
    import warnings

    model, tokenizer = real_model
    ids = real_ids(tokenizer, "", 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with sparsekv.enabled(model, SparseConfig(method=method, budget=0.05)):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
            summary = sparsekv.last_cache(model).stats.summary()
    assert summary["avg_budget_fraction"] < 0.5
    assert summary["avg_context_tokens"] > 1024
    assert "ignoring" not in transformers_log.getvalue() and "deprecated" not in transformers_log.getvalue()


def test_a_model_that_bypasses_the_sparse_cache_is_an_error(real_model):
    """What a transformers release that ignores the cache handed to the model would do: never a silent dense
    decode."""
    from transformers import DynamicCache

    from sparsekv.attention import CacheBypassedError
    from sparsekv.hf_compat import cache_argument

    model, tokenizer = real_model
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    name = cache_argument(model)

    def swap_for_a_dynamic_cache(_module, args, kwargs):
        kwargs[name] = DynamicCache(config=model.config)
        return args, kwargs

    with sparsekv.enabled(model, SparseConfig(method="oracle-topk")):
        hook = model.register_forward_pre_hook(swap_for_a_dynamic_cache, with_kwargs=True)  # runs after ours
        try:
            with pytest.raises(CacheBypassedError, match="not the SparseCache"):
                model.generate(ids, max_new_tokens=2, do_sample=False)
        finally:
            hook.remove()


@pytest.mark.parametrize("version, supported", [("5.17.0", True), ("5.24.0", True), ("5.24.3", True),
                                                ("5.16.1", False), ("5.25.0", False), ("6.0.0", False)])
def test_transformers_outside_the_tested_range_is_refused(version, supported, monkeypatch):
    from sparsekv.hf_compat import ALLOW_UNTESTED_ENV, check_transformers_version

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    if supported:
        check_transformers_version(version)
        return
    with pytest.raises(ConfigError, match=r"supports transformers 5\.17\.0 to 5\.24\.x"):
        check_transformers_version(version)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_transformers_version(version)


def test_installed_transformers_is_within_the_pin():
    """pyproject's pin and the tested range say the same."""
    import re
    import tomllib
    from pathlib import Path

    from sparsekv.hf_compat import TESTED_TRANSFORMERS

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("transformers"))
    low, high = TESTED_TRANSFORMERS
    major, minor = (int(x) for x in high.split(".")[:2])
    assert re.sub(r"\s", "", pin) == f"transformers>={low},<{major}.{minor + 1}"


def test_bfloat16_on_cpu(real_model):
    import copy

    model, tokenizer = real_model
    model = copy.deepcopy(model).to(torch.bfloat16)
    result = sparsekv.generate(model, tokenizer, chat_prompt(tokenizer, PROMPT),
                               SparseConfig(method="oracle-topk", budget=0.2), max_new_tokens=5)
    assert result.new_tokens == 5 and result.texts[0].strip()


def test_non_empty_foreign_cache_is_rejected(real_model):
    from transformers import DynamicCache

    model, tokenizer = real_model
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(model, cache), use_cache=True)
    with sparsekv.enabled(model, SparseConfig(method="oracle-topk")), pytest.raises(ConfigError, match="non-empty"):
        model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-llama-mha",
                                   "tiny-gemma3", "tiny-phi3"])
def test_other_architectures_decode_sparsely(shape):
    from sparsekv.models import random_model

    model = random_model(shape, dtype=torch.float32, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    config = SparseConfig(method="oracle-topk", budget=0.25, dense_layers=(0,))
    dense = model.generate(ids, max_new_tokens=4, do_sample=False)
    with sparsekv.enabled(model, config):
        sparse = model.generate(ids, max_new_tokens=4, do_sample=False)
        summary = sparsekv.last_cache(model).stats.summary()
    assert summary["avg_budget_tokens"] < summary["avg_context_tokens"]
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    globally = [i for i, kind in enumerate(layer_types) if kind == "full_attention" and i != 0]
    assert sorted(summary["per_layer_avg_tokens"]) == globally  # sliding-window layers keep their window
    assert sparse.shape == dense.shape


def test_a_config_that_selects_in_no_layer_is_refused():
    from sparsekv.models import random_model

    model = random_model("tiny-gemma3", dtype=torch.float32, seed=0)  # global layers: 2 and 5
    with pytest.raises(ConfigError, match="select in no layer"):
        sparsekv.enable(model, SparseConfig(method="lsh", dense_layers=(2, 5)))


@pytest.mark.parametrize("padded", [False, True])
def test_sliding_layers_attend_over_their_windows_keys_only_with_the_whole_masks_result(monkeypatch, padded):
    """A sliding-window layer's forward with a mask (a prompt chunk after the first, a padded batch's step) runs
    SDPA over the keys from its earliest query's window on: every step's logits are plain transformers' (float64,
    dense decoding), and no sliding layer reads more than a chunk and a window of keys."""
    from sparsekv import attention
    from sparsekv.models import random_model

    model = random_model("tiny-gemma3", dtype=torch.float64, seed=0)  # window 16; global layers 2 and 5
    ids = torch.randint(3, model.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
              "prefill_chunk_size": 8, "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    plain = model.generate(ids, **kwargs)
    read = []
    sdpa = attention.sdpa_attention_forward

    def counting(module, query, key, *args, **kw):
        if model.config.layer_types[module.layer_idx] == "sliding_attention":
            read.append(key.shape[2])
        return sdpa(module, query, key, *args, **kw)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counting)
    with sparsekv.enabled(model, SparseConfig(method="dense"), graph_decode=False):
        out = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    for ours, theirs in zip(out.logits, plain.logits, strict=True):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-10)
    assert max(read) <= 8 + 16 - 1 and len(read) >= 4 * 60 // 8


# ---------------------------------------------------------------- CLI


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsekv.cli", *args], check=False, capture_output=True, text=True,
                          timeout=timeout)


def cli_in_process(monkeypatch, *args: str) -> tuple[int, str]:
    """`sparsekv <args>` through the command's entry point (`sparsekv.cli.main`) in this process, without the
    start-up of a new one (`run_cli` runs the command itself): its exit status and its output, with whitespace
    folded (rich wraps long lines to the terminal's width). An exception main() lets through fails the test."""
    from sparsekv.cli import main

    monkeypatch.setattr(sys, "argv", ["sparsekv", *args])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main()
            status = 0
        except SystemExit as exit_:
            status = exit_.code
    return status, " ".join(out.getvalue().split())


def test_cli_generate_writes_json(tmp_path, real_model):
    out = tmp_path / "out.json"
    result = run_cli("generate", "--prompt", "What is the capital of France?", "--method", "oracle-topk",
                     "--budget", "0.5", "--max-new-tokens", "8", "--output", str(out))
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert "Paris" in payload["text"]
    assert payload["method"] == "oracle-topk"
    assert 0 < payload["avg_budget_tokens"] < payload["avg_context_tokens"]
    assert "tokens/s" in result.stdout


def test_cli_demo_compares_answers_and_cache_bytes(tmp_path, real_model):
    """The README's first command: dense vs self-index on a needle prompt; the compressed cache holds a fraction
    of the dense one (2 of 30 layers stay dense at float32)."""
    out = tmp_path / "demo.json"
    result = run_cli("demo", "--context", "400", "--max-new-tokens", "6", "--output", str(out))
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert set(payload) == {"dense", "self-index"}
    assert 0 < payload["self-index"]["cache_bytes"] < 0.4 * payload["dense"]["cache_bytes"]
    assert "KV cache" in result.stdout and ("same answer" in result.stdout or "answers differ" in result.stdout)
    assert "deprecat" not in (result.stdout + result.stderr).lower()


def test_cache_memory_counts_buffer_capacity_or_only_the_tokens_held(real_model):
    from sparsekv.cache import cache_memory

    model, _ = real_model
    config = SparseConfig(method="dense")
    cache = SparseCache.for_model(model, config)
    ids = torch.arange(100, 400)[None]
    with torch.inference_mode(), sparsekv.enabled(model, config):
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
        model(input_ids=ids[:, :1], **cache_kwargs(model, cache), use_cache=True)  # 301 tokens: the buffers double
    cfg = model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert cache_memory(cache, capacity=False)["bytes_total"] == 301 * per_token
    assert cache_memory(cache)["bytes_total"] == 600 * per_token


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--budget", "1.5"], "fractional budget must be < 1"),
        (["--budget", "abc"], "budget must be an int"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--dense-layers", "0,99"], "out of range"),
        (["--model", "/no/such/model/dir"], "/no/such/model/dir"),
        (["--compile-step"], "--compile-step compiles the decode step that CUDA graphs capture"),
    ],
)
def test_cli_bad_input_is_one_line(monkeypatch, args, message):
    status, output = cli_in_process(monkeypatch, "generate", "--prompt", "hi", "--max-new-tokens", "1", *args)
    assert status == 2 and message in output, output
    assert output.count("error: ") == 1 and "Traceback" not in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--no-such-option"], "No such option"),  # typer's own usage errors: no traceback either
        (["bench", "attention", "--context", "0"], "context must be >= 1"),
        (["bench", "attention", "--method", "nope"], "method must be one of lsh, spotlight"),
        (["bench", "kernels", "--shape", "nope"], "unknown shape 'nope'"),
        (["bench", "kernels", "--budget", "2.5"], "whole number"),
    ],
)
def test_cli_bad_command_line_is_one_line(monkeypatch, args, message):
    status, output = cli_in_process(monkeypatch, *args)
    assert status == 2 and message in output, output
    assert "Traceback" not in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs")
def test_cli_bench_without_a_gpu_says_so(monkeypatch):
    status, output = cli_in_process(monkeypatch, "bench", "attention")
    assert status == 2 and "need a CUDA GPU" in output, output
    assert "Traceback" not in output


# ---------------------------------------------------------------- shared mechanics


def test_selection_mask_padding_never_clears_a_kept_index():
    from sparsekv.step import Selection

    indices = torch.tensor([[3, 3, 1, 1]])
    valid = torch.tensor([[True, False, False, True]])
    assert Selection(indices, valid).to_mask(5).tolist() == [[False, True, False, True, False]]


def test_top_p_threshold_keeps_mass_when_a_midpoint_hits_a_weight():
    from sparsekv.kernels.top_p import top_p_threshold_reference

    weights = torch.tensor([[0.5, 0.25, 0.25]])  # the first midpoint is exactly 0.25
    keep = top_p_threshold_reference(weights, torch.ones_like(weights, dtype=torch.bool), 0.75)
    assert float(weights[keep].sum()) >= 0.75


def test_a_prompt_past_the_trained_context_is_refused_unless_asked(real_model):
    model, tokenizer = real_model
    trained = model.config.max_position_embeddings
    config = SparseConfig(method="streaming", budget=64)
    prompt = "word " * (trained - 2)
    with pytest.raises(ConfigError, match=f"trained context of {trained} tokens"):
        sparsekv.generate(model, tokenizer, prompt, config, max_new_tokens=8)
    short = sparsekv.generate(model, tokenizer, "word " * 50, config, max_new_tokens=2, allow_longer_context=True)
    assert short.new_tokens == 2


def test_loading_on_cuda_without_a_gpu_says_so():
    from sparsekv.models import ModelLoadError, load_model

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        load_model("default", device="cuda")


def test_budget_means_the_same_for_every_method():
    """Left unset, each method's own default; set, gemfilter keeps that many prompt tokens (its keep option)."""
    from sparsekv.registry import get_method_class

    assert SparseConfig(method="twilight").budget == get_method_class("twilight").default_budget == 0.25
    assert SparseConfig(method="gemfilter").options == {}
    assert SparseConfig(method="gemfilter", budget=256).options == {"keep": 256}
    assert SparseConfig(method="gemfilter", budget=256, options={"keep": 256}).options == {"keep": 256}
    with pytest.raises(ConfigError, match="budget is its keep option"):
        SparseConfig(method="gemfilter", budget=256, options={"keep": 128})
