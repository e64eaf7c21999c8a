"""Turning sparse decoding on and off for a loaded model, and generating with budget stats."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from sparsekv.attention import ATTENTION_NAME, RUNTIME_ATTR, SparseRuntime, register
from sparsekv.cache import SparseCache, cache_memory, layer_infos
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.registry import get_method_class

_STATE_ATTR = "_sparsekv_enabled"


@dataclass
class _EnabledState:
    runtime: SparseRuntime
    previous_attention: str
    hook: torch.utils.hooks.RemovableHandle


def _attention_modules(model) -> list[torch.nn.Module]:
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if not modules:
        raise ConfigError(f"{type(model).__name__} has no attention modules sparsekv can drive")
    return modules


def enable(model, config: SparseConfig) -> SparseRuntime:
    """Makes `model` decode with `config`; `model.generate()` and plain forwards then use a SparseCache.

    The prefill stays dense; every later forward (decode steps or chunks of new tokens) attends sparsely.
    Calling enable again replaces the config. Undo with `disable(model)`.
    """
    if not isinstance(config, SparseConfig):
        raise ConfigError(f"enable() needs a SparseConfig, got {type(config).__name__}")
    infos = layer_infos(model)
    config.check_model(len(infos))
    get_method_class(config.method).check_model(model, config)
    if getattr(model, _STATE_ATTR, None) is not None:
        disable(model)
    register()
    runtime = SparseRuntime(config)
    for module in _attention_modules(model):
        setattr(module, RUNTIME_ATTR, runtime)

    def swap_in_sparse_cache(_module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if kwargs.get("use_cache") is False and cache is None:
            runtime.cache = None
            return None
        if not isinstance(cache, SparseCache):
            if isinstance(cache, Cache) and cache.get_seq_length() > 0:
                raise ConfigError(
                    "this model has sparse decoding enabled but was given a non-empty "
                    f"{type(cache).__name__}; pass a sparsekv.SparseCache (or no cache) instead"
                )
            cache = SparseCache(config, infos)
            kwargs["past_key_values"] = cache
        runtime.cache = cache
        return args, kwargs

    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    hook = model.register_forward_pre_hook(swap_in_sparse_cache, with_kwargs=True)
    setattr(model, _STATE_ATTR, _EnabledState(runtime, previous, hook))
    return runtime


def disable(model) -> None:
    """Restores the model's own attention; a no-op if sparse decoding is not enabled."""
    state: _EnabledState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    state.hook.remove()
    for module in _attention_modules(model):
        if hasattr(module, RUNTIME_ATTR):
            delattr(module, RUNTIME_ATTR)
    model.set_attn_implementation(state.previous_attention)
    delattr(model, _STATE_ATTR)


@contextlib.contextmanager
def enabled(model, config: SparseConfig) -> Iterator[SparseRuntime]:
    runtime = enable(model, config)
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
        }


@torch.inference_mode()
def generate(model, tokenizer, prompts: str | list[str], config: SparseConfig, max_new_tokens: int = 32) -> GenerationResult:
    """Greedy generation of a batch of prompts (left-padded) with sparse decoding, timed and with budget stats.

    Runs its own loop over `model(...)` so that prefill and decode are timed separately; the tokens equal
    `model.generate(do_sample=False)` with the same config.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or any(not isinstance(p, str) or not p for p in prompts):
        raise ConfigError("prompts must be one or more non-empty strings")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos = tokenizer.eos_token_id
    method = get_method_class(config.method)
    with enabled(model, config):
        cache = SparseCache(config, layer_infos(model))
        start = time.perf_counter()
        input_ids, attention_mask = method.filter_prompt(model, batch["input_ids"], batch["attention_mask"], config)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        generated: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            logits = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # the prompt's full-vocabulary logits would cost more than its attention
            ).logits[:, -1]
            if step == 0:
                _synchronize(device)
                prefill_end = time.perf_counter()
            token = logits.argmax(-1)
            if eos is not None:
                token = torch.where(finished, torch.full_like(token, eos), token)
                finished |= token == eos
            generated.append(token)
            if bool(finished.all()):
                break
            input_ids = token[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        _synchronize(device)
        end = time.perf_counter()
    new_ids = torch.stack(generated, dim=1).tolist()
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
        new_tokens=len(generated),
        cache_bytes=cache_memory(cache, capacity=False)["bytes_total"],
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
