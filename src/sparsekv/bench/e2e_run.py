"""The timed run of `sparsekv bench e2e`: prefill (the model's own or a synthetic fill), decode steps (eager,
compiled, a CUDA graph), dense and the method on the same model; sparsekv.bench.e2e says what is measured."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from sparsekv.bench.e2e_measure import Clock, cache_bytes, free_memory, peak_above, profile_step, reset_peak
from sparsekv.bench.e2e_model import build_model, check_fits
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.graph_decode import compile_for_decode
from sparsekv.hf_compat import cache_kwargs

# ---------------------------------------------------------------------------------------------------------------
# prefill


def synthetic_fill(model, cache, batch: int, context: int, *, chunk: int = 8192, seed: int = 0) -> None:
    """Writes `context` random tokens of K/V into every layer as a prompt fed in chunks, each chunk handed to the
    layer with random queries as the attention function hands a prefill chunk (`prompt_chunk_attended`): the
    selectors build their state from the whole prompt, and a compressing one (self-index) stores a long prompt
    chunk by chunk, so that no layer ever holds the whole prompt in 16 bits. The K/V are `synthetic_kv`'s: the
    same values for the same seed whatever the method (the queries come from their own stream)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    queries = torch.Generator(device=device).manual_seed(seed + 1)
    fills = synthetic_kv(model, batch, context, chunk=chunk, seed=seed)
    for idx, (layer, info, chunks) in enumerate(zip(cache.layers, cache.infos, fills)):
        window = None if layer.selector is None else layer.selector.prompt_query_window()
        for k, v in chunks:
            length = k.shape[-2]
            keys, values = cache.update(k, v, idx)
            del k, v  # what the cache keeps of them, it holds itself
            if layer.selector is not None:
                # the chunk's last queries, as many as the selector reads (None: all): a model's prefill
                # activations, which are not to decide how many sequences fit
                queries_given = length if window is None else min(length, max(window, 1))
                shape = (batch, info.num_heads, queries_given, info.head_dim)
                q = torch.randn(shape, device=device, dtype=dtype, generator=queries)
                layer.prompt_chunk_attended(keys, values, q, None, layer.length == context)
            del keys, values


def synthetic_kv(model, batch: int, context: int, *, chunk: int = 8192, seed: int = 0):
    """Per layer, an iterator over the random K/V chunks [B, Hkv, <= chunk, d] of a `context`-token prompt (the
    model's dtype and device; one generator drawn layer by layer, chunk by chunk, keys before values)."""
    from sparsekv.cache import layer_infos

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator(device=device).manual_seed(seed)

    def chunks(info):
        for start in range(0, context, chunk):
            shape = (batch, info.num_kv_heads, min(chunk, context - start), info.head_dim)
            k = torch.randn(shape, device=device, dtype=dtype, generator=gen)
            yield k, torch.randn(shape, device=device, dtype=dtype, generator=gen)

    for info in layer_infos(model):
        yield chunks(info)


