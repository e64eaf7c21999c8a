"""The attention function registered with transformers: dense prefill, sparse decode.

Models call `past_key_values.update(...)` and then this function with `module.layer_idx`; the enabled model's
`SparseRuntime` (attached to each attention module by `sparsekv.enable`) tells which `SparseCache` is live.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from sparsekv.budget import budget_tokens_tensor
from sparsekv.cache import SparseCache, fixed_slots
from sparsekv.config import SparseConfig
from sparsekv.errors import ConfigError
from sparsekv.graph_decode import GraphDecode
from sparsekv.hf_compat import supported_range
from sparsekv.kernels.sparse_attention import sparse_attention
from sparsekv.selectors.base import host_budget
from sparsekv.step import DecodeStep, Selection, StepHints

ATTENTION_NAME = "sparsekv"
RUNTIME_ATTR = "_sparsekv_runtime"


@dataclass
class SparseRuntime:
    """Per enabled model: its config, the cache of the latest forward, whether that forward is in flight, and the
    prompt length of the `model.generate()` call in flight (None outside one)."""

    config: SparseConfig
    cache: SparseCache | None = None
    in_forward: bool = False
    prompt_length: int | None = None
    generation_length: int = 0  # the longest sequence of that call (0 outside one): the cache's capacity
    #: how `model.generate()` runs its decode steps (`sparsekv.graph_decode.GraphDecode`; set by `enable`)
    graph: GraphDecode | None = None
    #: lossless `model.generate()`: the drafts of its latest call (`sparsekv.lossless.DraftCounts`)
    drafts: object | None = None
    #: lossless `model.generate()`: its calls profile a round after that many timed ones (`DraftCounts.profile_after`)
    profile_round_after: int | None = None


class CacheBypassedError(RuntimeError):
    """The model attended over K/V that did not come from the SparseCache sparsekv handed it."""


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, sparse_attention_forward)
    # masks are built exactly as for SDPA, which the dense path delegates to
    AttentionMaskInterface.register(ATTENTION_NAME, decode_mask)


def decode_mask(*args, **kwargs):
    """`sdpa_mask`, except that one new query of a plain causal model with no padding mask gets no mask (None) also
    while a CUDA graph is being captured. transformers skips that mask only when it is not tracing, and a
    materialised mask costs dense SDPA its GQA kernel and the sparse path its sync-free uniform selection.
    Without capture sdpa_mask already returns None there, so eager results are unchanged."""
    if not args and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None:
        q_len = kwargs.get("q_length")
        if q_len is None and kwargs.get("cache_position") is not None:
            q_len = kwargs["cache_position"].shape[0]
        plain = kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        if q_len == 1 and plain and kwargs.get("allow_is_causal_skip", True):
            return None
    return sdpa_mask(*args, **kwargs)


def visibility(
    attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device
) -> torch.Tensor:
    """[B, Q, N] bool: which cached keys each new query may see (causal past, padding removed)."""
    if attention_mask is None:
        if q_len == 1:  # the one new query sees every cached key
            return torch.ones(1, 1, 1, dtype=torch.bool, device=device).expand(batch, 1, kv_len)
        query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        causal = torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]
        return causal[None].expand(batch, -1, -1)
    mask = attention_mask[:, 0, -q_len:, :kv_len]
    if mask.dtype != torch.bool:
        mask = mask == 0  # additive float mask: 0 = attend, -inf/min = masked
    return mask.expand(batch, -1, -1)


def prompt_key_mask(attention_mask: torch.Tensor | None, num_keys: int) -> torch.Tensor | None:
    """[B, N] bool: the prompt's real tokens (what its last query sees); None when there is no padding."""
    if attention_mask is None:
        return None
    row = attention_mask[:, 0, -1, :num_keys]
    return row if row.dtype == torch.bool else row == 0


