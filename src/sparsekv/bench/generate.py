"""`sparsekv bench generate`: decode speed where users decode — `model.generate()` — side by side in one process.

The same random prompts through, in turn:

- `hf-dense`: plain `model.generate()` (transformers' DynamicCache, SDPA);
- `hf-static-compile`: `model.generate(cache_implementation="static")`, which transformers compiles on CUDA;
- each method: `model.generate()` under `sparsekv.enabled(model, SparseConfig(method, budget))`, whose decode steps
  replay one CUDA graph where the method has a fixed-shape step (`sparsekv.graph_decode`); `dense` is sparsekv's
  own captured dense step. A row `<method>@eager` runs the same with `graph_decode=False`, a row `<method>@compile`
  with `compile_step=True` (the step's forward compiled by torch.compile before it is captured); a row
  `<method>...:<budget>` runs at its own budget (e.g. `twilight@compile:0.25`: top-p over 25% candidates); a row
  `<method>@lossless` decodes losslessly (`enabled(..., lossless=True)`: sparse steps draft, a dense forward
  verifies, the output is dense's; the number of drafts chosen round by round), with its acceptance rate, tokens
  per verification, drafts per round and the timed draft step and verification; `<method>@lossless-compile` the
  same with `compile_step=True` (its rounds' steps compiled; a first, untimed generation compiles them).

`--model embedded` is the embedded model with its real weights (SmolLM2-135M-Instruct) on windows of the embedded
essays, one window per row (lossless decoding's acceptance depends on real weights and text); `--model
gemma3-270m` the same with the Gemma 3 270M asset (32K context, sliding-window and global layers); the other models
have random weights and random prompts.

Every row uses the same `prefill_chunk_size` (transformers' chunked prefill: a one-shot prefill of a long batch does
not fit the GPU). The time of each generated token is taken by a streamer (transformers hands it each token as
it is produced); TPOT is the mean over the steps after `warmup` (the first steps compile kernels and graphs), so
the prefill is not in it. `step_ms` is the captured step replayed alone once the last token is out (CUDA): TPOT
over it is what generate()'s own loop adds to each step. Peak memory and, for the methods, the tokens attended
per step (from the cache's stats) are reported beside it, and how the decode steps ran (`decode_paths`: CUDA graph
replays, or eager and why). With `profile_step`, ten more replays of the captured step run under torch.profiler:
its kernels per step, their time and the heaviest ones (`step_profile`), to see where a step's time goes.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from collections.abc import Callable

import torch

from sparsekv.bench.e2e_run import synthetic_fill, synthetic_hf_cache
from sparsekv.cache import SparseCache
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.hf_compat import cache_kwargs
from sparsekv.lossless import check_lossless

HF_ROWS = ("hf-dense", "hf-static-compile")
#: how a row's prompt gets into its cache: the model's own prefill, or K/V written directly (`time_generate`)
PREFILLS = ("model", "synthetic")
DEFAULT_METHODS = ("dense", "spotlight", "lsh", "quest", "twilight", "double-sparsity", "self-index")
EAGER_SUFFIX = "@eager"
COMPILE_SUFFIX = "@compile"
LOSSLESS_SUFFIX = "@lossless"
LOSSLESS_COMPILE_SUFFIX = "@lossless-compile"
#: a lossless row's profiled round comes after that many timed ones (`DraftCounts.profile_after`)
PROFILED_ROUND_AFTER = 2
#: `--model` names with real weights (-> `models.load_model`'s name), prompts from the embedded essays
REAL_MODELS = {"embedded": "default", "gemma3-270m": "gemma3-270m"}


def parse_row(row: str) -> tuple[str, str, float | None]:
    """"<method>[@eager|@compile|@lossless|@lossless-compile][:budget]" -> (method, the suffix or "", budget or
    None)."""
    name, _, budget = row.partition(":")
    try:
        own_budget = float(budget) if budget else None
    except ValueError:
        raise ConfigError(f"row {row!r}: the budget after ':' must be a number, e.g. twilight@compile:0.25") from None
    for suffix in (EAGER_SUFFIX, COMPILE_SUFFIX, LOSSLESS_SUFFIX, LOSSLESS_COMPILE_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix, own_budget
    return name, "", own_budget


def method_of(row: str) -> str:
    return parse_row(row)[0]


def keeps_dense_cache(row: str) -> bool:
    """Whether a row's run holds a dense-size KV cache: the HF rows, every method that keeps 16-bit K/V, and
    lossless rows (16-bit K/V beside a method's own storage). Only a compressed cache's rows (`stores_kv`) do not
    (`generate` then checks the weights alone before it builds the model; a row that does not fit reports out of
    memory)."""
    from sparsekv.registry import get_method_class

    if row in HF_ROWS or parse_row(row)[1] in (LOSSLESS_SUFFIX, LOSSLESS_COMPILE_SUFFIX):
        return True
    return not get_method_class(method_of(row)).stores_kv


class _TokenClock:
    """A transformers streamer that records when each token reaches the host (the first `put` is the prompt).

    at_last: called once the last of `puts` tokens has reached the host, while generate() still holds its cache."""

    def __init__(self, device: torch.device, puts: int | None = None, at_last=None) -> None:
        self.device = device
        self.times: list[float] = []
        self.puts, self.at_last = puts, at_last

    def put(self, _tokens) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        if self.at_last is not None and len(self.times) == self.puts:
            self.at_last()

    def end(self) -> None:
        pass


def replay_ms(graph_decode, device: torch.device, replays: int = 20) -> float | None:
    """Milliseconds per replay of the captured decode step alone (no generate() loop around it), or None where
    no graph was captured. Each replay repeats the last step: it rewrites that step's token in its slot with the
    same values (the cache is unchanged) and adds the same counts to the stats once more (their means stay)."""
    graph = graph_decode.graph
    if graph is None or device.type != "cuda":
        return None
    graph.replay()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start) / replays


def profile_replays(graph_decode, device: torch.device, top: int, replays: int = 10) -> dict | None:
    """The captured decode step's kernels over `replays` replays under torch.profiler (`kernel_profile`), or None
    where no graph was captured."""
    graph = graph_decode.graph
    if graph is None or device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize(device)
    return kernel_profile(prof.key_averages(), replays, top)


def kernel_profile(events, replays: int, top: int) -> dict:
    """Profiler averages (each with `key`, `count`, `self_device_time_total` in µs) of `replays` replays -> kernels
    per step, their summed time per step and the `top` heaviest (name, µs and launches per step). Kernels launched
    early (programmatic dependent launch) count the time they wait for the kernel before them, so the sum can
    exceed the step's time."""
    kernels = [e for e in events if e.self_device_time_total > 0]
    heaviest = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {
        "replays": replays,
        "kernels_per_step": sum(e.count for e in kernels) / replays,
        "kernel_us_per_step": sum(e.self_device_time_total for e in kernels) / replays,
        "top": [
            {"kernel": e.key, "us_per_step": e.self_device_time_total / replays, "launches_per_step": e.count / replays}
            for e in heaviest
        ],
    }


def config_for(row: str, budget: float, top_p: float | None, dense_below: int | None = None,
               dense_layers: tuple[int, ...] | None = None, options: dict | None = None) -> SparseConfig | None:  # fmt: skip
    """The row's SparseConfig (None for the HF rows). dense_layers: the layers a method keeps dense (None: the
    config's default, layers 0 and 1). options: the row's method options (`registry.options_by_method`)."""
    if row in HF_ROWS:
        return None
    method, _, own_budget = parse_row(row)
    if method == "dense":
        return SparseConfig(method=method)
    budget = own_budget if own_budget is not None else budget
    layers = {} if dense_layers is None else {"dense_layers": tuple(dense_layers)}
    return SparseConfig(method=method, budget=budget, top_p=top_p, dense_below=dense_below, options=options or {},
                        **layers)  # fmt: skip


def time_generate(model, ids: torch.Tensor, row: str, *, budget: float, top_p: float | None, new_tokens: int,
                  warmup: int, prefill_chunk_size: int | None, dense_below: int | None = None,
                  prefill: str = "model", seed: int = 0, profile_step: int = 0,
                  dense_layers: tuple[int, ...] | None = None, options: dict | None = None,
                  draft_tokens: int | str = "auto") -> dict:  # fmt: skip
    """One `model.generate()` of `row` on `ids` -> TPOT over the steps after `warmup`, prefill seconds, peak memory
    and (methods) the tokens attended per step.

    prefill="synthetic": the prompt's K/V are written into the row's cache directly (random values, the same for
    every row: `synthetic_fill`, `synthetic_hf_cache`), and `model.generate()` continues from that cache, its
    first forward being the prompt's last token. The decode steps are the same; a long context's prefill is
    skipped (at 128K it takes about 21 s per sequence on an H200, 32 layers).

    profile_step: that many of the captured step's heaviest kernels too (`profile_replays`; 0: no profile)."""
    import sparsekv

    if parse_row(row)[1] in (LOSSLESS_SUFFIX, LOSSLESS_COMPILE_SUFFIX):
        return _time_lossless(model, ids, row, budget=budget, top_p=top_p, options=options, new_tokens=new_tokens,
                              warmup=warmup, prefill_chunk_size=prefill_chunk_size, dense_layers=dense_layers,
                              profile_step=profile_step, draft_tokens=draft_tokens)  # fmt: skip
    device = ids.device
    steps = new_tokens + warmup + 1
    runtime = []  # the row's SparseRuntime, once enabled
    step = {}

    def time_the_step_alone() -> None:
        if runtime:
            step["ms"] = replay_ms(runtime[0].graph, device)
            if profile_step:
                step["profile"] = profile_replays(runtime[0].graph, device, profile_step)

    clock = _TokenClock(device, steps + 1, time_the_step_alone)
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": steps, "min_new_tokens": steps,
              "do_sample": False, "streamer": clock, "prefill_chunk_size": prefill_chunk_size, "pad_token_id": 0}
    if row == "hf-static-compile":
        kwargs["cache_implementation"] = "static"
    config = config_for(row, budget, top_p, dense_below, dense_layers, options)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    result: dict = {"row": row}
    paths = None
    filled = prefill == "synthetic"
    if filled:  # the cache holds the prompt but its last token, which generate() feeds as its first forward
        batch, context = ids.shape[0], ids.shape[1] - 1
        kwargs["prefill_chunk_size"] = None
    try:
        if config is None:
            if filled:
                kwargs.update(cache_kwargs(model, synthetic_hf_cache(model, batch, context, seed=seed)))
            model.generate(ids, **kwargs)
            stats = None
        else:
            _, path, _ = parse_row(row)
            graph_decode = False if path == EAGER_SUFFIX else None
            compile_step = path == COMPILE_SUFFIX
            with sparsekv.enabled(model, config, graph_decode=graph_decode, compile_step=compile_step) as rt:
                runtime.append(rt)
                if filled:
                    cache = SparseCache.for_model(model, config, initial_capacity=context + steps + 1)
                    if graph_decode is not False:  # decided before the prompt is cached, as generate() does
                        cache.settle_fallback(ids.device.type, batch, context)
                    synthetic_fill(model, cache, batch, context, seed=seed)
                    kwargs.update(cache_kwargs(model, cache))
                model.generate(ids, **kwargs)
                stats = sparsekv.last_cache(model).stats.summary()
                paths = dict(rt.graph.steps)
    except torch.OutOfMemoryError as error:
        return result | {"error": f"out of memory: {str(error).splitlines()[0][:200]}"}
    finally:
        if row == "hf-static-compile":
            release_compiled_forward(model)
    times = clock.times  # prompt, first token (end of the prefill), then one per decode step
    timed = times[2 + warmup :]
    tpot = (timed[-1] - times[1 + warmup]) / len(timed)
    result.update(
        tpot_ms=1e3 * tpot,
        step_ms=step.get("ms"),
        tokens_per_s=ids.shape[0] / tpot,
        prefill_s=times[1] - times[0],
        peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        avg_budget_tokens=stats and stats["avg_budget_tokens"],
        avg_context_tokens=stats and stats["avg_context_tokens"],
        sparse_layers=stats and sorted(stats["per_layer_avg_tokens"]),
        decode_paths=paths,
    )
    if profile_step:
        result["step_profile"] = step.get("profile")
    return result


