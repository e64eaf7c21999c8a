"""SparseCache: a transformers `Cache` whose layers hold K/V plus that layer's selector state."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from sparsekv.config import ConfigError, SparseConfig
from sparsekv.kernels.write_slots import write_slots
from sparsekv.pruners.base import Pruner
from sparsekv.registry import get_method_class, get_top_p_pruner
from sparsekv.selectors.base import TokenSelector, host_budget, tensor_nbytes
from sparsekv.stats import BudgetStats
from sparsekv.step import LayerInfo

#: projections whose output holds a layer's keys (plain or fused): a colwise TP rule on one shards the heads
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def tensor_parallel_size(model) -> int:
    """How many ranks share each layer's heads: the TP degree of a model loaded with transformers' tensor
    parallelism (`from_pretrained(..., tp_plan="auto")`) whose plan shards the key projection, else 1."""
    tp = getattr(model, "tp_size", None) or 1
    plan = getattr(model, "tp_plan", None) or {}
    sharded = any(
        key.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and style == "colwise" for key, style in plan.items()
    )
    return tp if tp > 1 and sharded else 1


def tensor_parallel_rank(model, tp: int) -> int:
    """This process's place among the `tp` ranks that share each layer's heads (rank r holds the r-th share)."""
    if tp == 1:
        return 0
    mesh = getattr(model, "_device_mesh", None)  # transformers' TP mesh (1-D, or with a "tp" dimension)
    if mesh is not None:
        if mesh.ndim > 1:
            mesh = mesh["tp"]
        return mesh.get_local_rank()
    return torch.distributed.get_rank() % tp if torch.distributed.is_initialized() else 0


def layer_infos(model) -> list[LayerInfo]:
    """Each layer's shape as its attention sees it; under tensor parallelism, this rank's shard of the heads."""
    config = model.config.get_text_config(decoder=True)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    tp = tensor_parallel_size(model)
    if tp > 1:
        # each rank attends with its own heads and selects for them; a GQA group must stay on one rank
        if num_heads % tp or num_kv_heads % tp:
            raise ConfigError(
                f"sparse decoding under tensor parallelism needs the heads to divide by the TP size {tp}: this model "
                f"has {num_heads} query and {num_kv_heads} key/value heads (a GQA group must not be split across ranks)"
            )
        num_heads, num_kv_heads = num_heads // tp, num_kv_heads // tp
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    shard = tensor_parallel_rank(model, tp)
    return [
        LayerInfo(
            layer_idx=i,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            sliding=layer_types[i] == "sliding_attention",
            window=window if layer_types[i] == "sliding_attention" else None,
            shards=tp,
            shard=shard,
        )
        for i in range(config.num_hidden_layers)
    ]


def fixed_slots(position: torch.Tensor, tokens: int) -> torch.Tensor:
    """The slots [tokens] a fixed-shape forward of `tokens` new tokens writes, from the device position [1]."""
    return position if tokens == 1 else position + torch.arange(tokens, device=position.device)


class SparseLayer(DynamicLayer):
    """K/V in a buffer grown by doubling (appending one token is O(1), not a copy of the whole cache),
    plus the layer's selector (None on dense layers)."""

    def __init__(
        self,
        selector: TokenSelector | None,
        pruner: Pruner | None = None,
        initial_capacity: int = 0,
        keeps_plain: bool = False,
    ):
        super().__init__()
        self.selector = selector
        self.pruner = pruner
        self.initial_capacity = initial_capacity
        #: a compressing selector stores the tokens and the layer keeps its own 16-bit K/V beside them (lossless
        #: decoding: the drafts read the selector's storage, the dense verification the 16-bit K/V)
        self.keeps_plain = keeps_plain
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self.length = 0
        self.new_tokens = 0
        #: (sparse layers) the prompt is still coming in, in one forward or in chunks: attention is dense, the K/V
        #: stay plain, and the selector's state is built once, from the whole prompt, when it ends (`finish_prompt`;
        #: a compressing selector may store a long chunked prompt chunk by chunk instead: `prompt_stored`)
        self.prompt_open = True
        self.prompt_tokens = 0
        self._prompt_queries: torch.Tensor | None = None
        #: (compressing selectors) the prompt arrives in chunks and the selector stores it chunk by chunk
        #: (`TokenSelector.opens_prompt`): the layer holds no 16-bit K/V, later chunks attend over the stored ones
        self.prompt_stored = False
        #: the chunk (keys, values) of a stored prompt in flight (`_update_stored_prompt`)
        self.stored_prompt_chunk: tuple[torch.Tensor, torch.Tensor] | None = None
        #: fixed-shape decoding (`SparseCache.begin_fixed_shape`): the device position this step's token is written
        #: to; attention then sees the whole preallocated buffer and masks what lies past the position
        self.fixed_position: torch.Tensor | None = None
        #: the layer gave up its compressing selector for this generation (`SparseCache.settle_fallback`):
        #: the prompt's length, past which its tokens are counted as attended densely in the stats
        self.dense_from: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.fixed_position is not None:
            return self._update_fixed_shape(key_states, value_states)
        new = key_states.shape[-2]
        needed = self.length + new
        if self.selector is not None and self.selector.stores_kv and not self.prompt_open:
            self.selector.store(key_states, value_states)
            if not self.keeps_plain:
                self.length, self.new_tokens = needed, new
                self.keys = self.values = self._stand_in(self.length)
                return self.keys, self.values
        if self.prompt_stored:
            return self._update_stored_prompt(key_states, value_states)
        if self._key_buffer is None or needed > self._key_buffer.shape[-2]:
            # a compressing selector keeps the decode tokens itself: the 16-bit buffer only ever holds the prompt
            reserve = 0 if self.stores_kv else self.initial_capacity
            capacity = max(needed, reserve, 2 * (0 if self._key_buffer is None else self.length))
            self._key_buffer = self._grow(self._key_buffer, key_states, capacity)
            self._value_buffer = self._grow(self._value_buffer, value_states, capacity)
        self._key_buffer[..., self.length : needed, :] = key_states
        self._value_buffer[..., self.length : needed, :] = value_states
        self.length, self.new_tokens = needed, new
        self.keys = self._key_buffer[..., :needed, :]
        self.values = self._value_buffer[..., :needed, :]
        return self.keys, self.values

    def _update_stored_prompt(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A later chunk of a prompt stored chunk by chunk: held as `stored_prompt_chunk` while it attends densely
        over the earlier chunks as the selector stored them, one sequence at a time (`stored_prompt_row`);
        attention is handed a stand-in. The selector takes the chunk once it has attended
        (`prompt_chunk_attended`)."""
        self.stored_prompt_chunk = (key_states, value_states)
        self.length, self.new_tokens = self.length + key_states.shape[-2], key_states.shape[-2]
        self.keys = self.values = self._stand_in(self.length)
        return self.keys, self.values

    def stored_prompt_row(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [1, Hkv, length, d] of batch row `row` while a chunk of a stored prompt attends: the earlier
        chunks dequantized by the selector, then the chunk itself."""
        chunk_keys, chunk_values = self.stored_prompt_chunk
        _, h, new, d = chunk_keys.shape
        before = self.length - new
        keys = chunk_keys.new_empty(1, h, self.length, d)
        values = chunk_values.new_empty(1, h, self.length, d)
        self.selector.read_stored_into(keys[..., :before, :], values[..., :before, :], row=row)
        keys[..., before:, :] = chunk_keys[row : row + 1]
        values[..., before:, :] = chunk_values[row : row + 1]
        return keys, values

    def _update_fixed_shape(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The forward's tokens written from the device position on (one token a decode step; a lossless
        verification writes its drafts' slots again): no host value changes, so a CUDA graph can replay it. The
        host count (`length`) is advanced by `SparseCache.advance_fixed_shape` once the step has run."""
        new = key_states.shape[-2]
        if new != 1 and self.stores_kv:
            raise ConfigError("fixed-shape decoding of a compressing selector takes one new token per forward")
        if not self.stores_kv:  # a compressing selector writes the token itself (`append_fixed_shape`)
            slots = fixed_slots(self.fixed_position, new)
            write_slots(self._key_buffer, self._value_buffer, slots, key_states, value_states)
        self.new_tokens = new
        self.new_keys, self.new_values = key_states, value_states
        return self.keys, self.values

    def begin_fixed_shape(self, position: torch.Tensor, capacity: int, compiled: bool = False) -> None:
        """Hands attention the buffer's first `capacity` slots from now on, zeros past the cached tokens (masked
        slots must not hold NaN garbage: a zero attention weight times NaN is NaN)."""
        if not self.holds_prompt:
            raise ConfigError("fixed-shape decoding starts after the prompt")
        if self.stores_kv:
            self.keys = self.values = self._stand_in(capacity)
        else:
            if self._key_buffer.shape[-2] < capacity:
                self._key_buffer = self._grow(self._key_buffer, self._key_buffer, capacity)
                self._value_buffer = self._grow(self._value_buffer, self._value_buffer, capacity)
            self._key_buffer[..., self.length :, :].zero_()
            self._value_buffer[..., self.length :, :].zero_()
            self.keys = self._key_buffer[..., :capacity, :]
            self.values = self._value_buffer[..., :capacity, :]
        self.fixed_position = position
        for state in (self.selector, self.pruner):
            if state is not None:
                state.compiled_step = compiled
                state.begin_fixed_shape(capacity)

    def end_fixed_shape(self, unseen_from: int | None = None) -> None:
        """Back to ordinary decoding. `unseen_from`: the fixed-shape steps left the selector and pruner out (the
        dense fallback), so their state ends at that length and takes the later tokens in one `append`."""
        self.fixed_position = None
        self.new_keys = self.new_values = None
        if self.stores_kv:
            self.keys = self.values = self._stand_in(self.length)
        else:
            self.keys = self._key_buffer[..., : self.length, :]
            self.values = self._value_buffer[..., : self.length, :]
        for state in (self.selector, self.pruner):
            if state is None:
                continue
            if unseen_from is None:
                state.end_fixed_shape(self.length)
            else:
                state.end_fixed_shape(unseen_from)
                state.append(self.keys[..., unseen_from:, :], self.values[..., unseen_from:, :])

    @property
    def stores_kv(self) -> bool:
        """The layer's selector keeps the K/V itself (compressed caches): the layer holds no K/V buffer (unless it
        `keeps_plain` K/V beside them)."""
        return self.selector is not None and self.selector.stores_kv and not self.keeps_plain

    @property
    def holds_prompt(self) -> bool:
        """The whole prompt is cached (in the layer's buffer, or in a compressing selector's storage)."""
        if self.selector is not None and self.prompt_open:
            return False
        return self._key_buffer is not None or (self.stores_kv and self.keys is not None)

    def _stand_in(self, length: int) -> torch.Tensor:
        """What attention is handed as K and V when the selector keeps them (`TokenSelector.store`): [B, Hkv,
        length, 1], one element expanded, so that code reading the length off the keys sees `length`."""
        b, h = self.keys.shape[:2]
        return self.keys.new_zeros(1, 1, 1, 1).expand(b, h, length, 1)

    def get_seq_length(self) -> int:
        # the layer's own count: a compressing layer hands attention a stand-in for its K/V (`_stand_in`)
        return self.length

    def prompt_queries(self, query: torch.Tensor) -> torch.Tensor:
        """Adds a prompt chunk's queries [B, Hq, Q, d] to those kept from earlier chunks and returns them: what
        the selector's prefill reads (its `prompt_query_window` last prompt queries, or all of them)."""
        window = self.selector.prompt_query_window() if self.selector is not None else 0
        if self._prompt_queries is not None:
            query = torch.cat([self._prompt_queries, query], dim=2)
        if window is not None:
            # a copy: a view of the tail would keep the whole chunk's queries alive until the prompt ends
            query = query[:, :, query.shape[2] - min(window, query.shape[2]) :].clone()
        self._prompt_queries = query
        return query

    def prompt_chunk_attended(
        self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_mask: torch.Tensor | None, ends: bool
    ) -> None:
        """The prompt, or one of its chunks, has attended densely (key / value: every prompt token so far, query
        [B, Hq, Q, d]: the forward's, key_mask [B, N] or None); `ends`: it completes the prompt. A compressing
        selector may take a long prompt chunk by chunk from here (`TokenSelector.opens_prompt`); otherwise the
        prompt is held until it ends (`finish_prompt`)."""
        queries = self.prompt_queries(query)
        if self.prompt_stored:
            chunk_keys, chunk_values = self.stored_prompt_chunk
            self.stored_prompt_chunk = None
            self.selector.store_prompt_chunk(chunk_keys, chunk_values, query)
            if ends:
                self.selector.close_prompt(queries)
                self._close_prompt(self.length)
        elif ends:
            self.finish_prompt(key, value, queries, key_mask)
        elif self.stores_kv and self.selector.opens_prompt(key.shape[-2], key_mask):
            self.selector.open_prompt(key, value, queries, key_mask, capacity=self.initial_capacity)
            self.prompt_stored = True
            self._key_buffer = self._value_buffer = None
            self.keys = self.values = self._stand_in(self.length)

    def finish_prompt(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, key_mask: torch.Tensor | None
    ) -> None:
        """The prompt is complete: the selector (and pruner) build their state from all of its K/V and its last
        queries (`prompt_queries`); later tokens are decoded sparsely."""
        self.selector.prefill(keys, values, queries, key_mask=key_mask)
        if self.pruner is not None:
            self.pruner.prefill(keys, values, queries)
        self._close_prompt(keys.shape[-2])

    def _close_prompt(self, prompt_tokens: int) -> None:
        self.prompt_open = self.prompt_stored = False
        self.prompt_tokens = prompt_tokens
        self._prompt_queries = None
        if self.stores_kv:
            # the selector stored the prompt and keeps every later token itself: the 16-bit prompt is released
            # now, not at the first decode step
            self._key_buffer = self._value_buffer = None
            self.keys = self.values = self._stand_in(self.length)

    def _grow(self, buffer: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        grown = torch.empty(shape, dtype=like.dtype, device=like.device)
        if buffer is not None:
            grown[..., : self.length, :] = buffer[..., : self.length, :]
        return grown

    def reset(self) -> None:
        raise NotImplementedError("a SparseCache cannot be reset; create a new one")

    def crop(self, tokens: int) -> None:
        """Rolls the layer back: a negative `tokens` removes that many of the latest tokens, a positive one keeps
        the first `tokens` (transformers' two conventions). The selector's and pruner's state follow exactly;
        the prompt cannot be cut into."""
        keep = self.length + tokens if tokens <= 0 else min(tokens, self.length)
        if keep == self.length:
            return
        if self.selector is not None and (self.prompt_open or keep < self.prompt_tokens):
            raise ConfigError(
                f"a SparseCache can roll back decoded tokens only, not into its {self.prompt_tokens}-token prompt "
                f"(asked to keep {keep})"
            )
        for state in (self.selector, self.pruner):
            if state is self.selector and self.keeps_plain and state.stores_kv:
                state.crop_stored(keep, self.keys, self.values)
            elif state is not None:
                state.crop(keep)
        self.length, self.new_tokens = keep, 0
        # the K/V buffer (or a compressing selector's stand-in view) simply ends earlier; later writes overwrite
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "SparseCache does not support beam search or batch reordering (selector state would go stale); "
            "use greedy or sampling without beams"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class SparseCache(Cache):
    """One `SparseLayer` per decoder layer; sparse layers carry a fresh selector instance. `keeps_plain_kv`
    (lossless decoding): every layer keeps 16-bit K/V, also where a compressing selector stores the tokens."""

    def __init__(
        self,
        config: SparseConfig,
        infos: list[LayerInfo],
        initial_capacity: int = 0,
        prompt_length: int | None = None,
        keeps_plain_kv: bool = False,
    ):
        method = get_method_class(config.method)
        if infos:
            config.check_model(infos[0].num_layers)
        prunes = config.top_p is not None and not (method.consumes_top_p or method.dense)
        pruner_class = get_top_p_pruner() if prunes else None
        layers = []
        for info in infos:
            # a sliding-window layer reads its window whatever is selected: selecting there costs accuracy, saves nothing
            if method.dense or info.sliding or info.layer_idx in config.dense_layers:
                layers.append(SparseLayer(None, None, initial_capacity))
                continue
            selector = method(config, info, **config.options)
            pruner = pruner_class(config, info) if pruner_class else None
            layers.append(SparseLayer(selector, pruner, initial_capacity, keeps_plain=keeps_plain_kv))
        super().__init__(layers=layers)
        self.config = config
        self.infos = infos
        #: tokens of the prompt: forwards up to this length are prompt chunks (dense attention, plain K/V), the
        #: sparse steps start after it. None: the first forward is the whole prompt and every later forward (one
        #: token, or a chunk of new tokens as in evaluation) attends sparsely. `model.generate()` under
        #: `sparsekv.enabled` sets it, so that transformers' `prefill_chunk_size` prefills densely.
        self.prompt_length = prompt_length
        #: every later forward attends densely too (still extending the selectors' state): the verification
        #: forwards of lossless decoding
        self.attend_densely = False
        self.stats = BudgetStats(len(infos), shards=infos[0].shards if infos else 1)
        #: record tokens attended per decode step in `stats` (a few small kernels per sparse layer and step, none
        #: where a fixed-shape step's counts are known on the host)
        self.record_stats = True
        #: fixed-shape decoding (`begin_fixed_shape`): the step's write position [1] and which of the buffer's
        #: slots it sees [1, 1, capacity], both on the device and rewritten in place by `prepare_fixed_step`
        self.fixed_position: torch.Tensor | None = None
        self.fixed_visible: torch.Tensor | None = None
        #: fixed-shape decoding with rows of their own (`begin_fixed_shape(rows=...)`): which slots hold each
        #: row's real tokens [B, capacity] (padding and the drafts a row rejected in lossless rounds do not);
        #: `fixed_visible` is then [B, 1, capacity]
        self.fixed_kept: torch.Tensor | None = None
        #: ... and each slot's position in its row [B, capacity] int32 (`keep_slots`): a kept slot's position counts
        #: the row's kept slots before it, a masked one repeats the position before it
        self.fixed_positions: torch.Tensor | None = None
        self.fixed_slots: torch.Tensor | None = None  # arange(capacity)
        self.fixed_start = 0  # tokens cached when fixed-shape decoding began
        #: the dense fallback (`SparseConfig.dense_below`): decode steps over fewer cached tokens (over the batch)
        #: attend densely; set by `GraphDecode` for the generations it runs (0 elsewhere: evaluation)
        self.fallback_threshold = 0
        #: the fixed-shape steps attend densely: the fallback held when they began
        self.fixed_dense = False
        #: what every layer of the step in flight shares (built by the first layer that needs it, in the graph)
        self.fixed_step: dict[str, torch.Tensor] = {}
        #: fixed-shape decoding on CUDA: the split-K attention's tickets of the dense layers' calls, per number of
        #: rows (`attention._dense_tickets`), kept while the fixed-shape steps last (captured steps point at them)
        self.fixed_tickets: dict[int, torch.Tensor] = {}
        #: layer -> selection rows of the layers whose fixed-shape steps attend each row's budget exactly
        #: (`Selection.exact_budgets`): their stats are counted on the host when fixed-shape decoding ends
        self.host_counted: dict[int, int] = {}

    @torch.compiler.disable
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # opaque to torch.compile, like the attention function: lengths and buffers change every step
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # fixed-shape decoding --------------------------------------------------------------------------------------
    def fixed_shape_refusal(self, capacity: int) -> str | None:
        """Why this cache cannot decode with fixed shapes up to `capacity` tokens (None: it can)."""
        if self.attend_densely:
            return "verification forwards attend densely"
        if any(info.sliding and info.window is None for info in self.infos):
            return "a sliding-window layer whose window size the model's config does not give"
        for layer in self.layers:
            # the method first: a compressing selector (self-index) keeps no plain K/V buffer, which is not the reason
            if layer.selector is not None and not layer.selector.fixed_shape:
                return f"{layer.selector.name} has no fixed-shape decode step"
            if not layer.holds_prompt:
                return "the prompt has not been cached"
        if capacity <= self.layers[0].length:
            return f"no room: {self.layers[0].length} tokens cached, capacity {capacity}"
        return None

    def begin_fixed_shape(self, capacity: int, compiled: bool = False, rows: bool = False) -> None:
        """From now on every forward writes one token at `fixed_position` and attention sees the first `capacity`
        slots of each layer's buffer, masked by `fixed_visible`: the same shapes at every step, no host value
        read or written by the step, so one CUDA graph replays every step (`sparsekv.graph_decode`). `compiled`:
        the step's forward is compiled (`compile_step`), which the selectors are told (`compiled_step`).
        `rows`: each row sees its own slots (`fixed_kept`, all kept until changed), as lossless rounds need."""
        if (why := self.fixed_shape_refusal(capacity)) is not None:
            raise ConfigError(f"fixed-shape decoding is not available: {why}")
        keys = self.layers[0].keys  # the buffer's view, or a compressing selector's stand-in
        device = keys.device
        length = self.fixed_start = self.layers[0].length
        # the first step's keys; a compressing selector's layers decided before the prompt was cached
        fell_back = any(layer.dense_from is not None for layer in self.layers)
        self.fixed_dense = fell_back or self.decodes_densely((length + 1) * keys.shape[0])
        self.fixed_position = torch.full((1,), length, dtype=torch.long, device=device)
        self.fixed_slots = torch.arange(capacity, device=device)
        self.fixed_tickets = {}
        batch = keys.shape[0] if rows else 1
        self.fixed_visible = torch.zeros(batch, 1, capacity, dtype=torch.bool, device=device)
        self.fixed_kept = torch.ones(batch, capacity, dtype=torch.bool, device=device) if rows else None
        self.fixed_positions = self.fixed_slots.to(torch.int32).expand(batch, -1).clone() if rows else None
        self.stats.prepare_sums(device)
        self.host_counted = {}
        for layer in self.layers:
            layer.begin_fixed_shape(self.fixed_position, capacity, compiled)
        self.prepare_fixed_step()

    def settle_fallback(self, device_type: str, batch: int, prompt_tokens: int) -> None:
        """Sets the dense fallback (`SparseConfig.dense_below`) of the generation about to run on a `device_type`
        device, before its prompt is cached. A compressing selector (self-index) keeps no 16-bit K/V to attend
        densely over, so its fallback is decided here, once: where the batch's cached tokens at the first decode
        step fall below the threshold, its layers give it up for this generation and keep 16-bit K/V, as dense
        layers do."""
        self.fallback_threshold = self.config.fallback_threshold(device_type)
        if not self.decodes_densely((prompt_tokens + 1) * batch):
            return
        if any(layer.stores_kv and layer.selector is not None and layer.length > 0 for layer in self.layers):
            # its prompt is cached compressed already: nothing at 16 bits to attend densely over, so the method
            # decodes with its own step (a dense step would read the compressed layers' stand-in as K/V)
            self.fallback_threshold = 0
            return
        for layer in self.layers:
            if layer.stores_kv and layer.length == 0:
                layer.selector = layer.pruner = None
                layer.dense_from = prompt_tokens

    def decodes_densely(self, cached_tokens: int) -> bool:
        """Whether a decode step over `cached_tokens` keys (its own included, summed over the batch) takes the
        dense fallback."""
        return cached_tokens < self.fallback_threshold

    def keep_slots(self, start: int, kept: torch.Tensor) -> None:
        """Fixed-shape decoding with rows of their own: row i keeps kept[i, j] ([B, n] bool) of slots start + j,
        and the slot positions follow (in place: the captured steps read them). One scan a call, not one in
        every step (lossless rounds call it once a round)."""
        self.fixed_kept[:, start : start + kept.shape[1]] = kept
        torch.cumsum(self.fixed_kept, -1, dtype=torch.int32, out=self.fixed_positions)
        self.fixed_positions -= 1

    def prepare_fixed_step(self) -> None:
        """Points the step at its position (device ops only: a CUDA graph captures them with the step)."""
        if self.fixed_kept is None:
            torch.le(self.fixed_slots, self.fixed_position, out=self.fixed_visible[0, 0])
        else:
            torch.logical_and(self.fixed_kept, self.fixed_slots <= self.fixed_position, out=self.fixed_visible[:, 0])
        self.fixed_step = {}

    def advance_fixed_shape(self) -> None:
        """Host bookkeeping after a fixed-shape step ran (or was replayed): one more token in every layer."""
        for layer in self.layers:
            layer.length += 1

    def end_fixed_shape(self) -> None:
        """Back to ordinary (eager, growing) decoding; the cached tokens and every selector's state carry over."""
        if self.fixed_position is None:
            return
        if self.fixed_dense and self.record_stats:
            self._record_dense_steps()
        if self.record_stats:
            self._record_host_counted_steps()
        for layer in self.layers:
            layer.end_fixed_shape(self.fixed_start if self.fixed_dense else None)
        self.fixed_position = self.fixed_visible = self.fixed_slots = self.fixed_kept = self.fixed_positions = None

    def _record_dense_steps(self) -> None:
        """The stats of the dense fallback's fixed-shape steps: every visible token of each sparse layer's rows."""
        steps = self.layers[0].length - self.fixed_start
        for idx, (layer, info) in enumerate(zip(self.layers, self.infos)):
            if (layer.selector is not None or layer.dense_from is not None) and steps > 0:
                heads = info.num_kv_heads if self.config.gqa == "group" else info.num_heads
                rows = layer.keys.shape[0] * heads
                # step t sees fixed_start + t + 1 tokens
                seen = steps * (self.fixed_start + 1) + steps * (steps - 1) // 2
                self.stats.add_host(idx, kept=seen * rows, seen=seen * rows, fraction=steps * rows, rows=steps * rows)

    def _record_host_counted_steps(self) -> None:
        """The stats of the layers in `host_counted`: step t's rows saw fixed_start + t + 1 tokens and attended
        the budget of that many."""
        seen = range(self.fixed_start + 1, self.layers[0].length + 1)
        kept = [host_budget(self.config, n) for n in seen]
        totals = {"kept": sum(kept), "seen": sum(seen), "fraction": sum(b / n for b, n in zip(kept, seen))}
        for idx, rows in self.host_counted.items():
            self.stats.add_host(idx, **{name: total * rows for name, total in totals.items()}, rows=len(seen) * rows)
        self.host_counted = {}

    def crop(self, tokens_to_remove: int) -> None:
        # a rollback (assisted generation, prompt lookup, lossless decoding) is eager bookkeeping: the next decode
        # step starts fixed shapes again
        self.end_fixed_shape()
        super().crop(tokens_to_remove)

    def tokens_past_prompt(self, layer: SparseLayer) -> int:
        """Tokens of the forward in flight that lie past the prompt's end (0 unless its length is known)."""
        return 0 if self.prompt_length is None else max(0, layer.length - self.prompt_length)

    def prompt_ends(self, layer: SparseLayer) -> bool:
        """Whether the forward in flight completes the prompt of `layer` (called while its prompt is open)."""
        return self.prompt_length is None or layer.length >= self.prompt_length

    @classmethod
    def for_model(
        cls, model, config: SparseConfig, initial_capacity: int = 0, prompt_length: int | None = None,
        keeps_plain_kv: bool = False,
    ) -> SparseCache:  # fmt: skip
        return cls(config, layer_infos(model), initial_capacity, prompt_length, keeps_plain_kv)


def cache_memory(cache: SparseCache, capacity: bool = True) -> dict:
    """Measured bytes held by a SparseCache, per component and per token, against a bf16 dense cache of the same
    model and length (2 * head_dim * 2 bytes per token, kv-head and layer). Layers whose selector stores K/V
    itself (`memory_breakdown`, e.g. self-index) report their components, buffer capacity included; the others
    (dense layers, and the sparse layers of methods that keep plain K/V: counted as "dense_layers_kv") count
    their K/V buffers, selector metadata such as hash codes aside: the whole buffer, or with `capacity=False`
    only the tokens held (the doubling growth leaves up to half of a buffer unused)."""
    components: dict[str, int] = {}
    tokens = 0
    compressed_layers = dense_layers = 0
    compressed_bytes = 0
    kv_heads = head_dim = 0
    batch = 1
    for layer, info in zip(cache.layers, cache.infos):
        kv_heads, head_dim = info.num_kv_heads, info.head_dim
        selector = layer.selector
        keys, values = ("_key_buffer", "_value_buffer") if capacity else ("keys", "values")
        if selector is not None and hasattr(selector, "memory_breakdown"):
            parts = dict(selector.memory_breakdown())
            if layer.keeps_plain:  # lossless decoding: the 16-bit K/V its verification reads, beside the storage
                parts["verification_kv"] = tensor_nbytes(getattr(layer, keys, None)) + tensor_nbytes(
                    getattr(layer, values, None)
                )
            compressed_layers += 1
            compressed_bytes += sum(parts.values())
            tokens = max(tokens, selector.num_tokens)
            if selector.mu is not None:
                batch = selector.mu.shape[0]
        else:
            dense_layers += 1
            parts = {
                "dense_layers_kv": tensor_nbytes(getattr(layer, keys, None))
                + tensor_nbytes(getattr(layer, values, None))
            }
            tokens = max(tokens, getattr(layer, "length", 0))
            if getattr(layer, "_key_buffer", None) is not None:
                batch = layer._key_buffer.shape[0]
        for name, value in parts.items():
            components[name] = components.get(name, 0) + value
    units = max(1, tokens * batch * kv_heads)  # token x kv-head x sequence
    bf16_per_layer = 2 * head_dim * 2
    total = sum(components.values())
    layers = compressed_layers + dense_layers
    return {
        "tokens": tokens,
        "batch": batch,
        "layers": layers,
        "compressed_layers": compressed_layers,
        "dense_layers": dense_layers,
        "bytes_total": total,
        "bytes_per_token": total / max(1, tokens * batch),
        "dense_bf16_bytes_per_token": bf16_per_layer * kv_heads * layers,
        "ratio_vs_bf16": total / max(1, units * bf16_per_layer * layers),
        "compressed_layers_ratio_vs_bf16": (
            compressed_bytes / max(1, units * bf16_per_layer * compressed_layers)
            if compressed_layers
            else None
        ),
        "components": components,
        "components_bytes_per_token_per_kv_head_per_layer": {
            name: value / max(1, units * (compressed_layers if name != "dense_layers_kv" else dense_layers))
            for name, value in components.items()
            if value
        },
    }