def forced_tokens(visible: torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """The first `sink` and last `local` visible tokens of each query row."""
    if sink == 0 and local == 0:
        return torch.zeros_like(visible)
    rank = visible.cumsum(-1)  # 1-based among visible tokens
    count = rank[..., -1:]
    return visible & ((rank <= sink) | (rank > count - local))


def token_budgets(config: SparseConfig, visible: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """[B, Q] tokens to keep: the budget rule (`sparsekv.budget`) for the visible count, never fewer than the
    forced tokens (these are visible, so the count stays within the visible tokens)."""
    return torch.maximum(budget_tokens_tensor(config.budget, visible.sum(-1)), forced.sum(-1))


def step_hints(
    config: SparseConfig, attention_mask: torch.Tensor | None, q_len: int, num_keys: int
) -> StepHints:
    """Host-side facts of a decode step: an upper bound of the budgets (a row never sees more than the cache),
    and whether every row sees the whole cache (no mask and one query: transformers drops an all-ones mask)."""
    bound = host_budget(config, num_keys)
    uniform = attention_mask is None and q_len == 1
    return StepHints(max_budget=bound, uniform=uniform, sink=config.sink, local=config.local)


# opaque to torch.compile: the selectors keep Python state (lengths, buffers) that changes every step, and traced
# into a compiled model it would recompile every step; the graph breaks here and the rest of the layer compiles
@torch.compiler.disable
def sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    runtime: SparseRuntime | None = getattr(module, RUNTIME_ATTR, None)
    cache = runtime.cache if runtime is not None else None
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if layer is not None and layer.selector is not None and layer.keys is not key and runtime.in_forward:
        # the model was handed the SparseCache but attends over other K/V: decoding on would be silently dense
        raise CacheBypassedError(
            f"layer {module.layer_idx} attends over K/V that are not the SparseCache's: this transformers release "
            f"passes the cache in a way sparsekv does not handle ({supported_range()} are supported)"
        )
    if layer is not None and layer.fixed_position is not None and layer.keys is key:
        return _decode_fixed_shape(module, query, key, value, scaling, cache, layer)
    if layer is None or layer.keys is not key:
        # not ours (no cache / a forward of another module): plain SDPA, what the model would do
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if layer.selector is None:  # a dense layer of the SparseCache
        if layer.dense_from is not None and key.shape[2] > layer.dense_from and cache.record_stats:
            _record_dense_fallback(cache, layer, module.layer_idx, query, key, attention_mask)
        info = cache.infos[module.layer_idx]
        if info.sliding and info.window is not None and attention_mask is not None:
            return _window_attention(module, query, key, value, attention_mask, info.window, dropout, scaling,
                                     **kwargs)  # fmt: skip
        return _dense_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    if not layer.prompt_open:
        return _decode(module, query, key, value, attention_mask, scaling, cache, layer, layer.new_tokens)
    # the prompt (whole, or one of its chunks) attends densely; the selector sees it once it is complete
    past_prompt = cache.tokens_past_prompt(layer)
    if not past_prompt:
        if layer.prompt_stored:
            out = _stored_prompt_attention(module, query, layer, attention_mask, dropout, scaling, **kwargs)
        else:
            out = _dense_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        key_mask = prompt_key_mask(attention_mask, key.shape[2])
        layer.prompt_chunk_attended(key, value, query, key_mask, cache.prompt_ends(layer))
        return out
    # the forward runs past the prompt's end (assisted generation and prompt lookup send the prompt with their
    # first candidates): its prompt queries attend densely, the rest decodes as it would in later forwards
    if layer.selector.stores_kv:
        raise ConfigError(
            f"{layer.selector.name} compresses the prompt when it ends, so a forward must not run past it; feed the "
            "prompt alone first"
        )
    q_prompt, n_prompt = query.shape[2] - past_prompt, key.shape[2] - past_prompt
    mask = None if attention_mask is None else attention_mask[:, :, :q_prompt, :n_prompt]
    head, _ = sdpa_attention_forward(module, query[:, :, :q_prompt], key[:, :, :n_prompt], value[:, :, :n_prompt],
                                     mask, dropout, scaling, **kwargs)  # fmt: skip
    prompt_queries = layer.prompt_queries(query[:, :, :q_prompt])
    layer.finish_prompt(key[:, :, :n_prompt], value[:, :, :n_prompt], prompt_queries, prompt_key_mask(mask, n_prompt))
    tail, _ = _decode(module, query[:, :, q_prompt:], key, value, attention_mask, scaling, cache, layer, past_prompt)
    return torch.cat([head, tail], dim=1), None


def _record_dense_fallback(cache: SparseCache, layer, layer_idx: int, query, key, attention_mask) -> None:
    """The stats of a forward of a layer that gave up its compressing selector (`SparseLayer.dense_from`): every
    visible token of each row of its queries past the prompt."""
    batch, heads, q_len, _ = query.shape
    visible = visibility(attention_mask, batch, q_len, key.shape[2], key.device)
    past_prompt = min(q_len, key.shape[2] - layer.dense_from)
    rows = key.shape[1] if cache.config.gqa == "group" else heads
    cache.stats.record_all_visible(layer_idx, visible[:, q_len - past_prompt :], rows)


def _stored_prompt_attention(module, query, layer, attention_mask, dropout, scaling, **kwargs):
    """A chunk of a prompt that a compressing selector stores chunk by chunk attends densely over the earlier
    chunks as stored, one sequence at a time (`SparseLayer.stored_prompt_row`): their dequantized K/V exist for one
    row at a time, not for the batch."""
    return _row_by_row(module, query, layer.stored_prompt_row, attention_mask, dropout, scaling, **kwargs)


def _dense_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """Transformers' SDPA, one sequence at a time for a prompt chunk after the first of a batch: with a mask (such
    a chunk has one) SDPA copies the K/V of every earlier token once per query head of a GQA group, and for the
    whole batch that transient copy is several times a compressed cache (the sequences a GPU serves would be set by
    the prefill, not by the cache); for one row it is a constant. Each row's result is what the batch gives it."""
    batch, _, queries, _ = query.shape
    if batch == 1 or attention_mask is None or queries == 1 or key.shape[2] == queries:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def row_kv(row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return key[row : row + 1], value[row : row + 1]

    return _row_by_row(module, query, row_kv, attention_mask, dropout, scaling, **kwargs)


def _window_attention(module, query, key, value, attention_mask, window: int, dropout, scaling, **kwargs):
    """A sliding-window layer's forward with a mask (a prompt chunk after the first, an eager step of a padded
    batch): SDPA over the keys from the earliest query's window on, for the whole batch at once. Transformers'
    window counts the cached slots, so no query sees a key before that one: the result is the whole mask's, but
    the work and SDPA's transient K/V copy stop growing with the prompt (chunk + window keys a row, where the rows
    of `_dense_attention` would read every earlier token)."""
    first = max(0, key.shape[2] - query.shape[2] - window + 1)
    return sdpa_attention_forward(module, query, key[:, :, first:], value[:, :, first:],
                                  attention_mask[..., first : key.shape[2]], dropout, scaling, **kwargs)  # fmt: skip


def _row_by_row(module, query, row_kv, attention_mask, dropout, scaling, **kwargs):
    """SDPA of each batch row alone: row_kv(row) -> its K/V [1, Hkv, N, d]; a mask shared by every row (batch
    dim 1) serves each."""
    rows = []
    for row in range(query.shape[0]):
        keys, values = row_kv(row)
        shared = attention_mask is None or attention_mask.shape[0] == 1
        mask = attention_mask if shared else attention_mask[row : row + 1]
        rows.append(sdpa_attention_forward(module, query[row : row + 1], keys, values, mask, dropout, scaling,
                                           **kwargs)[0])  # fmt: skip
    return torch.cat(rows), None


def _decode(module, query, key, value, attention_mask, scaling, cache: SparseCache, layer, new_tokens: int):
    """Sparse attention of the queries of `new_tokens` tokens past the prompt (the last `new_tokens` keys)."""
    selector, pruner = layer.selector, layer.pruner
    new_keys, new_values = key[..., -new_tokens:, :], value[..., -new_tokens:, :]
    selector.append(new_keys, new_values)
    if pruner is not None:
        pruner.append(new_keys, new_values)
    if cache.attend_densely:
        # a verification forward of lossless decoding: exact attention; the state still follows the cache
        if layer.stores_kv:
            raise ConfigError(
                f"{selector.name} keeps only its compressed K/V, so it cannot verify densely: lossless decoding keeps "
                "the 16-bit K/V beside it (`lossless=True`)"
            )
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
    config = cache.config
    batch, _, q_len, _ = query.shape
    num_keys = key.shape[2]
    hints = step_hints(config, attention_mask, q_len, num_keys)
    # built on first read (functools.cache keeps one copy): the fused device paths of a uniform step never read
    # them, so their ~10 small kernels run only where a selector needs them
    visible = functools.cache(lambda: visibility(attention_mask, batch, q_len, num_keys, key.device))
    forced = functools.cache(lambda: forced_tokens(visible(), config.sink, config.local))
    if hints.uniform and key.device.type != "cpu":
        # every row keeps the same host-known count: one fill instead of a reduction over the visible mask
        budgets = lambda: torch.full((batch, q_len), hints.max_budget, dtype=torch.long, device=key.device)
    else:
        budgets = lambda: token_budgets(config, visible(), forced())
    step = DecodeStep(query, key, value, visible, forced, budgets, selector.layer, config.gqa, hints)
    selection = selector.select(step)
    if cache.decodes_densely(batch * num_keys):
        # the dense fallback (`SparseConfig.dense_below`); the selection above brought the method's state up to date
        if cache.record_stats:
            cache.stats.record_all_visible(module.layer_idx, step.visible, selection.indices.shape[1])
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
    if pruner is not None:
        selection = pruner.prune(step, selection)
    if cache.record_stats:
        cache.stats.record(module.layer_idx, selection, step.visible)
    scale = scaling if scaling is not None else selector.layer.scaling
    out = selector.attend(step, selection, scale)
    return out.transpose(1, 2).contiguous(), None


def _fixed_step_masks(cache: SparseCache, batch: int, q_len: int) -> dict:
    """What every layer of a fixed-shape step shares, built once per step: the visible slots [B, Q, capacity] and the
    budgets [B, Q], as expanded views of one row per batch row (or of one row for all: an unpadded batch), the
    forced slots as a function that builds them on first read (streaming's step never does), and how many slots
    hold tokens ("written", [1]). A row's visible count comes from its slot positions, not from a pass over its
    slots (H200, Gemma 3 270M at 32K x B192: three sums over [B, capacity], 48 us a draft step)."""
    shared = cache.fixed_step
    if "visible" not in shared:
        config = cache.config
        visible = cache.fixed_visible  # [1 or B, 1, capacity]
        if cache.fixed_kept is None:  # every slot up to the step's own holds a token
            count = (cache.fixed_position + 1).view(1, 1)
        else:  # a kept slot's position counts its row's kept slots before it; the step's own slot is kept
            own = cache.fixed_position.view(1, 1).expand(visible.shape[0], 1)
            count = cache.fixed_positions.gather(-1, own).long() + 1
        # the forced tokens are the first `sink` and last `local` visible ones: min(count, sink + local) of them
        budgets = torch.maximum(budget_tokens_tensor(config.budget, count), count.clamp(max=config.sink + config.local))
        forced = functools.cache(lambda: forced_tokens(visible, config.sink, config.local))
        shared.update(visible=visible, forced=forced, budgets=budgets)
        _written(cache, 1)  # stored as "written"
    visible, forced = shared["visible"], shared["forced"]
    return {"visible": visible.expand(batch, q_len, -1), "budgets": shared["budgets"].expand(batch, q_len),
            "forced": lambda: forced().expand(batch, q_len, -1), "written": shared["written"]}


def _fixed_stats(cache: SparseCache, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`BudgetStats.fixed_step_stats` of the step in flight for `rows` selection rows, built once per step."""
    name = f"stats{rows}"
    if name not in cache.fixed_step:
        cache.fixed_step[name] = cache.stats.fixed_step_stats(cache.fixed_step["written"], rows)
    return cache.fixed_step[name]


def _window_start(cache: SparseCache, batch: int, q_len: int, window: int) -> torch.Tensor:
    """The first slot that each of a fixed-shape forward's `q_len` queries sees in a sliding-window layer (the last
    `window` positions of its row, its own included), where that query's reads of the buffer start: the layer then
    reads its window, not every written slot (H200, Gemma 3 270M at 32K x B16: a sliding layer's dense step took as
    long as a global layer's). [1] where every row and query share it (one new token of an unpadded batch: slot =
    position), else [batch, Q] (`sparse_attention`'s `start`). In lossless rounds a row's masked slots hold no position
    (`SparseCache.fixed_positions`), so its window reaches back over as many slots as it masked. Built once per
    step and window."""
    shared = cache.fixed_step
    name = f"start{q_len}:{window}"
    if name not in shared:
        slots = fixed_slots(cache.fixed_position, q_len)  # [Q]: the queries' own slots
        if cache.fixed_kept is None:  # slot = position
            first = (slots - window + 1).clamp(min=0)
            shared[name] = first if q_len == 1 else first.view(1, q_len).expand(batch, -1)
        else:  # a row's positions never decrease along its slots: its window starts past those <= its own - window
            positions = cache.fixed_positions  # [B, capacity]
            queries = positions.index_select(-1, slots)  # [B, Q]
            shared[name] = torch.searchsorted(positions, queries - window, right=True, out_int32=True)
    return shared[name]


def _row_stats(cache: SparseCache, visible: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`BudgetStats.row_step_stats` of the row-masked step in flight, built once per step."""
    name = f"rowstats{heads}"
    if name not in cache.fixed_step:
        cache.fixed_step[name] = cache.stats.row_step_stats(visible, heads)
    return cache.fixed_step[name]


def _written(cache: SparseCache, q_len: int) -> torch.Tensor:
    """[1]: the slots written once a fixed-shape forward of `q_len` tokens has stored its own, where its dense
    reads of the buffer stop (`sparse_attention`'s limit): a buffer preallocated for the whole generation is
    read as far as it is filled. Built once per step."""
    name = "written" if q_len == 1 else f"written{q_len}"
    if name not in cache.fixed_step:
        cache.fixed_step[name] = cache.fixed_position + q_len
    return cache.fixed_step[name]


def _dense_tickets(cache: SparseCache, query: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The split-K kernel's tickets for a dense layer's decode step at fixed shapes (one per batch row and kv head):
    its rows' last splits merge the partials, one launch fewer a layer. (A verification's packed queries merge in
    the combine kernel: the last split's tile of G x Q rows would weigh on the whole kernel.) One buffer, made
    outside CUDA graph capture (`graph_decode.capture` runs the step once before it captures) and kept while the
    fixed-shape steps last: the kernel leaves it at zero, and every replay reads the same one. None off CUDA and
    for several queries."""
    if query.device.type != "cuda" or query.shape[2] != 1:
        return None
    rows = query.shape[0] * heads
    tickets = cache.fixed_tickets.get(rows)
    if tickets is None and not torch.cuda.is_current_stream_capturing():
        tickets = cache.fixed_tickets[rows] = torch.zeros(rows, dtype=torch.int32, device=query.device)
    return tickets


def _listed_slots(cache: SparseCache, batch: int, heads: int, q_len: int) -> torch.Tensor:
    """Every slot of the buffer as an index list [B, Hkv, Q, capacity] (an expanded view): a window's read from
    its `start` takes the list (H200, Gemma 3 270M's 512-slot window at B192: one query 44.8 us listed, 45.5 in
    order; a verification's 9 queries 76.1 against 82.2), the whole buffer's read none."""
    return cache.fixed_slots.view(1, 1, 1, -1).expand(batch, heads, q_len, -1)


def _buffer_attention(query, key, value, cache: SparseCache, scale: float, window: int | None) -> torch.Tensor:
    """Dense attention [B, Q, Hq, d] of a fixed-shape forward's Q new tokens over the preallocated buffer, through
    the split-K kernel: every written slot its row keeps (`fixed_kept`; none masked for an unpadded batch), query i
    reading none past its own slot (the written count: causality without a mask), a sliding-window layer (`window`)
    from each query's own window's first slot. A dense layer's decode step (Q = 1) and a lossless verification
    (Q = drafts + 1, dense in every layer) take it. The verification's Q queries of a row run side by side over the
    same slots, so its K/V come from memory about once (SDPA with a mask was twice a dense step: it copies K/V per
    query head, or reads them per query block), and one row of kept slots serves every query (H200, the embedded
    model's 9 queries over 8,448 written slots, B128: 414 us a layer with a mask row per query, 270 with one)."""
    batch, _, q_len, _ = query.shape
    heads = key.shape[1]
    kept = cache.fixed_kept
    seen = None if kept is None else kept[:, None, None, :].expand(batch, heads, q_len, -1)
    start = every = None  # the whole buffer: its slots in order (`sparse_attention` without an index list)
    if window is not None:  # a window read from its `start` takes the list (measured faster, `_listed_slots`)
        start = _window_start(cache, batch, q_len, window)
        every = _listed_slots(cache, batch, heads, q_len)
    out = sparse_attention(query, key, value, every, seen, scale, limit=_written(cache, q_len), causal=q_len > 1,
                           start=start, tickets=_dense_tickets(cache, query, heads))  # fmt: skip
    return out.transpose(1, 2).contiguous()


def _decode_fixed_shape(module, query, key, value, scaling, cache: SparseCache, layer):
    """One new token's attention over the whole preallocated buffer (`SparseCache.begin_fixed_shape`): which slots
    hold cached tokens comes from a device mask, budgets are device tensors under a host bound set by the buffer's
    capacity, and nothing reads the device back, so a CUDA graph of the step is valid at every position."""
    batch, _, q_len, _ = query.shape
    shared = _fixed_step_masks(cache, batch, q_len)
    visible = shared["visible"]  # [B, 1, capacity]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # the dense fallback (`SparseConfig.dense_below`) runs the dense step alone: the method's state and the stats
    # catch up once the fixed-shape steps end (`SparseCache.end_fixed_shape`)
    selector, pruner = (None, None) if cache.fixed_dense else (layer.selector, layer.pruner)
    slots = fixed_slots(cache.fixed_position, q_len)
    for state in (selector, pruner):
        if state is not None:
            state.append_fixed_shape(layer.new_keys, layer.new_values, slots)
    info = cache.infos[module.layer_idx]
    if cache.attend_densely and selector is not None:  # a lossless round's verification selects nothing
        selector.complete_append()
    if cache.attend_densely or selector is None:  # a verification, or a dense layer (a sliding one: its window)
        return _buffer_attention(query, key, value, cache, scale, info.window if info.sliding else None), None
    config = cache.config
    hints = StepHints(max_budget=host_budget(config, key.shape[2]), uniform=False, sink=config.sink,
                      local=config.local, fixed=True, min_budget=host_budget(config, cache.fixed_start + 1),
                      written=shared["written"], min_written=cache.fixed_start + 1, shared=cache.fixed_step)  # fmt: skip
    step = DecodeStep(query, key, value, visible, shared["forced"], shared["budgets"], selector.layer, config.gqa,
                      hints)  # fmt: skip
    # a selection made from the step's slots alone is the same in every layer of the step: made, masked and
    # counted once, each later layer adds the counted sums (one launch instead of about eight)
    same = ("selection", type(selector).__name__, info.window if info.sliding else None, key.shape[2])
    reused = cache.fixed_step.get(same) if selector.same_in_every_layer and pruner is None else None
    if reused is not None:
        selection, sums = reused
        if sums is not None:
            cache.stats.add_sums(module.layer_idx, sums)
        elif cache.record_stats:
            cache.host_counted[module.layer_idx] = selection.indices.shape[:-1].numel()
        return selector.attend(step, selection, scale).transpose(1, 2).contiguous(), None
    selection = selector.select(step)
    if cache.fixed_kept is not None:
        # rows of their own: a selector ranks every written slot, and the ones a row does not keep stay unread
        seen = visible[:, None].expand(-1, selection.indices.shape[1], -1, -1).gather(-1, selection.indices)
        selection = Selection(selection.indices, selection.valid & seen)
    if pruner is not None:
        selection = pruner.prune(step, selection)
    sums = None
    if cache.record_stats and cache.fixed_kept is not None:
        sums = cache.stats.row_sums(selection, *_row_stats(cache, visible, selection.indices.shape[1]))
    elif cache.record_stats and selection.exact_budgets:
        # every row attends its budget: the counts are known on the host (no kernels in the step)
        cache.host_counted[module.layer_idx] = selection.indices.shape[:-1].numel()
    elif cache.record_stats:
        sums = cache.stats.step_sums(selection, *_fixed_stats(cache, selection.indices.shape[:-1].numel()))
    if sums is not None:
        cache.stats.add_sums(module.layer_idx, sums)
    if selector.same_in_every_layer and pruner is None:
        cache.fixed_step[same] = (selection, sums)
    out = selector.attend(step, selection, scale)
    return out.transpose(1, 2).contiguous(), None