def release_compiled_forward(model) -> None:
    """Frees what an `hf-static-compile` row leaves behind: transformers keeps its compiled forward on the model
    (`_compiled_call`, compiled with `reduce-overhead`, whose CUDA graphs keep their memory pool and the static
    cache they captured), so the next row would start with this row's cache still allocated (H200, Gemma 3 270M at
    32K x B192: the captured dense row after it ran out of memory with 138 GiB in use). Later compiled rows
    compile again."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_lossless(model, ids: torch.Tensor, row: str, *, budget: float, top_p: float | None, options: dict | None,
                   new_tokens: int, warmup: int, prefill_chunk_size: int | None,
                   dense_layers: tuple[int, ...] | None, profile_step: int = 0,
                   draft_tokens: int | str = "auto") -> dict:  # fmt: skip
    """`time_generate` of a `<method>@lossless` row. Tokens come in rounds, each row at its own pace; the rounds'
    timeline (`DraftCounts.timeline`) gives TPOT as the seconds per token of a row over the rounds after the first
    `warmup` tokens of a row and while every row is still decoding, steady rounds only: a round that captures a
    graph (the first fixed-shape one, and with `auto` the first round of each new number of drafts, which may come
    after the warm-up) is left out, as the dense rows leave their capture step out in the warm-up.

    profile_step: that many of the heaviest kernels of a draft step ("step_profile", the glue between the draft
    graphs included) and of a verification ("verify_profile"), from one round after the warm-up that is left out
    of the timing (`DraftCounts.profile_after`)."""
    import sparsekv

    device, batch = ids.device, ids.shape[0]
    config = config_for(row, budget, top_p, dense_layers=dense_layers, options=options)
    compile_step = parse_row(row)[1] == LOSSLESS_COMPILE_SUFFIX
    result: dict = {"row": row}
    clock = _TokenClock(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": warmup + new_tokens + 1, "do_sample": False,
              "eos_token_id": [], "pad_token_id": 0, "prefill_chunk_size": prefill_chunk_size}  # fmt: skip
    try:
        with sparsekv.enabled(model, config, lossless=True, draft_tokens=draft_tokens, compile_step=compile_step) as rt:
            if compile_step:  # compiles the rounds' steps (dynamo keeps them for the next generation)
                model.generate(ids, **kwargs)
            rt.profile_round_after = PROFILED_ROUND_AFTER if profile_step else None
            model.generate(ids, streamer=clock, **kwargs)
            drafts = rt.drafts
            stats = sparsekv.last_cache(model).stats.summary()
    except torch.OutOfMemoryError as error:
        return result | {"error": f"out of memory: {str(error).splitlines()[0][:200]}"}
    tpot, timed, left_out, tokens = rounds_tpot(drafts.timeline, batch, warmup, clock.times[1])
    if tpot is None:
        return result | {"error": f"no round without a capture after {warmup} warm-up tokens with every row "
                                  "decoding: raise --new-tokens"}  # fmt: skip
    return result | {
        "tpot_ms": 1e3 * tpot,
        "step_ms": None,
        "tokens_per_s": batch / tpot,
        "prefill_s": clock.times[1] - clock.times[0],
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "avg_budget_tokens": stats["avg_budget_tokens"],
        "avg_context_tokens": stats["avg_context_tokens"],
        "decode_paths": dict(drafts.paths),
        "acceptance_rate": drafts.acceptance_rate,
        "tokens_per_verification": drafts.tokens_per_verification,
        "drafts_per_round": dict(drafts.drafts_per_round),
        "draft_step_ms": 1e3 * drafts.draft_seconds / drafts.draft_steps if drafts.draft_steps else None,
        "verify_ms": 1e3 * drafts.verify_seconds / drafts.verify_steps if drafts.verify_steps else None,
        "timed_tokens_per_row": tokens / batch,
        "timed_rounds": timed,
        "capture_rounds_left_out": left_out,
    } | ({} if not profile_step else {
        "step_profile": _round_profile(drafts, "draft", profile_step),
        "verify_profile": _round_profile(drafts, "verify", profile_step),
    })


def _round_profile(drafts, name: str, top: int) -> dict | None:
    """`kernel_profile` of a profiled lossless round's draft steps or verification (None: no round was profiled:
    no CUDA graphs, or too few rounds)."""
    if name not in drafts.step_profiles:
        return None
    events, steps = drafts.step_profiles[name]
    return kernel_profile(events, steps, top)


def rounds_tpot(timeline, batch: int, warmup: int, first_token_at: float):
    """Lossless rounds' TPOT from their timeline (`DraftCounts.timeline`; the first token of every row reached the
    host at `first_token_at`): a round's seconds are its end minus the previous round's; the rounds counted come
    after `warmup` tokens a row, with every row decoding, and captured no graph. -> (seconds per token of a row or
    None, rounds counted, rounds left out for a capture, tokens counted)."""
    taken, seconds, tokens, last = batch, 0.0, 0, first_token_at
    timed = left_out = 0
    for at, got, active, steady in timeline:
        if taken >= (warmup + 1) * batch and active == batch:
            if steady:
                seconds, tokens, timed = seconds + at - last, tokens + got, timed + 1
            else:
                left_out += 1
        taken, last = taken + got, at
    return (seconds * batch / tokens if tokens else None), timed, left_out, tokens


def embedded_prompts(tokenizer, batch: int, context: int) -> torch.Tensor:
    """[batch, context] token ids: windows of the embedded essays, row r starting 1,009 r tokens in (wrapping
    around the text), so that every row reads its own text."""
    from sparsekv.assets import haystack_text

    text = torch.tensor(tokenizer(haystack_text()).input_ids)
    if len(text) <= context:
        raise ConfigError(f"the embedded essays hold {len(text)} tokens: --context must be below that")
    starts = [(1009 * r) % (len(text) - context) for r in range(batch)]
    return torch.stack([text[s : s + context] for s in starts])


def run_generate(
    model: str = "llama3-8b-random",
    *,
    layers: int | None = None,
    context: int = 32768,
    batch: int = 1,
    rows: tuple[str, ...] = (*HF_ROWS, *DEFAULT_METHODS),
    budget: float = 0.02,
    top_p: float | None = None,
    dense_below: int | None = None,
    new_tokens: int = 32,
    warmup: int = 4,
    prefill_chunk_size: int | None = None,
    rounds: int = 1,
    seed: int = 0,
    device: str | None = None,
    tp: int = 1,
    prefill: str = "model",
    profile_step: int = 0,
    dense_layers: tuple[int, ...] | None = None,
    options: dict | None = None,
    draft_tokens: int | str = "auto",
    progress=None,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    """Every row of `rows` through `model.generate()` on the same random prompts, `rounds` times in turn.

    prefill: "model" (the model prefills the prompt) or "synthetic" (random K/V written into each row's cache,
    generate() continuing from it: `time_generate`), for random-weight models.

    dense_below: the methods' dense fallback threshold (`SparseConfig.dense_below`; None = each method's default,
    0 = always the method's own step: what measures the crossover).

    tp > 1: the model is loaded with transformers' tensor parallelism over `tp` GPUs, one process each (launched
    with torchrun; `tensor_parallel_model`); every rank runs every row on the same prompts and reports its own
    times, the caches' stats are summed over the ranks.

    profile_step: that many of each captured row's heaviest kernels too (`time_generate`; 0: none).

    dense_layers: the layers the methods keep dense (None: the config's default, layers 0 and 1).

    options: method options, 'key' for every row's method that has it, 'method:key' for that method's rows
    (`registry.options_by_method`).

    draft_tokens: the lossless rows' drafts per verification (`sparsekv.enabled`'s; "auto": chosen round by round).

    progress: called with a line of text as the model is ready and as each row ends (a long run shows its way).
    on_row: called after each row with the payload over the rows so far ("complete": False), which the CLI writes
    to --output: a run stopped in a later row keeps what it measured. The payload returned has "complete": True."""
    from sparsekv.bench.e2e import build_model, check_fits
    from sparsekv.bench.e2e_model import tensor_parallel_model
    from sparsekv.registry import options_by_method

    for what, value, least in (("context", context, 2), ("batch", batch, 1), ("new_tokens", new_tokens, 1),
                               ("warmup", warmup, 0), ("rounds", rounds, 1), ("tp", tp, 1),
                               ("profile_step", profile_step, 0)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{what} must be >= {least}, got {value}")
    # unknown method names: one ConfigError listing the methods (`get_method_class`, through the options' rule)
    options_of = options_by_method([method_of(row) for row in rows if row not in HF_ROWS], options or {})
    for row in rows:
        if row not in HF_ROWS:
            # bad budget / top_p / dense layers / options for a method: its ConfigError, before the model
            config = config_for(row, budget, top_p, dense_below, dense_layers, options_of[method_of(row)])
            if parse_row(row)[1] in (LOSSLESS_SUFFIX, LOSSLESS_COMPILE_SUFFIX):
                check_lossless(config, draft_tokens)  # and a bad draft count
    check_prefill(prefill, rows, model=model, prefill_chunk_size=prefill_chunk_size)
    dense_cache = any(keeps_dense_cache(row) for row in rows)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    started = time.perf_counter()
    if tp > 1:
        if dev.type == "cuda":  # this rank's GPU
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        check_fits(model, layers=layers, dtype=dtype, device=dev, batch=batch, context=context, shards=tp,
                   dense_cache=dense_cache)
        net = tensor_parallel_model(model, layers=layers, tp=tp, dtype=dtype, seed=seed)
    elif model in REAL_MODELS:
        if layers is not None or tp > 1:
            raise ConfigError(f"--model {model} runs the whole real model on one device: drop --layers and --tp")
        from sparsekv.models import load_model

        net, tokenizer = load_model(REAL_MODELS[model], dtype=dtype, device=dev)
        ids = embedded_prompts(tokenizer, batch, context).to(dev)
    else:
        check_fits(model, layers=layers, dtype=dtype, device=dev, batch=batch, context=context,
                   dense_cache=dense_cache)
        net = build_model(model, layers=layers, dtype=dtype, device=dev, seed=seed)
    say = progress or (lambda _line: None)
    say(f"model ready: {net.config.num_hidden_layers} layers, tp {tp} ({time.perf_counter() - started:.0f} s)")
    if model not in REAL_MODELS:
        generator = torch.Generator().manual_seed(seed)
        # a synthetic prefill caches `context` tokens: generate() takes them plus the one it feeds first
        length = context + (prefill == "synthetic")
        ids = torch.randint(3, net.config.vocab_size, (batch, length), generator=generator).to(dev)
    report = _report(dev, model, tp, net, context=context, batch=batch, budget=budget, top_p=top_p,
                     dense_below=dense_below, dense_layers=dense_layers, options=options or {}, new_tokens=new_tokens,
                     warmup=warmup, prefill_chunk_size=prefill_chunk_size, prefill=prefill,
                     draft_tokens=draft_tokens)  # fmt: skip
    results: list[dict] = []
    for round_index in range(rounds):
        for row in rows:
            timed = time_generate(net, ids, row, budget=budget, top_p=top_p, new_tokens=new_tokens, warmup=warmup,
                                  prefill_chunk_size=prefill_chunk_size, dense_below=dense_below, prefill=prefill,
                                  seed=seed, profile_step=profile_step, dense_layers=dense_layers,
                                  options=options_of.get(method_of(row)), draft_tokens=draft_tokens)  # fmt: skip
            results.append(timed | {"round": round_index})
            done = f"TPOT {timed['tpot_ms']:.2f} ms, prefill {timed['prefill_s']:.1f} s" if "tpot_ms" in timed else timed["error"]
            if timed.get("verify_ms") is not None:  # a lossless row's rounds, said before the later rows run
                done += (f", accepted {timed['acceptance_rate'] or 0:.2f}, {timed['tokens_per_verification']:.2f} "
                         f"tokens/verification, draft step {timed['draft_step_ms'] or 0:.2f} ms, verification "
                         f"{timed['verify_ms']:.2f} ms, peak {(timed['peak_bytes'] or 0) / 1e9:.1f} GB")  # fmt: skip
            say(f"{row}: {done} ({time.perf_counter() - started:.0f} s in)")
            if on_row is not None:
                on_row(report(results, complete=False))
    return report(results, complete=True)


def _report(dev: torch.device, model: str, tp: int, net, **run) -> Callable[..., dict]:
    """-> report(results, complete): the run's JSON payload over the rows timed so far."""

    def report(results: list[dict], complete: bool) -> dict:
        return {
            **run_environment(dev),
            "model": model,
            "tp": tp,
            "rank": torch.distributed.get_rank() if tp > 1 else 0,
            "layers": net.config.num_hidden_layers,
            **run,
            "complete": complete,
            "results": list(results),
            "summary": summarize(results),
        }

    return report


