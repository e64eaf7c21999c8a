"""The contract between the decode pipeline and every token-selection method.

One selector instance lives in each sparse layer of a `SparseCache`, so its incremental state (bit codes, page
min/max, quantized keys...) is per layer and per generation. The pipeline calls, per layer:

    prefill(keys, values, query)     once, when the whole prompt is cached (attended densely, in one forward or in
                                     chunks); query = the prompt's last `prompt_query_window()` queries
    append(keys, values)             for each later batch of new tokens, before they are queried
    select(step) -> Selection        for the new queries; step.visible holds each query's own causal past

A simple method only implements `score` (higher = keep); the shared `select` handles budgets, sink/local tokens,
causality, padding and the GQA policy. A method with another selection rule (top-p, eviction) overrides `select`.
The step and the selection themselves (`DecodeStep`, `LayerInfo`, `StepHints`, `Selection`) are step.py's, which
the pruners share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import ClassVar

import torch

from sparsekv.budget import budget_tokens
from sparsekv.config import SparseConfig
from sparsekv.errors import ConfigError
from sparsekv.kernels.sparse_attention import sparse_attention
from sparsekv.step import DecodeStep, LayerInfo, Selection


def host_budget(config: SparseConfig, visible: int) -> int:
    """`attention.token_budgets` for one row that sees `visible` tokens (monotone in `visible`), on the host: the
    budget rule (`sparsekv.budget`), raised to the sink/local tokens the row is forced to keep."""
    return max(budget_tokens(config.budget, visible), min(visible, config.sink + config.local))


def tensor_nbytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor's elements (0 for None): the unit of a selector's `memory_breakdown` and `cache_memory`."""
    return 0 if t is None else t.numel() * t.element_size()


def to_selection_heads(scores: torch.Tensor, step: DecodeStep) -> torch.Tensor:
    """Brings [B, Hq|Hkv, Q, N] scores to the GQA policy's selection heads: group-sum or per-head repeat."""
    heads = scores.shape[1]
    layer = step.layer
    if heads == step.selection_heads:
        return scores
    if heads == layer.num_heads and step.gqa == "group":
        b, _, q, n = scores.shape
        return scores.view(b, layer.num_kv_heads, layer.group_size, q, n).sum(2)
    if heads == layer.num_kv_heads and step.gqa == "head":
        return scores.repeat_interleave(layer.group_size, dim=1)
    raise ValueError(f"scores have {heads} heads; expected {layer.num_heads} or {layer.num_kv_heads}")


def topk_selection(scores: torch.Tensor, step: DecodeStep) -> Selection:
    """Top-`budget` keys per row of `scores` among the visible ones, with forced tokens always in."""
    if step.uniform and scores.device.type != "cpu":
        return _uniform_topk(to_selection_heads(scores, step).float(), step)
    scores = to_selection_heads(scores, step).float()
    visible = step.visible[:, None]
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(step.forced[:, None], float("inf"))
    k_max = step.max_budget()
    values, indices = scores.topk(k_max, dim=-1, sorted=True)
    ranks = torch.arange(k_max, device=scores.device)
    valid = (ranks < step.budgets[:, None, :, None]) & (values > float("-inf"))
    return Selection(indices=indices, valid=valid)


#: torch.compile versions of the selectors' fixed-shape step pieces, one per function (`maybe_compiled`)
COMPILED: dict = {}


def maybe_compiled(fn, compiled: bool):
    """`fn`, or its torch.compile version: one per function, shared by every layer (the guards are on shapes and
    flags, which the layers share; a generation's steps all have the same shapes). A selector uses it for its
    fixed-shape step's tensor code when `compiled_step` is set (the attention function itself is left out of
    the model's compiled graph)."""
    if not compiled:
        return fn
    if fn not in COMPILED:
        COMPILED[fn] = torch.compile(fn, fullgraph=True)
    return COMPILED[fn]


def every_index(indices: torch.Tensor, exact_budgets: bool = False) -> Selection:
    """A selection whose entries are all valid; no mask tensor is made unless one is read."""
    return Selection(
        indices, lambda: torch.ones(indices.shape, dtype=torch.bool, device=indices.device), all_valid=True,
        exact_budgets=exact_budgets,
    )  # fmt: skip


