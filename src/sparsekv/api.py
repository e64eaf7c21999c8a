"""Turning sparse decoding on and off for a loaded model, and generating with budget stats."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from sparsekv.attention import ATTENTION_NAME, RUNTIME_ATTR, SparseRuntime, register
from sparsekv.cache import SparseCache, cache_memory, layer_infos
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.graph_decode import GraphDecode, forward_replaced
from sparsekv.hf_compat import CACHE_ARGUMENTS, cache_argument, check_transformers_version
from sparsekv.lossless import (
    AUTO_DRAFTS,
    Decoder,
    DraftCounts,
    RowTokens,
    Sampler,
    check_lossless,
    decode_rounds,
    generate_losslessly,
    lossless_capacity,
    prefill,
)
from sparsekv.registry import get_method_class

_STATE_ATTR = "_sparsekv_enabled"


@dataclass
class _EnabledState:
    runtime: SparseRuntime
    previous_attention: str
    hooks: list[torch.utils.hooks.RemovableHandle]
    #: the model's forward routed through `runtime.graph` (installed while a generation runs)
    graph_forward: object


@contextlib.contextmanager
def lossless_forwards(runtime: SparseRuntime) -> Iterator[None]:
    """The model's forwards skip its graph decoding (`GraphDecode`) while lossless rounds run: they roll back,
    mask rows and capture their own graphs (`sparsekv.lossless.decode_rounds`)."""
    mode, runtime.graph.mode = runtime.graph.mode, False
    try:
        yield
    finally:
        runtime.graph.mode = mode


@contextlib.contextmanager
def _forward_through_graphs(model, capacity: int) -> Iterator[None]:
    """While the block runs, the enabled model's forward goes through its `GraphDecode` (`sparsekv.graph_decode`)
    for a generation of at most `capacity` tokens; afterwards its cache decodes eagerly again."""
    state: _EnabledState = getattr(model, _STATE_ATTR)
    state.runtime.graph.begin(capacity)
    try:
        with forward_replaced(model, state.graph_forward):
            yield
    finally:
        state.runtime.graph.end()


def _attention_modules(model) -> list[torch.nn.Module]:
    # attention modules: a layer index and an output projection (q/k/v may be fused, as in Phi-3)
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not modules:
        raise ConfigError(f"{type(model).__name__} has no attention modules sparsekv can drive")
    return modules


def _prompt_length(args: tuple, kwargs: dict) -> int | None:
    """Tokens of the prompt a `model.generate(...)` call was given (None when it cannot be told)."""
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if not isinstance(prompt, torch.Tensor) and kwargs.get("inputs_embeds") is not None:
        return kwargs["inputs_embeds"].shape[1]
    return prompt.shape[-1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 else None


def _generation_length(model, prompt_length: int | None, kwargs: dict) -> int:
    """The longest sequence a `model.generate(...)` call can produce (0 when it cannot be told): the cache is
    allocated at that size once, instead of doubling past it (at 128K tokens a doubling is the whole cache again)."""
    config = kwargs.get("generation_config") or model.generation_config
    new_tokens = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new_tokens is not None and prompt_length is not None:
        return prompt_length + new_tokens
    return kwargs.get("max_length") or 0


def enable(
    model,
    config: SparseConfig,
    *,
    prompt_filtered: bool = False,
    graph_decode: bool | None = None,
    compile_step: bool = False,
    lossless: bool = False,
    draft_tokens: int | str = AUTO_DRAFTS,
) -> SparseRuntime:
    """Makes `model` decode with `config`; `model.generate()` and plain forwards then use a SparseCache.

    The prompt is attended densely, whether it comes in one forward or in chunks (`model.generate(...,
    prefill_chunk_size=N)`); the decode steps after it attend sparsely. In a loop of plain forwards the first forward
    is the prompt and every later one (one token, or a chunk of new tokens as in evaluation) attends sparsely.
    Calling enable again replaces the config. Undo with `disable(model)`.

    Methods that rewrite the prompt before decoding (gemfilter) cannot run inside `model.generate()`: they are
    refused unless `prompt_filtered=True` says that the caller already ran the method's `filter_prompt` on its
    inputs (as `sparsekv.generate` does).

    graph_decode: `model.generate()`'s one-token decode steps replay one CUDA graph of the whole forward
    (`sparsekv.graph_decode`). None (default): on CUDA, for the methods with a fixed-shape step (dense, oracle-topk,
    spotlight, lsh, quest, twilight, double-sparsity, self-index, streaming); True: also on CPU, where the
    fixed-shape step runs without a graph; False: never.
    `runtime.graph.steps` counts the decode steps of the last generate() call by path, with the reason of any
    step that ran eagerly.

    compile_step: the fixed-shape step runs the model's forward through `torch.compile` before the graph captures
    it: Inductor fuses the many small kernels of the layers' norms, rotary embeddings, activations and residual
    adds (the cache update and the attention stay as they are; a method may compile its own tensor code of the
    step too: self-index does). The first captured step pays the compile time (about 10 s for 32
    Llama-3-8B-shaped layers on an H200 host); needs graph_decode None or True.

    lossless: `model.generate()` decodes by self-speculation (`sparsekv.lossless`): `draft_tokens` sparse steps
    propose, one dense forward verifies, so the output is the dense model's greedy output token for token.
    draft_tokens: an int, or "auto" (default): the rounds replayed as CUDA graphs choose 0, 1, 2, 4 or 8 drafts
    each from the measured acceptance and the timed draft and verification steps
    (`sparsekv.lossless.best_draft_count`: 0 is a plain dense step, when drafting does not pay); eager rounds draft
    4. With compile_step the rounds' draft step and verifications run the compiled forward.
    It takes input_ids, attention_mask (left padding), max_new_tokens, eos/pad ids and a streamer, greedy only, and
    refuses any other generate() argument; `runtime.drafts` counts the last call's drafts (`acceptance_rate`).
    """
    if not isinstance(config, SparseConfig):
        raise ConfigError(f"enable() needs a SparseConfig, got {type(config).__name__}")
    check_transformers_version()
    method = get_method_class(config.method)
    if method.rewrites_prompt and not prompt_filtered:
        raise ConfigError(
            f"{config.method} rewrites the prompt before decoding, which model.generate() cannot do: use "
            f"sparsekv.generate(model, tokenizer, prompts, config) or `sparsekv generate --method {config.method}`"
        )
    infos = layer_infos(model)
    config.check_model(len(infos))
    method.check_model(model, config)
    selecting = [i.layer_idx for i in infos if not i.sliding and i.layer_idx not in config.dense_layers]
    if not (method.dense or method.rewrites_prompt or selecting):
        raise ConfigError(
            f"{config.method} would select in no layer of this model: every layer is in dense_layers "
            f"{config.dense_layers} or attends within a sliding window"
        )
    cache_name = cache_argument(model)
    if getattr(model, _STATE_ATTR, None) is not None:
        disable(model)
    register()
    if graph_decode not in (None, True, False):
        raise ConfigError(f"graph_decode must be None, True or False, got {graph_decode!r}")
    if compile_step not in (True, False):
        raise ConfigError(f"compile_step must be True or False, got {compile_step!r}")
    if compile_step and graph_decode is False:
        raise ConfigError("compile_step compiles the fixed-shape decode step, which graph_decode=False turns off")
    if lossless not in (True, False):
        raise ConfigError(f"lossless must be True or False, got {lossless!r}")
    if lossless:
        check_lossless(config, draft_tokens)
    runtime = SparseRuntime(config)
    for module in _attention_modules(model):
        setattr(module, RUNTIME_ATTR, runtime)

    def swap_in_sparse_cache(_module, args, kwargs):
        for alias in CACHE_ARGUMENTS:  # a cache passed under the release's other name counts as this one
            if alias != cache_name and alias in kwargs and kwargs.get(cache_name) is None:
                kwargs[cache_name] = kwargs.pop(alias)
        cache = kwargs.get(cache_name)
        runtime.in_forward = True
        if kwargs.get("use_cache") is False and cache is None:
            runtime.cache = None
            return args, kwargs
        if not isinstance(cache, SparseCache):
            if isinstance(cache, Cache) and cache.get_seq_length() > 0:
                raise ConfigError(
                    "this model has sparse decoding enabled but was given a non-empty "
                    f"{type(cache).__name__}; pass a sparsekv.SparseCache (or no cache) instead"
                )
            cache = SparseCache(config, infos, runtime.generation_length, prompt_length=runtime.prompt_length)
            kwargs[cache_name] = cache
        elif cache.prompt_length is None and runtime.prompt_length is not None and cache.get_seq_length() == 0:
            cache.prompt_length = runtime.prompt_length  # an empty cache handed to generate(): its prompt
        runtime.cache = cache
        return args, kwargs

    def forward_done(_module, _args, _output):
        runtime.in_forward = False

    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    hooks = [
        model.register_forward_pre_hook(swap_in_sparse_cache, with_kwargs=True),
        model.register_forward_hook(forward_done, always_call=True),
    ]
    # model.generate() on this instance learns the prompt's length, so that a prompt fed in chunks
    # (prefill_chunk_size) is prefilled densely; the class and every other model are untouched
    class_generate = type(model).generate
    class_forward = model.forward
    runtime.graph = GraphDecode(class_forward, cache_name, graph_decode, compile_step)

    @functools.wraps(class_forward)  # generate reads the forward's signature (logits_to_keep, ...)
    def forward_through_graphs(*args, **kwargs):
        return runtime.graph(*args, **kwargs)

    @functools.wraps(class_generate)
    def generate_knowing_the_prompt(*args, **kwargs):
        if lossless:
            runtime.drafts = DraftCounts(profile_after=runtime.profile_round_after)
            with lossless_forwards(runtime):
                step_forward = runtime.graph.step_forward() if compile_step else None
                return generate_losslessly(model, config, draft_tokens, runtime.drafts, args, kwargs, graph_decode,
                                           step_forward)  # fmt: skip
        runtime.prompt_length = _prompt_length(args, kwargs)
        runtime.generation_length = _generation_length(model, runtime.prompt_length, kwargs)
        try:
            with _forward_through_graphs(model, runtime.generation_length):
                return class_generate(model, *args, **kwargs)
        finally:
            runtime.prompt_length, runtime.generation_length = None, 0

    model.generate = generate_knowing_the_prompt
    setattr(model, _STATE_ATTR, _EnabledState(runtime, previous, hooks, forward_through_graphs))
    return runtime


def disable(model) -> None:
    """Restores the model's own attention; a no-op if sparse decoding is not enabled."""
    state: _EnabledState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for hook in state.hooks:
        hook.remove()
    if "generate" in vars(model):
        del model.generate
    for module in _attention_modules(model):
        if hasattr(module, RUNTIME_ATTR):
            delattr(module, RUNTIME_ATTR)
    model.set_attn_implementation(state.previous_attention)
    delattr(model, _STATE_ATTR)


