"""The decode step a selection method sees (`DecodeStep`, with its layer's shape `LayerInfo` and the host's facts
`StepHints`) and what it returns (`Selection`): the types that the decode pipeline, the selectors and the pruners
share. The selectors' own contract (`TokenSelector`) and their shared selection rules are selectors/base.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import torch

from sparsekv.kernels.sparse_attention import selection_mask


@dataclass(frozen=True)
class LayerInfo:
    layer_idx: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    #: the layer attends within a sliding window (hybrid models such as Gemma 3): it keeps its native attention
    sliding: bool = False
    #: a sliding layer's window: each query sees the last `window` tokens, itself included (None: the model's
    #: config names none)
    window: int | None = None
    #: tensor parallelism: the heads above are this rank's share, number `shard` of `shards` equal ones
    shards: int = 1
    shard: int = 0

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_heads(self) -> slice:
        """This layer's key/value heads among the model's (all of them without tensor parallelism): what a
        per-head state made for the whole model (a trained hash, a channel calibration) is cut to."""
        return slice(self.shard * self.num_kv_heads, (self.shard + 1) * self.num_kv_heads)


class _OnDemand:
    """A dataclass tensor field that may also be given as a function of no arguments, called once, on first read.
    The fused device paths never read a uniform step's `visible` / `forced` / `budgets` (about ten small kernels:
    aranges, a cumsum over the cache length, compares, a fill) nor an all-valid selection's `valid`, so those
    kernels run only for the paths that read them."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, step, owner=None):
        if step is None:
            raise AttributeError(self.slot)  # tells dataclass that the field has no default
        value = step.__dict__[self.slot]
        if callable(value) and not isinstance(value, torch.Tensor):
            value = step.__dict__[self.slot] = value()
        return value

    def __set__(self, step, value) -> None:
        step.__dict__[self.slot] = value


@dataclass
class Selection:
    """Selected key positions, varlen per (batch, selection head, query) through `valid`.

    indices: [B, S, Q, K] int64 key positions; S = kv heads (gqa "group") or query heads (gqa "head").
    valid:   [B, S, Q, K] bool; padding entries are False and their index is meaningless (but in range).
    all_valid: every entry is valid (`every_index`): the attention kernels then read no mask, and `valid` is
             built only if something reads it.
    """

    indices: torch.Tensor
    valid: torch.Tensor = _OnDemand()
    all_valid: bool = False
    #: every row keeps exactly its step's budget (`DecodeStep.budgets`) of cached keys: what it attends is known
    #: on the host (fixed-shape steps then count their stats without kernels)
    exact_budgets: bool = False

    def counts(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def to_mask(self, num_keys: int) -> torch.Tensor:
        """[B, S, Q, N] bool mask of the selected keys."""
        return selection_mask(self.indices, self.valid, num_keys)


@dataclass
class DecodeStep:
    """Everything a selector sees for one attention call of new queries after the prefill.

    query:   [B, Hq, Q, d] post-RoPE queries; keys/values: [B, Hkv, N, d] the whole cache, new tokens included.
    visible: [B, Q, N] bool, each query's causal past without padding.
    forced:  [B, Q, N] bool, sink/local tokens that are always kept (subset of visible).
    budgets: [B, Q] int64 tokens to keep per query (forced included, never above the visible count).
    hints:   optional host-side facts about the step (the attention function sets them) so that the CUDA path
             never reads a device tensor back; CPU selection ignores them.

    visible, forced and budgets may be passed as functions of no arguments: they are built on first read.
    """

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor = _OnDemand()
    forced: torch.Tensor = _OnDemand()
    budgets: torch.Tensor = _OnDemand()
    layer: LayerInfo
    gqa: str
    hints: StepHints | None = None

    def replace(self, **changes) -> DecodeStep:
        """`dataclasses.replace` that leaves fields not yet built unbuilt (it would read, and so build, them)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"DecodeStep has no field {', '.join(sorted(unknown))}")
        step = copy.copy(self)
        for name, value in changes.items():
            setattr(step, name, value)
        return step

    @property
    def selection_heads(self) -> int:
        return self.layer.num_kv_heads if self.gqa == "group" else self.layer.num_heads

    def max_budget(self) -> int:
        """The largest entry of `budgets`, or on a device an upper bound of it known on the host (no sync)."""
        if self.hints is not None and self.query.device.type != "cpu":
            return self.hints.max_budget
        return int(self.budgets.max())

    @property
    def uniform(self) -> bool:
        """Every row sees all N keys and keeps `hints.max_budget`; forced = first `sink` and last `local` keys."""
        return self.hints is not None and self.hints.uniform


@dataclass(frozen=True)
class StepHints:
    """What the host knows about a decode step without reading the device.

    max_budget: >= every entry of `budgets` (== all of them when `uniform`).
    uniform: one query per row and no padding, so every row sees all N cached keys and keeps `max_budget`.
    sink / local: the config's forced tokens (for `uniform` steps: positions [0, sink) and [N - local, N)).
    """

    max_budget: int
    uniform: bool
    sink: int = 0
    local: int = 0
    #: a fixed-shape step (`SparseCache.begin_fixed_shape`): the keys are the whole preallocated buffer, `visible`
    #: masks the slots not yet written, `budgets` vary under `max_budget` (the budget of the whole buffer)
    fixed: bool = False
    #: <= every entry of `budgets` (None: unknown)
    min_budget: int | None = None
    #: fixed-shape steps: how many of the buffer's slots hold keys, int64 [1] on the device (every row: the batch
    #: is unpadded)
    written: torch.Tensor | None = None
    #: fixed-shape steps: <= `written` at every step of the run (the slots held when it began, plus the step's own)
    min_written: int | None = None
    #: fixed-shape steps: what every layer of the step shares (built by the first layer that needs it)
    shared: dict | None = None

    def picks_held(self) -> bool:
        """A fixed-shape step's `max_budget` best slots are all held keys: no step holds fewer keys than that
        (empty slots rank below every key), so a row's best `budgets` slots are its selection."""
        return self.fixed and self.min_written is not None and self.max_budget <= self.min_written

    def picks_only_held(self) -> bool:
        """`picks_held`, and every row keeps all `max_budget` picks (the budgets cannot differ from it): the
        selection is every pick, with no mask and no scores to read."""
        return self.picks_held() and self.min_budget == self.max_budget