def _all_keys(shape: tuple[int, ...], n: int, device) -> Selection:
    return every_index(torch.arange(n, device=device).expand(*shape, n).contiguous())


def _force(scores: torch.Tensor, sink: int, local: int, value, flipped: bool = False) -> torch.Tensor:
    """Sets the first `sink` and last `local` keys (of the unflipped order) to `value`, in place."""
    n = scores.shape[-1]
    head, tail = (local, sink) if flipped else (sink, local)
    if head:
        scores[..., :head] = value
    if tail:
        scores[..., n - tail :] = value
    return scores


def _uniform_topk(scores: torch.Tensor, step: DecodeStep) -> Selection:
    """Device path of `topk_selection` for uniform steps: no visibility mask, forced keys by slicing, k known on
    the host. The chosen set equals the CPU path's up to how torch.topk orders equal scores."""
    hints = step.hints
    n = scores.shape[-1]
    if hints.max_budget >= n:
        return _all_keys(scores.shape[:-1], n, scores.device)
    if hints.sink or hints.local:
        scores = _force(scores.clone(), hints.sink, hints.local, float("inf"))
    values, indices = scores.topk(hints.max_budget, dim=-1, sorted=False)
    return Selection(indices=indices, valid=values > float("-inf"))


def int_topk_selection(
    scores: torch.Tensor, step: DecodeStep, value_range: tuple[int, int]
) -> Selection | None:
    """Device fast path for integer scores in a known range [lo, hi], ties to the more recent key, forced first.

    Returns None where it does not apply (CPU, no Triton, or a step that is not `uniform`); the caller then runs
    its own rule. On uniform steps the chosen set equals the CPU rule (score, then position, forced on top): the
    scores are reversed along the keys, so the histogram select's deterministic rule among equal scores (lowest
    position first) picks the highest original positions, and forced keys score hi + 1. No host sync, no sort.
    """
    from sparsekv.kernels._triton import use_triton

    if scores.device.type == "cpu" or not step.uniform or not use_triton(scores):
        return None
    return _int_topk_core(scores, step, value_range)


def _int_topk_core(scores: torch.Tensor, step: DecodeStep, value_range: tuple[int, int]) -> Selection:
    """`int_topk_selection` without its guard (tests run it on CPU, where the op is its reference)."""
    from sparsekv.kernels.topk import select_topk

    hints = step.hints
    b, s, q, n = scores.shape
    if hints.max_budget >= n:
        return _all_keys((b, s, q), n, scores.device)
    lo, hi = value_range
    forced = bool(hints.sink or hints.local)
    top = hi + 1 if forced else hi
    small = -(2**15) <= lo and top < 2**15
    flipped = scores.flip(-1)
    flipped = flipped.to(torch.int16) if small else flipped.to(torch.int32)
    if forced:
        _force(flipped, hints.sink, hints.local, top, flipped=True)
    picked = select_topk(flipped, hints.max_budget, value_range=(lo, top))
    indices = (n - 1) - picked
    return every_index(indices)


def fixed_int_topk_selection(scores: torch.Tensor, step: DecodeStep, value_range: tuple[int, int]) -> Selection | None:
    """Device path of `hamming_topk`'s rule (score, then the more recent key, forced first) for fixed-shape steps.

    The sort-free histogram select picks the `max_budget` best keys of the buffer (unwritten slots score below
    every key, forced ones above); only those few are then sorted, and each row keeps its own budget of them —
    the same set as ranking the whole row. None off CUDA / Triton (the caller ranks the whole row)."""
    from sparsekv.kernels._triton import use_triton

    if scores.device.type == "cpu" or not use_triton(scores) or step.hints.max_budget >= scores.shape[-1]:
        return None
    return _fixed_int_topk_core(scores, step, value_range)