@contextlib.contextmanager
def enabled(model, config: SparseConfig, **options) -> Iterator[SparseRuntime]:
    """`enable` (with the same keyword options) for the duration of a `with` block."""
    runtime = enable(model, config, **options)
    try:
        yield runtime
    finally:
        disable(model)


def last_cache(model) -> SparseCache | None:
    """The SparseCache of the model's latest forward (its `.stats` hold the budgets used)."""
    state: _EnabledState | None = getattr(model, _STATE_ATTR, None)
    return state.runtime.cache if state else None


@dataclass
class GenerationResult:
    texts: list[str]
    new_token_ids: list[list[int]]
    method: str
    avg_budget_tokens: float | None
    avg_context_tokens: float | None
    avg_budget_fraction: float | None
    prefill_seconds: float
    decode_seconds: float
    new_tokens: int
    #: bytes the K/V cache held at the end (`cache_memory(capacity=False)`: compressed layers by component, the
    #: others the K/V of their tokens)
    cache_bytes: int | None = None
    #: lossless decoding: drafted tokens the dense verification accepted, of those drafted (None otherwise)
    acceptance_rate: float | None = None
    #: lossless decoding: tokens produced per dense verification forward (accepted drafts + its own token)
    tokens_per_verification: float | None = None
    #: decode forwards by path (`GraphDecode.steps`: CUDA graph replays, fixed-shape, or eager and why)
    decode_paths: dict[str, int] | None = None

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first (which comes out of the prefill) per decode second."""
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.texts[0] if len(self.texts) == 1 else self.texts,
            "texts": self.texts,
            "method": self.method,
            "avg_budget_tokens": self.avg_budget_tokens,
            "avg_context_tokens": self.avg_context_tokens,
            "avg_budget_fraction": self.avg_budget_fraction,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "new_tokens": self.new_tokens,
            "tokens_per_second": self.tokens_per_second,
            "cache_bytes": self.cache_bytes,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_verification": self.tokens_per_verification,
            "decode_paths": self.decode_paths,
        }


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: str | list[str],
    config: SparseConfig,
    max_new_tokens: int = 32,
    *,
    lossless: bool = False,
    draft_tokens: int | str = AUTO_DRAFTS,
    allow_longer_context: bool = False,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int | None = None,
    graph_decode: bool | None = None,
    compile_step: bool = False,
) -> GenerationResult:
    """Greedy generation of a batch of prompts (left-padded) with sparse decoding, timed and with budget stats.

    Runs its own loop over `model(...)` so that prefill and decode are timed separately; the tokens equal
    `model.generate(do_sample=False)` with the same config.

    do_sample: draw each token from softmax(logits / temperature) (a `seed` makes it repeatable) instead of greedy.

    lossless: self-speculative decoding: `draft_tokens` (an int, or "auto" as for `enable`) sparse decode steps
    propose tokens, one dense forward over them verifies, and each row keeps its longest agreeing prefix and the
    dense model's next token (`sparsekv.lossless`). Greedy, the output is the dense model's greedy output; sampling,
    the speculative-sampling rule keeps the dense model's distribution exactly. The stats add the drafts'
    acceptance rate.

    graph_decode: as for `enable`: the one-token decode steps of an unpadded batch replay one CUDA graph (None: on
    CUDA); lossless rounds replay two (the draft step and the verification) after their first round, where the
    method allows (`sparsekv.lossless.CapturedRounds`); `decode_paths` in the result says how each step
    (lossless: each round) ran.
    compile_step: as for `enable`: that step's forward compiled by torch.compile before it is captured.

    A prompt plus `max_new_tokens` longer than the model's trained context (`max_position_embeddings`) is refused
    unless `allow_longer_context`: past it most models answer nothing useful, after a long prefill.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or any(not isinstance(p, str) or not p for p in prompts):
        raise ConfigError("prompts must be one or more non-empty strings")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if lossless:
        check_lossless(config, draft_tokens)
    if do_sample and not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be a number > 0, got {temperature!r}")
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    trained = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    longest = int(batch["attention_mask"].sum(-1).max()) + max_new_tokens
    if trained and longest > trained and not allow_longer_context:
        raise ConfigError(
            f"the prompt ({longest - max_new_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's trained context of {trained} tokens; shorten it, or pass allow_longer_context=True "
            "(CLI: --allow-longer-context) to run it anyway"
        )
    eos = tokenizer.eos_token_id
    method = get_method_class(config.method)
    counts = DraftCounts()
    with enabled(model, config, prompt_filtered=True, graph_decode=graph_decode, compile_step=compile_step) as runtime, \
            (lossless_forwards(runtime) if lossless else contextlib.nullcontext()):  # fmt: skip
        start = time.perf_counter()
        input_ids, attention_mask = method.filter_prompt(model, batch["input_ids"], batch["attention_mask"], config)
        capacity = input_ids.shape[1] + max_new_tokens
        reserved = capacity
        if lossless:  # room for the rounds' drafts where they may run at fixed shapes
            reserved = lossless_capacity(input_ids.shape[1], max_new_tokens, draft_tokens, graph_decode, device)
        # lossless: a compressing method (self-index) drafts from its storage, the verification reads 16-bit K/V
        cache = SparseCache(config, layer_infos(model), initial_capacity=reserved, keeps_plain_kv=lossless)
        if not lossless and runtime.graph.mode is not False:
            # the dense fallback is decided before the prompt is cached (a compressing method keeps no 16-bit K/V
            # otherwise); lossless drafts are sparse whatever the length
            cache.settle_fallback(device.type, input_ids.shape[0], input_ids.shape[1])
        logits = prefill(model, cache, input_ids, attention_mask)
        _synchronize(device)
        prefill_end = time.perf_counter()
        decoder = Decoder(model, cache, attention_mask)
        sampler = Sampler(temperature if do_sample else None, seed, device)
        if lossless:
            out = RowTokens(len(prompts), max_new_tokens, torch.tensor([] if eos is None else [eos]), device)
            first = sampler.draw(logits)[0]
            out.add(first[:, None], torch.ones_like(first))
            decode_rounds(model, decoder, sampler, first, out, draft_tokens, counts, graph_decode,
                          step_forward=runtime.graph.step_forward() if compile_step else None)  # fmt: skip
            new_ids = out.rows
        else:
            new_ids = _decode_steps(model, decoder, sampler, logits, eos, max_new_tokens, capacity)
        _synchronize(device)
        end = time.perf_counter()
    trimmed = [ids[: ids.index(eos)] if eos is not None and eos in ids else ids for ids in new_ids]
    stats = cache.stats.summary()
    return GenerationResult(
        texts=[tokenizer.decode(ids, skip_special_tokens=True) for ids in trimmed],
        new_token_ids=trimmed,
        method=config.method,
        avg_budget_tokens=stats["avg_budget_tokens"],
        avg_context_tokens=stats["avg_context_tokens"],
        avg_budget_fraction=stats["avg_budget_fraction"],
        prefill_seconds=prefill_end - start,
        decode_seconds=end - prefill_end,
        new_tokens=max(len(ids) for ids in new_ids),
        cache_bytes=cache_memory(cache, capacity=False)["bytes_total"],
        acceptance_rate=counts.acceptance_rate if lossless else None,
        tokens_per_verification=counts.tokens_per_verification if lossless else None,
        decode_paths=dict(counts.paths) if lossless else dict(runtime.graph.steps),
    )


def _decode_steps(model, decoder: Decoder, sampler: Sampler, logits: torch.Tensor, eos: int | None, max_new_tokens: int,
                  capacity: int) -> list[list[int]]:  # fmt: skip
    """One token per row and step (EOS repeated after a row's EOS) until every row has finished -> each row's
    tokens; the one-token steps replay a CUDA graph where they can."""
    finished = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)
    generated: list[torch.Tensor] = []

    def emit(token: torch.Tensor) -> bool:
        """Appends one token per row; True when every row has finished."""
        if eos is not None:
            token = torch.where(finished, torch.full_like(token, eos), token)
            finished.logical_or_(token == eos)
        generated.append(token)
        return bool(finished.all())

    with _forward_through_graphs(model, capacity):
        done = emit(sampler.draw(logits)[0])
        while not done and len(generated) < max_new_tokens:
            done = emit(sampler.draw(decoder(generated[-1][:, None])[:, -1])[0])
    return torch.stack(generated, dim=1).tolist()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
