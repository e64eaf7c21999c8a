"""Twilight: a base selector at a conservative budget, then top-p pruning of its candidates (select-then-prune).

`SparseConfig(method="twilight", budget=0.25, top_p=0.95)` is the oracle-free default: LSH (1024-bit SimHash of
centred keys, training-free) picks budget tokens (1/4 of the context is the recommended, conservative budget), then
the INT4-estimated top-p pruner keeps the smallest subset with mass >= top_p per kv-head group (gqa="group") or
query head (gqa="head").

The same pruner runs after any other method with `top_p` set (e.g. `method="lsh", top_p=0.9`); `twilight` is that
pipeline with its own options (`base`, `bits`) and a default p.

The pruner can only drop candidates, so the candidates bound the quality. Measured on held-out literature (4K
windows, 512-token dense prefix, p = 0.95; results/twilight_bases_4k.md): over lsh@25% 1.022x dense keeping 146
tokens, over spotlight@25% 1.026x (135), over exact top-k@25% 1.021x (175), over quest@25% 1.061x (100); exact
top-p 0.95 over all tokens is 1.008x at 290 tokens. Quest's page-level candidates are the weakest (quest@25% alone
is already about 1.06x dense on the essays, results/twilight_ppl.md), so lsh, the best base that needs no
training, is the default.

A compressed cache (self-index) cannot be a base: its layers hold only the method's compressed K/V and hand
attention a stand-in, so twilight would have to keep K/V itself (feed its key copy from `store`, attend through the
base's store) for that base only, while lossless decoding decides from the method's class whether K/V are kept.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from sparsekv.config import ConfigError
from sparsekv.pruners.top_p import SUPPORTED_BITS, TopPPruner
from sparsekv.selectors.base import TokenSelector
from sparsekv.step import DecodeStep, Selection

DEFAULT_TOP_P = 0.95
DEFAULT_BASE = "lsh"
FALLBACK_BASE = "oracle-topk"


def resolve_base(name: str) -> str:
    """The base method actually used (the default falls back to oracle-topk if it is not in this build)."""
    from sparsekv.registry import METHODS

    if name == DEFAULT_BASE and name not in METHODS:
        warnings.warn(
            f"twilight: base method {DEFAULT_BASE!r} is not available in this build; using {FALLBACK_BASE!r}",
            stacklevel=3,
        )
        return FALLBACK_BASE
    return name


@dataclass
class TwilightSelector(TokenSelector):
    """Options: base = the candidate selector (a registered method with its own default options; default lsh),
    its budget = config.budget; bits = precision of the key copy that estimates the candidates' weights (2, 4 or 8;
    default 4).
    top_p defaults to 0.95 when the config leaves it unset."""

    name = "twilight"
    consumes_top_p = True
    default_budget = 0.25  # generous candidates; top-p then keeps what the attention mass needs
    #: the dense fallback's default (H200, Llama-3-8B shapes, B4, budget 2%: 0.52-0.65x from 64K to 512K cached
    #: tokens over the batch (random weights: top-p keeps ~23%))
    dense_below = 1_048_576

    base: str = DEFAULT_BASE
    bits: int = 4
    inner: TokenSelector | None = field(default=None, init=False, repr=False)
    pruner: TopPPruner | None = field(default=None, init=False, repr=False)

    @classmethod
    def check_config(cls, config) -> None:
        from sparsekv.registry import get_method_class

        options = config.options
        bits = options.get("bits", 4)
        if bits not in SUPPORTED_BITS:
            raise ConfigError(f"twilight: bits must be one of {SUPPORTED_BITS}, got {bits!r}")
        base = options.get("base", DEFAULT_BASE)
        if not isinstance(base, str) or base == cls.name:
            raise ConfigError(f"twilight: base must be another registered method, got {base!r}")
        base_class = get_method_class(resolve_base(base))  # ConfigError lists the known methods
        if base_class.dense or base_class.stores_kv or base_class.consumes_top_p:
            raise ConfigError(
                f"twilight: base {base!r} cannot provide candidates (dense, compressed-cache or top-p methods "
                "are not supported); use a token selector such as lsh, spotlight, quest or oracle-topk"
            )

    @classmethod
    def effective_options(cls, config) -> dict:
        # the p that prunes, when the config leaves it to the method
        return super().effective_options(config) | {"top_p": config.top_p if config.top_p is not None else DEFAULT_TOP_P}

    def __post_init__(self) -> None:
        from sparsekv.registry import get_method_class

        self.inner = get_method_class(resolve_base(self.base))(self.config, self.layer)
        p = self.config.top_p if self.config.top_p is not None else DEFAULT_TOP_P
        self.pruner = TopPPruner(self.config, self.layer, p=p, bits=self.bits)

    @property
    def fixed_shape(self) -> bool:  # a fixed-shape step where the base has one (the pruner always does)
        return self.inner.fixed_shape

    def prompt_query_window(self) -> int | None:
        return self.inner.prompt_query_window()

    def begin_fixed_shape(self, capacity: int) -> None:
        self.inner.begin_fixed_shape(capacity)
        self.pruner.begin_fixed_shape(capacity)

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        self.inner.append_fixed_shape(keys, values, position)
        self.pruner.append_fixed_shape(keys, values, position)

    def end_fixed_shape(self, length: int) -> None:
        self.inner.end_fixed_shape(length)
        self.pruner.end_fixed_shape(length)

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        self.pruner.crop(length)

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        self.inner.prefill(keys, values, query, key_mask)
        self.pruner.prefill(keys, values, query)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.inner.append(keys, values)
        self.pruner.append(keys, values)

    def candidates(self, step: DecodeStep) -> Selection:
        return self.inner.select(step)

    def select(self, step: DecodeStep) -> Selection:
        return self.pruner.prune(step, self.candidates(step))