def _fixed_int_topk_core(scores: torch.Tensor, step: DecodeStep, value_range: tuple[int, int]) -> Selection:
    """`fixed_int_topk_selection` without its guard (tests run it on CPU, where the op is its reference)."""
    from sparsekv.kernels.topk import select_topk

    n, k = scores.shape[-1], step.hints.max_budget
    lo, hi = value_range
    # shifted to 1 + (0 .. hi - lo): unwritten slots rank 0, below every key, forced ones above every key
    lowest, top = 0, hi - lo + 2
    dtype = torch.int16 if top < 2**15 else torch.int32
    ranked = torch.where(step.visible[:, None], (scores - (lo - 1)).to(dtype), lowest)
    ranked = ranked.masked_fill(step.forced[:, None], top)
    # reversed along the keys: the select's ties go to the lowest position, i.e. the most recent key
    select = functools.partial(select_topk, ranked.flip(-1), k, value_range=(lowest, top))
    if (held := _held_picks(step, lambda counts: (n - 1) - select(counts=counts), scores.shape[:3])) is not None:
        return held
    picked = (n - 1) - select()
    return _keep_budgets(picked, ranked.gather(-1, picked), step)


def _held_picks(step: DecodeStep, select: Callable, rows: tuple[int, int, int]) -> Selection | None:
    """A fixed-shape step's selection where its picks are all held keys: every row keeps all `max_budget` picks
    (`StepHints.picks_only_held`: no mask), or each row its own budget of them, picked in the select itself
    (`StepHints.picks_held`: `select(counts)` puts row r's counts[r] best first). Either way each row keeps
    exactly its budget, so the stats are counted on the host. None where empty slots can be picked (the caller
    drops each row's surplus itself). rows: the selection's (B, S, Q)."""
    hints = step.hints
    if hints.picks_only_held():
        return every_index(select(None), exact_budgets=True)
    if hints.picks_held():
        counts, valid = row_counts(step, *rows, hints.max_budget)
        return Selection(select(counts), valid, exact_budgets=True)
    return None


def _keep_budgets(picked: torch.Tensor, picked_scores: torch.Tensor, step: DecodeStep) -> Selection:
    """The `max_budget` picks of a fixed-shape step [B, S, Q, k] and their ranking scores (0 = an empty slot)
    -> each row's own budget of them: a row whose budget is below k drops its k - budget last picks in the rule's
    order (score, then position). At most k - min_budget of them, so only that many are ranked."""
    k = picked.shape[-1]
    valid = picked_scores > 0
    surplus = k - (step.hints.min_budget if step.hints.min_budget is not None else 0)
    if surplus > 0:
        order_key = (picked_scores.to(torch.int64) << 32) | picked
        last = order_key.topk(min(surplus, k), dim=-1, largest=False, sorted=True).indices
        dropped = torch.arange(last.shape[-1], device=picked.device) < (k - step.budgets[:, None, :, None])
        valid = valid.scatter(-1, last, valid.gather(-1, last) & ~dropped)
    return Selection(indices=picked, valid=valid)


def fixed_hamming_selection(
    query_codes: Callable[[], torch.Tensor],
    key_codes: torch.Tensor,
    bits: int,
    step: DecodeStep,
    threshold_hints: RowBuffer | None = None,
) -> Selection | None:
    """`fused_hamming_selection` for fixed-shape steps: scoring (empty slots below every key, the local window
    at the written end), histogram and select fused in the Hamming kernels, then each row's budget. None where it
    does not apply (the caller runs its own rule); `query_codes` is called only when it does. `threshold_hints`:
    the selector's thresholds of its previous step (allocated by the run before a capture, which every replay
    then reads and rewrites)."""
    from sparsekv.kernels._triton import use_triton

    hints = step.hints
    if key_codes.device.type == "cpu" or hints is None or not hints.fixed or not use_triton(key_codes):
        return None
    if (step.gqa != "group" and step.layer.group_size > 1) or hints.max_budget >= key_codes.shape[2]:
        return None
    return _fixed_hamming_core(query_codes(), key_codes, bits, step, threshold_hints)


def _fixed_hamming_core(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    bits: int,
    step: DecodeStep,
    threshold_hints: RowBuffer | None = None,
) -> Selection:
    """`fixed_hamming_selection` without its guard (tests run it on CPU, where the op is its reference)."""
    from sparsekv.kernels.hamming import hamming_topk_fixed

    hints = step.hints
    k = hints.max_budget
    select = functools.partial(
        hamming_topk_fixed, query_codes, key_codes, k, hints.written, bits=bits, sink=hints.sink, local=hints.local,
        threshold_hint=_window_hint(threshold_hints, query_codes, key_codes),
    )  # fmt: skip
    rows = (query_codes.shape[0], key_codes.shape[1], query_codes.shape[2])
    if (held := _held_picks(step, lambda counts: select(with_scores=False, counts=counts)[0], rows)) is not None:
        return held
    return _keep_budgets(*select(), step)