def check_prefill(prefill: str, rows: tuple[str, ...], *, model: str, prefill_chunk_size: int | None) -> None:
    """One ConfigError for a prefill mode the rows or the model cannot take."""
    if prefill not in PREFILLS:
        raise ConfigError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}")
    if prefill == "model":
        return
    if model in REAL_MODELS:
        raise ConfigError(f"--model {model} has real weights and text: its prompts are prefilled by the model "
                          "(--prefill synthetic is for random-weight models)")  # fmt: skip
    if prefill_chunk_size is not None:
        raise ConfigError("--prefill-chunk-size sets how the model prefills: drop it with --prefill synthetic")
    refused = [row for row in rows if row == "hf-static-compile" or parse_row(row)[1] in (LOSSLESS_SUFFIX,
                                                                                            LOSSLESS_COMPILE_SUFFIX)]
    if refused:
        raise ConfigError(f"--prefill synthetic fills a DynamicCache or a SparseCache; rows {', '.join(refused)} "
                          "prefill their own (a static cache, lossless rounds): drop them or prefill with the model")


def decode_path(paths: dict | None) -> str:
    """The decode steps' paths in short: "graph 62 / eager 2 (first decode step, ...)"."""
    if not paths:
        return ""
    graph = sum(v for k, v in paths.items() if k.startswith(("graph", "fixed-shape")))
    fallback = sum(v for k, v in paths.items() if k.endswith("(dense fallback)"))
    eager = {k.removeprefix("eager: "): v for k, v in paths.items() if k.startswith("eager")}
    reasons = ", ".join(k for k in eager if k not in ("prompt or several tokens", "first decode step"))
    steps = sum(paths.values()) - paths.get("eager: prompt or several tokens", 0)
    dense = f", {fallback} dense fallback" if fallback else ""
    return f"graph {graph}/{steps}{dense}" + (f" ({reasons})" if reasons else "")