def synthetic_hf_cache(model, batch: int, context: int, *, chunk: int = 8192, seed: int = 0):
    """transformers' own DynamicCache holding `synthetic_fill`'s K/V (the same values for the same seed): what a
    Hugging Face row continues from when the prompt is not prefilled by the model."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for idx, chunks in enumerate(synthetic_kv(model, batch, context, chunk=chunk, seed=seed)):
        for k, v in chunks:
            cache.update(k, v, idx)
    return cache


def model_prefill(model, new_cache, config: SparseConfig, ids: torch.Tensor):
    """The method's own prefill (GemFilter filters first; the cache is sized for what is kept)
    -> (cache, tokens cached, last logits' argmax [B, 1])."""
    from sparsekv.registry import get_method_class

    mask = torch.ones_like(ids)
    ids, mask = get_method_class(config.method).filter_prompt(model, ids, mask, config)
    padded = not bool(mask.all())
    cache = new_cache(ids.shape[1])
    out = model(
        input_ids=ids,
        attention_mask=mask if padded else None,
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, ids.shape[1], out.logits[:, -1].argmax(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------------------------
# one configuration (dense or the method)


@dataclass
class Setup:
    batch: int
    context: int
    new_tokens: int
    warmup: int
    prefill: str  # "model" | "synthetic"
    cuda_graph: bool
    seed: int
    record_stats: bool = False  # budget stats come from the warm-up steps; timed steps skip the bookkeeping
    profile: bool = False
    compile: bool = False


def compiled_forward(model, backend: str = "inductor"):
    """The model's call through torch.compile (`graph_decode.compile_for_decode`), for decode steps. The whole
    module is compiled, not `model.forward`: its forward pre-hook (`sparsekv.enable`'s) attaches the cache that the
    attention reads."""
    return compile_for_decode(model, backend=backend)


def _decode_step(model, cache, compile: bool = False):
    forward = compiled_forward(model) if compile else model

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = forward(input_ids=tok, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def run_one(model, config: SparseConfig, setup: Setup) -> dict:
    from sparsekv.api import enabled
    from sparsekv.cache import SparseCache

    device = next(model.parameters()).device
    result: dict = {"method": config.method}
    free_memory(device)
    base = reset_peak(device)
    # with `compile` the model's graphs compile in the first step and once more when the cache length has
    # changed (then with a dynamic length)
    warmup = max(setup.warmup, 3 if setup.compile else 0)
    extra = warmup + setup.new_tokens + 8
    # model_prefill runs the method's own prompt filter (GemFilter) before the prefill
    with torch.inference_mode(), enabled(model, config, prompt_filtered=True):

        def new_cache(tokens: int) -> SparseCache:
            return SparseCache.for_model(model, config, initial_capacity=tokens + extra)

        gen = torch.Generator(device="cpu").manual_seed(setup.seed)
        vocab = model.config.vocab_size
        if setup.prefill == "model":
            ids = torch.randint(0, vocab, (setup.batch, setup.context), generator=gen).to(device)
            # untimed: the first forward in a process pays one-time costs (library handles, kernel compilation);
            # 2048 tokens are enough for GemFilter to filter
            model_prefill(model, new_cache, config, ids[:, : min(setup.context, 2048)])
            free_memory(device)
            base = reset_peak(device)
        with Clock(device) as clock:
            if setup.prefill == "model":
                cache, cached, tok = model_prefill(model, new_cache, config, ids)
                del ids
            else:
                cache = new_cache(setup.context)
                synthetic_fill(model, cache, setup.batch, setup.context, seed=setup.seed)
                cached = setup.context
                tok = torch.randint(0, vocab, (setup.batch, 1), generator=gen).to(device)
        result["prefill_s"] = clock.seconds
        result["prefill_mode"] = setup.prefill
        result["prefill_peak_bytes"] = peak_above(device, base)
        result["cached_tokens"] = cached
        step = _decode_step(model, cache, setup.compile)
        pos = torch.full((setup.batch, 1), cached, dtype=torch.long, device=device)
        reset_peak(device)
        for _ in range(warmup):  # compiles kernels, grows selector buffers once, records the budgets
            tok = step(tok, pos)
            pos = pos + 1
        cache.record_stats = setup.record_stats
        with Clock(device) as clock:
            for _ in range(setup.new_tokens):
                tok = step(tok, pos)
                pos = pos + 1
        tpot = clock.seconds / setup.new_tokens
        result.update(tpot_ms=1e3 * tpot, tokens_per_s=setup.batch / tpot)
        result["decode_peak_bytes"] = peak_above(
            device, base
        )  # cache included (base = weights and leftovers)
        result["cache_bytes"] = cache_bytes(cache)
        result["context_at_end"] = int(cache.layers[0].length) if cache.layers[0].length else None
        stats = cache.stats.summary()
        result["avg_budget_tokens"] = stats["avg_budget_tokens"]
        result["avg_budget_fraction"] = stats["avg_budget_fraction"]
        if setup.cuda_graph and device.type == "cuda":
            result.update(_graph_tpot(step, tok, pos, setup))
        if setup.profile and device.type == "cuda":
            result["profile"] = profile_step(step, tok, pos)
        del cache, step, tok, pos
    free_memory(device)
    return result


def _graph_tpot(step, tok: torch.Tensor, pos: torch.Tensor, setup: Setup, replays: int | None = None) -> dict:
    """Captures one decode step in a CUDA graph and times its replays (see the module docstring)."""
    replays = replays or max(setup.new_tokens, 10)
    static_tok, static_pos = tok.clone(), pos.clone()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = step(static_tok, static_pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(static_tok, static_pos)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        tpot = start.elapsed_time(end) / 1e3 / replays
        del graph, out
        return {"tpot_graph_ms": 1e3 * tpot, "tokens_per_s_graph": setup.batch / tpot, "graph_error": None}
    except Exception as error:  # noqa: BLE001 - a step that cannot be captured is reported, not fatal
        torch.cuda.synchronize()
        return {
            "tpot_graph_ms": None,
            "tokens_per_s_graph": None,
            "graph_error": f"{type(error).__name__}: {error}"[:300],
        }


def _ratio(a, b):
    return a / b if a is not None and b else None


def run_e2e(
    model: str = "llama3-8b-random",
    *,
    layers: int | None = None,
    context: int = 32768,
    batch: int = 1,
    method: str = "spotlight",
    budget: float = 0.02,
    top_p: float | None = None,
    new_tokens: int = 32,
    warmup: int = 3,
    cuda_graph: bool = False,
    prefill: str = "auto",
    dense_layers: tuple[int, ...] = (),
    options: dict | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    model_obj=None,
    profile: bool = False,
    compile: bool = False,
) -> dict:
    """Dense and `method` on the same model and inputs; see the module docstring. Returns a JSON-able dict.
    `compile`: decode steps (of both) run through `compiled_forward`."""
    for what, value, least in (("context", context, 1), ("batch", batch, 1), ("new_tokens", new_tokens, 1),
                               ("warmup", warmup, 0), ("layers", 1 if layers is None else layers, 1)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{what} must be >= {least}, got {value}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if prefill == "auto":
        # a real prefill where it is cheap; GemFilter is a prefill method and always runs its own
        prefill = "model" if method == "gemfilter" or batch * context <= 32768 else "synthetic"
    if prefill not in ("model", "synthetic"):
        raise ConfigError(f"prefill must be auto, model or synthetic, got {prefill!r}")
    if method == "gemfilter" and prefill != "model":
        raise ConfigError("gemfilter filters the prompt: it needs --prefill model")
    dense_cfg = SparseConfig(method="dense")
    method_cfg = SparseConfig(
        method=method, budget=budget, top_p=top_p, dense_layers=dense_layers, options=options or {}
    )
    if model_obj is None:
        check_fits(model, layers=layers, dtype=dtype, device=dev, batch=batch, context=context)
    net = (
        model_obj
        if model_obj is not None
        else build_model(model, layers=layers, dtype=dtype, device=dev, seed=seed)
    )
    num_layers = net.config.num_hidden_layers
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    setup = Setup(batch, context, new_tokens, warmup, prefill, cuda_graph, seed, profile=profile,
                  compile=compile)  # fmt: skip
    runs = {"dense": run_one(net, dense_cfg, setup), "method": run_one(net, method_cfg, setup)}
    d, m = runs["dense"], runs["method"]
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "model": model,
        "layers": num_layers,
        "dtype": str(dtype).replace("torch.", ""),
        "weights_bytes": weights,
        "context": context,
        "batch": batch,
        "method": method,
        "budget": budget,
        "top_p": top_p,
        "dense_layers": list(dense_layers),
        "options": options or {},
        "new_tokens": new_tokens,
        "prefill": prefill,
        "cuda_graph": cuda_graph,
        "compile": compile,
        "runs": runs,
        "ratios": {
            "tpot_speedup": _ratio(d["tpot_ms"], m["tpot_ms"]),
            "tpot_speedup_graph": _ratio(d.get("tpot_graph_ms"), m.get("tpot_graph_ms")),
            "prefill_speedup": _ratio(d["prefill_s"], m["prefill_s"]),
            "prefill_peak_ratio": _ratio(m["prefill_peak_bytes"], d["prefill_peak_bytes"]),
            "decode_peak_ratio": _ratio(m["decode_peak_bytes"], d["decode_peak_bytes"]),
            "cache_bytes_ratio": _ratio(m["cache_bytes"], d["cache_bytes"]),
        },
    }


def summary_rows(result: dict) -> list[tuple[str, str, str, str]]:
    """(quantity, dense, method, ratio) rows for a printed table."""

    def f(v, scale=1.0, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v * scale)

    d, m, r = result["runs"]["dense"], result["runs"]["method"], result["ratios"]
    gib = 1 / 2**30
    return [
        ("prefill s", f(d["prefill_s"], fmt="{:.3f}"), f(m["prefill_s"], fmt="{:.3f}"), f(r["prefill_speedup"], fmt="{:.2f}x")),
        ("prefill peak GiB", f(d["prefill_peak_bytes"], gib), f(m["prefill_peak_bytes"], gib), f(r["prefill_peak_ratio"])),
        ("TPOT ms", f(d["tpot_ms"], fmt="{:.3f}"), f(m["tpot_ms"], fmt="{:.3f}"), f(r["tpot_speedup"], fmt="{:.2f}x")),
        ("TPOT ms (CUDA graph)", f(d.get("tpot_graph_ms"), fmt="{:.3f}"), f(m.get("tpot_graph_ms"), fmt="{:.3f}"),
         f(r["tpot_speedup_graph"], fmt="{:.2f}x")),
        ("tokens/s", f(d["tokens_per_s"], fmt="{:.0f}"), f(m["tokens_per_s"], fmt="{:.0f}"), ""),
        ("decode peak GiB", f(d["decode_peak_bytes"], gib), f(m["decode_peak_bytes"], gib), f(r["decode_peak_ratio"])),
        ("cache GiB", f(d["cache_bytes"], gib, "{:.3f}"), f(m["cache_bytes"], gib, "{:.3f}"), f(r["cache_bytes_ratio"], fmt="{:.3f}")),
    ]  # fmt: skip