def row_counts(step: DecodeStep, b: int, s: int, q: int, k: int, scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each selection row's budget x `scale` as int32 [B * S * Q] and the valid entries of its k picks [B, S, Q, k]
    (its first min(budget x scale, k)), shared by the layers of a fixed-shape step (`StepHints.shared`)."""
    shared = step.hints.shared if step.hints.shared is not None else {}
    key = ("row counts", b, s, q, k, scale)
    if key not in shared:
        # materialized (the kernels read counts[r] at counts_ptr + r, not through a stride-0 view)
        counts = (step.budgets * scale).clamp(max=k).to(torch.int32)[:, None, :].expand(b, s, q).contiguous().view(-1)
        shared[key] = counts, torch.arange(k, device=counts.device) < counts.view(b, s, q, 1)
    return shared[key]


# The threshold window pays off from about this many scored keys per step (H200, 2% budget: 128K x 64 rows and
# 1M x 8 rows gained 7-8 us a step; 32K x 64 and 128K x 8 rows lost 0.6-0.7 us to the extra launches)
WINDOW_MIN_KEYS = 1 << 22


class RowBuffer:
    """A selector's int32 buffer of one value per row that lives across its decode steps: each row's last Hamming
    top-k threshold (the fused select centres its first histogram on it: a speed hint, results never depend on
    it), or the split-K attention's tickets. Zeros when allocated, and allocated outside CUDA graph capture only
    (`get` is None while capturing before it exists), so a captured step reads and updates the same buffer on
    every replay."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self, rows: int, device: torch.device) -> torch.Tensor | None:
        buf = self.buffer
        if buf is None or buf.numel() != rows or buf.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self.buffer = buf = torch.zeros(rows, dtype=torch.int32, device=device)
        return buf


def fused_hamming_selection(
    query_codes: Callable[[], torch.Tensor],
    key_codes: torch.Tensor,
    bits: int,
    step: DecodeStep,
    hints: RowBuffer | None = None,
) -> Selection | None:
    """Device fast path of a Hamming top-k on a uniform step with group-summed GQA: scoring, sink/local forcing,
    ties to the more recent key and the sort-free select in the fused kernels (no score tensor round trips, no
    host sync). The chosen set is the CPU rule's. None where it does not apply (the caller runs its own rule);
    `query_codes` is called only when it does. `hints`: the selector's thresholds of its previous step."""
    from sparsekv.kernels._triton import use_triton

    if key_codes.device.type == "cpu" or not step.uniform or not use_triton(key_codes):
        return None
    if step.gqa != "group" and step.layer.group_size > 1:
        return None
    return _fused_hamming_core(query_codes(), key_codes, bits, step, hints)


def _fused_hamming_core(
    query_codes, key_codes, bits: int, step: DecodeStep, threshold_hints: RowBuffer | None = None
) -> Selection:
    """`fused_hamming_selection` without its guard (tests run it on CPU, where the op is its reference)."""
    from sparsekv.kernels.hamming import hamming_topk

    hints = step.hints
    b, _, q, _ = query_codes.shape
    n = key_codes.shape[2]
    if hints.max_budget >= n:
        return _all_keys((b, key_codes.shape[1], q), n, key_codes.device)
    indices = hamming_topk(
        query_codes,
        key_codes,
        hints.max_budget,
        bits=bits,
        recent_first=True,
        sink=hints.sink,
        local=hints.local,
        threshold_hint=_window_hint(threshold_hints, query_codes, key_codes),
    )
    return every_index(indices)


def _window_hint(
    threshold_hints: RowBuffer | None, query_codes: torch.Tensor, key_codes: torch.Tensor
) -> torch.Tensor | None:
    """The selector's per-row threshold buffer where the window pays (WINDOW_MIN_KEYS scored keys), else None."""
    rows = query_codes.shape[0] * key_codes.shape[1] * query_codes.shape[2]
    if threshold_hints is None or rows * key_codes.shape[2] < WINDOW_MIN_KEYS:
        return None
    return threshold_hints.get(rows, key_codes.device)


@dataclass
class TokenSelector:
    """Base class of every method. Subclasses are dataclasses; their extra fields are the method's options."""

    config: SparseConfig
    layer: LayerInfo
    #: the split-K attention's per-row counters (`attention_tickets`)
    split_tickets: RowBuffer = field(default_factory=RowBuffer, init=False, repr=False, compare=False)

    name: ClassVar[str] = ""
    #: attend densely, no selection (the `dense` method)
    dense: ClassVar[bool] = False
    #: the budget when the config leaves it unset
    default_budget: ClassVar[int | float] = 0.1
    #: the method applies config.top_p itself (otherwise top_p adds the Twilight pruner after it)
    consumes_top_p: ClassVar[bool] = False
    #: the method keeps K/V itself (compressed caches): SparseLayer.update calls `store`, attention calls `attend`
    stores_kv: ClassVar[bool] = False
    #: the method rewrites the prompt before decoding (`filter_prompt`, GemFilter), which needs its own entry point
    rewrites_prompt: ClassVar[bool] = False
    #: the option that a given `budget` sets, for a method whose budget is not per decode step (GemFilter: keep)
    budget_option: ClassVar[str | None] = None
    #: the method has a fixed-shape decode step (`append_fixed_shape`, and a `select` that reads no host value of
    #: the device): one CUDA graph then replays every decode step of `model.generate()` (`sparsekv.graph_decode`)
    fixed_shape: ClassVar[bool] = False
    #: its fixed-shape state holds one entry per cache slot, written by `append_fixed_shape` for one or several
    #: slots at once: writing a slot again replaces the entry, so lossless rounds may draft into slots that their
    #: verification rewrites (`sparsekv.lossless.CapturedRounds`)
    slot_state: ClassVar[bool] = False
    #: its fixed-shape selection depends on the step's slots and budgets alone (no layer's keys or state): one
    #: layer makes it and the step's other layers attend over the same one
    same_in_every_layer: ClassVar[bool] = False
    #: set by `SparseCache.begin_fixed_shape`: the fixed-shape steps run compiled (`compile_step=True`)
    compiled_step: bool = field(default=False, init=False, repr=False, compare=False)
    #: the dense fallback's default (`SparseConfig.dense_below`): cached tokens over the batch below which this
    #: method's captured step was measured slower than the captured dense step (`sparsekv bench generate`, H200)
    dense_below: ClassVar[int] = 0

    @classmethod
    def check_model(cls, model, config: SparseConfig) -> None:
        """Raises ConfigError when the method cannot run on `model` (called by `enable`), e.g. a checkpoint
        made for another model."""

    @classmethod
    def filter_prompt(
        cls, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: SparseConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill methods (GemFilter) shorten the prompt before generation; the default keeps it."""
        return input_ids, attention_mask

    @classmethod
    def check_config(cls, config: SparseConfig) -> None:
        """Raises ConfigError for configs this method cannot run (called when the config is built)."""

    @classmethod
    def option_fields(cls) -> dict[str, Field]:
        """The method's options: its init fields beyond the ones every selector has (`registry.method_options`)."""
        shared = {f.name for f in fields(TokenSelector)}
        return {f.name: f for f in fields(cls) if f.name not in shared and f.init}

    @classmethod
    def effective_options(cls, config: SparseConfig) -> dict:
        """What a run of `config` uses for each option: the given value, else the method's default."""
        values = {}
        for name, option in cls.option_fields().items():
            if name in config.options:
                values[name] = config.options[name]
            elif option.default is not MISSING:
                values[name] = option.default
            elif option.default_factory is not MISSING:
                values[name] = option.default_factory()
        return values

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        """Builds the state from the prompt's keys/values (and queries, for methods that look at attention).

        key_mask: [B, N] bool, False on left padding (None: no padding)."""

    def crop(self, length: int) -> None:
        """Rolls the state back to the first `length` cached tokens (never into the prompt): what lossless decoding,
        assisted generation and prompt lookup need. A method whose state cannot go back says so."""
        raise ConfigError(
            f"{self.name} keeps state that cannot be rolled back, so lossless decoding, assisted generation and "
            "prompt lookup are not available with it"
        )

    def crop_stored(self, length: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`crop` of a `stores_kv` method decoding beside the cache's own 16-bit K/V (lossless decoding), with the
        cached tokens' K/V (keys / values [B, Hkv, >= length, d]) to rebuild its storage from."""
        raise ConfigError(
            f"{self.name} keeps state that cannot be rolled back, so lossless decoding is not available with it"
        )

    def prompt_query_window(self) -> int | None:
        """How many of the prompt's last queries `prefill` reads (None: all of them). A prompt fed in chunks keeps
        only these between chunks; the others are never stored."""
        return 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Extends the state with newly cached tokens."""

    def begin_fixed_shape(self, capacity: int) -> None:
        """Fixed-shape decoding starts (`fixed_shape` methods): make room for `capacity` tokens in the state, once.
        Until `end_fixed_shape`, steps see the whole capacity (`step.visible` masks the slots not yet written).
        `compiled_step` is set before: the step is compiled (`compile_step=True`), so a method may run its own
        tensor code through torch.compile too."""

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        """`append` of one token at a device position [1] (no host count changes: a CUDA graph replays it). A
        method may leave part of it to the step's `select` (spotlight hashes the new keys with the query)."""

    def complete_append(self) -> None:
        """Finishes what `append_fixed_shape` left to `select`, for a step that will not select (a verification
        forward attends densely): a CUDA graph replays only what its own step ran."""

    def end_fixed_shape(self, length: int) -> None:
        """Fixed-shape decoding ends with `length` tokens cached: the host counts catch up."""

    def score(self, step: DecodeStep) -> torch.Tensor:
        """[B, Hq or Hkv, Q, N] importance of each key for each query (higher = keep)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() or select()")

    def select(self, step: DecodeStep) -> Selection:
        return topk_selection(self.score(step), step)

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """For `stores_kv` methods: keeps the new tokens [B, Hkv, T, d] of a decode forward (the prompt's come
        through `prefill`). `attend` reads the method's own storage; the cache layer hands attention a stand-in of
        the cached length as its K/V (`SparseLayer._stand_in`)."""
        raise NotImplementedError

    # a `stores_kv` method may store a chunked prompt chunk by chunk (never the whole prompt at 16-bit): `opens_prompt`
    # says when the chunks held so far suffice, `open_prompt` takes them, `store_prompt_chunk` each later one,
    # `close_prompt` the end; later chunks attend over `read_stored_into`, one sequence at a time. The default
    # holds the whole prompt and stores it when it ends (`prefill`).

    def opens_prompt(self, held: int, key_mask: torch.Tensor | None) -> bool:
        """Whether to start storing a chunked prompt with the `held` tokens cached so far (key_mask [B, held])."""
        return False

    def open_prompt(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    key_mask: torch.Tensor | None, capacity: int = 0) -> None:  # fmt: skip
        """`capacity`: the tokens the generation will hold, when known (0: unknown)."""
        raise NotImplementedError

    def store_prompt_chunk(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
        raise NotImplementedError

    def close_prompt(self, query: torch.Tensor) -> None:
        raise NotImplementedError

    def read_stored_into(self, keys: torch.Tensor, values: torch.Tensor, row: int | None = None) -> None:
        raise NotImplementedError

    def attend(self, step: DecodeStep, selection: Selection, scaling: float) -> torch.Tensor:
        """[B, Hq, Q, d] attention of the queries over their selected tokens."""
        valid = None if selection.all_valid else selection.valid
        return sparse_attention(step.query, step.keys, step.values, selection.indices, valid, scaling,
                                tickets=self.attention_tickets(selection, step.query.device))  # fmt: skip

    def attention_tickets(self, selection: Selection, device: torch.device) -> torch.Tensor | None:
        """The split-K attention's per-row tickets on CUDA (one launch fewer per step), else None."""
        if device.type != "cuda":
            return None
        b, s, q, _ = selection.indices.shape
        return self.split_tickets.get(b * s * q, device)