def run_environment(device: torch.device) -> dict:
    """What a benchmark's JSON records about where and when it ran."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def summarize(results: list[dict]) -> list[dict]:
    """Per row: the best TPOT over the rounds and its ratios to HF's best dense (the faster of the two HF rows) and
    to sparsekv's own captured dense step (the faster of the `dense` and `dense@compile` rows)."""
    best: dict[str, dict] = {}
    for r in results:
        if r.get("tpot_ms") is not None and (r["row"] not in best or r["tpot_ms"] < best[r["row"]]["tpot_ms"]):
            best[r["row"]] = r
    hf = [best[row]["tpot_ms"] for row in HF_ROWS if row in best]
    reference = min(hf) if hf else None
    # sparsekv's captured dense step: the faster of the plain and the compiled capture
    dense = [best[row]["tpot_ms"] for row in ("dense", "dense" + COMPILE_SUFFIX) if row in best]
    captured = min(dense) if dense else None
    rows = []
    for row in dict.fromkeys(r["row"] for r in results):
        r = best.get(row) or next(x for x in results if x["row"] == row)
        tpot = r.get("tpot_ms")
        rows.append({**r, "vs_hf_best_dense": reference / tpot if reference and tpot else None,
                     "vs_captured_dense": captured / tpot if captured and tpot else None})  # fmt: skip
    return rows
