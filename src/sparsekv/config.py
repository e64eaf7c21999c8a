"""User-facing configuration, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from sparsekv.budget import budget_tokens
from sparsekv.errors import ConfigError
from sparsekv.registry import get_method_class, method_options

__all__ = ["GQA_POLICIES", "ConfigError", "GQAPolicy", "SparseConfig"]

GQAPolicy = Literal["group", "head"]
GQA_POLICIES = ("group", "head")


@dataclass(frozen=True)
class SparseConfig:
    """How decode attention picks its tokens.

    budget: tokens attended per query and per selection head, sink/local included; an int is a token count,
        a float in (0, 1) a fraction of the tokens visible to that query (rounded up, at least 1); None = the
        method's default (10%, Twilight's candidates 25%). For gemfilter a given budget is the prompt tokens it
        keeps (its `keep` option).
    top_p: optional Twilight-style pruning of the selected candidates to the smallest set with estimated
        attention mass >= top_p.
    dense_layers: layers that always attend densely (the first two by default, as in Quest / Twilight).
    sink / local: the first `sink` and the last `local` visible tokens are always kept.
    gqa: "group" = one selection per kv-head serving all its query heads (scores summed over the group);
        "head" = one selection per query head.
    options: method-specific settings (e.g. {"bits": 256} for lsh); unknown keys are rejected by the method.
    dense_below: the dense fallback of generation (`model.generate()`, `sparsekv.generate`, unless graph_decode
        is False): a decode step whose batch holds fewer cached tokens than this (tokens x sequences) attends
        densely, where the method's step would be the slower one; a CUDA graph decides once, when it is captured,
        for the rest of the generation. The selectors' state is kept all the same, and the stats count every
        visible token as attended. A compressing method (self-index) keeps no 16-bit K/V to attend densely over,
        so it decides once, before the prompt is cached, from the prompt's length and the batch: below the
        threshold its layers keep 16-bit K/V and attend densely for the whole generation (memory as dense's).
        None = the method's measured crossover on CUDA (`TokenSelector.dense_below`), no fallback on CPU; 0 =
        never. Forwards outside generation (evaluation) always run the method.
    """

    method: str = "dense"
    budget: int | float | None = None
    top_p: float | None = None
    dense_layers: tuple[int, ...] = (0, 1)
    sink: int = 0
    local: int = 0
    gqa: GQAPolicy = "group"
    options: dict[str, Any] = field(default_factory=dict)
    dense_below: int | None = None

    def __post_init__(self) -> None:
        # the registry imports no method module until asked (importlib), and none of sparsekv above errors.py
        accepted = method_options(self.method)  # raises ConfigError listing the known methods
        budget_given = self.budget is not None
        if self.budget is None:
            object.__setattr__(self, "budget", get_method_class(self.method).default_budget)
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ConfigError(f"budget must be an int (tokens) or a float in (0, 1) (fraction), got {budget!r}")
        if isinstance(budget, float):
            if not math.isfinite(budget) or budget <= 0:
                raise ConfigError(f"budget must be > 0, got {budget}")
            if budget >= 1:
                raise ConfigError(
                    f"a fractional budget must be < 1, got {budget}; pass an int for a token count "
                    f"(e.g. budget={int(budget)})"
                )
        elif budget <= 0:
            raise ConfigError(f"budget must be > 0 tokens, got {budget}")
        if self.top_p is not None:
            if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
                raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
            if not 0 < self.top_p <= 1:
                raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("sink", "local"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if isinstance(budget, int) and self.sink + self.local > budget:
            raise ConfigError(
                f"sink ({self.sink}) + local ({self.local}) tokens exceed the budget ({budget}); "
                "they count inside it"
            )
        if self.dense_below is not None and (
            isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int) or self.dense_below < 0
        ):
            raise ConfigError(
                f"dense_below must be an int >= 0 (cached tokens over the batch) or None, got {self.dense_below!r}"
            )
        if self.gqa not in GQA_POLICIES:
            raise ConfigError(f"gqa must be one of {', '.join(GQA_POLICIES)}, got {self.gqa!r}")
        layers = tuple(self.dense_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
            raise ConfigError(f"dense_layers must be non-negative layer indices, got {self.dense_layers!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))
        if not isinstance(self.options, dict):
            raise ConfigError(f"options must be a dict, got {type(self.options).__name__}")
        unknown = sorted(set(self.options) - set(accepted))
        if unknown:
            raise ConfigError(
                f"method {self.method!r} has no option(s) {unknown}; "
                f"its options: {', '.join(sorted(accepted)) or 'none'}"
            )
        object.__setattr__(self, "options", dict(self.options))
        # a method whose budget is one of its options (gemfilter: the prompt tokens kept) takes the budget there,
        # so that budget means the same for every method
        budget_option = get_method_class(self.method).budget_option
        if budget_given and budget_option:
            if self.options.get(budget_option, budget) != budget:
                raise ConfigError(
                    f"{self.method}'s budget is its {budget_option} option: give budget={budget} or "
                    f"{budget_option}={self.options[budget_option]}, not both"
                )
            self.options[budget_option] = budget
        get_method_class(self.method).check_config(self)

    def check_model(self, num_layers: int) -> None:
        """Checks what depends on the model (raised at `enable`)."""
        bad = [i for i in self.dense_layers if i >= num_layers]
        if bad:
            raise ConfigError(
                f"dense layer(s) {bad} out of range: the model has {num_layers} layers (0..{num_layers - 1})"
            )

    def fallback_threshold(self, device_type: str) -> int:
        """Cached tokens (over the batch) below which a decode step of generation on a `device_type` device
        ("cuda", "cpu") attends densely (`dense_below`)."""
        if self.dense_below is not None:
            return self.dense_below
        return get_method_class(self.method).dense_below if device_type == "cuda" else 0

    def tokens_for(self, visible: int) -> int:
        """Budget in tokens for a query that sees `visible` tokens (before sink/local are forced in): the rule of
        `sparsekv.budget`."""
        return budget_tokens(self.budget, visible)
