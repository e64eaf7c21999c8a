"""H2O (Heavy-Hitter Oracle): a fixed-size cache of heavy hitters plus a recent window, evicting for good.

Each cached token carries its accumulated attention (the prompt's causal attention summed over all prompt
queries, then every decode query's attention over what it attended). A query's cache holds `budget` tokens:
sink/local tokens, the `recent_ratio * budget` most recent tokens, and the heaviest hitters for the rest. When
a new token makes the cache overflow, the lightest non-recent token is evicted and never returns. The first
decode query shrinks the full prompt to the budget in one go.

Decode queries are processed one after another (each one's accumulated attention decides the next eviction),
so a chunk gives exactly what token-by-token decoding gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.config import ConfigError
from sparsekv.selectors.base import TokenSelector, to_selection_heads
from sparsekv.selectors.snapkv import prompt_attention
from sparsekv.step import DecodeStep, Selection

# priorities above any accumulated attention (at most one per query and head), exact in float64
_RECENT, _FORCED = 2.0**50, 2.0**51


def keep_mask(priority: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """[B, S, N] -> bool mask of the `budget[b]` highest priorities per row (ties: earlier position first)."""
    order = torch.argsort(priority, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(priority.shape[-1], device=priority.device).expand_as(order))
    return (ranks < budget[:, None, None]) & (priority > float("-inf"))


@dataclass
class H2OSelector(TokenSelector):
    """Option: recent_ratio, the share of the budget kept for the most recent tokens (0.5 as in the paper's
    equal heavy/recent split)."""

    name = "h2o"
    recent_ratio: float = 0.5

    @classmethod
    def check_config(cls, config) -> None:
        ratio = config.options.get("recent_ratio", cls.recent_ratio)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ConfigError(f"h2o recent_ratio must be in [0, 1], got {ratio!r}")

    def __post_init__(self) -> None:
        self.prompt_length = 0
        self.prompt_query: torch.Tensor | None = None
        self.inserted = 0  # positions [0, inserted) have been offered to the cache
        self.score_sum: torch.Tensor | None = None  # [B, S, capacity] accumulated attention (float64)
        self.cached: torch.Tensor | None = None  # [B, S, capacity] bool, tokens still in the cache

    def prompt_query_window(self) -> int | None:
        return None  # every prompt query's attention counts in the accumulated scores

    def prefill(
        self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> None:
        # kept until the first decode step, where `step.visible` tells which prompt positions are padding
        self.prompt_length = keys.shape[-2]
        self.prompt_query = query

    def _grow(self, n: int, like: torch.Tensor, heads: int) -> None:
        old = 0 if self.cached is None else self.cached.shape[-1]
        if n <= old:
            return
        capacity = max(n, 2 * old)
        score_sum = torch.zeros(like.shape[0], heads, capacity, dtype=torch.float64, device=like.device)
        cached = torch.zeros(like.shape[0], heads, capacity, dtype=torch.bool, device=like.device)
        if old:
            score_sum[..., :old] = self.score_sum
            cached[..., :old] = self.cached
        self.score_sum, self.cached = score_sum, cached

    def _attention(self, query: torch.Tensor, keys: torch.Tensor, cached: torch.Tensor, step: DecodeStep):
        """Softmax weights [B, S, N] of one query position [B, Hq, d] over its cached tokens [B, S, N]."""
        group = self.layer.group_size
        dtype = torch.promote_types(keys.dtype, torch.float32)
        keys = keys.to(dtype).repeat_interleave(group, dim=1)
        logits = torch.matmul(keys, query.to(dtype)[..., None])[..., 0] * self.layer.scaling  # [B, Hq, N]
        allowed = cached if cached.shape[1] == logits.shape[1] else cached.repeat_interleave(group, dim=1)
        weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        return to_selection_heads(weights[:, :, None], step)[:, :, 0]

    def select(self, step: DecodeStep) -> Selection:
        q_len = step.query.shape[2]
        n = step.keys.shape[-2]
        heads = step.selection_heads
        self._grow(n, step.keys, heads)
        if self.prompt_query is not None:
            prompt = self.prompt_length
            real = step.visible[:, 0, :prompt]
            votes = prompt_attention(self.prompt_query, step.keys[..., :prompt, :], real, self.layer.scaling)
            self.score_sum[..., :prompt] = to_selection_heads(votes[:, :, None], step)[:, :, 0].double()
            self.cached[..., :prompt] = real[:, None]
            self.inserted = prompt
            self.prompt_query = None
        positions = torch.arange(n, device=step.keys.device, dtype=torch.float64)
        masks = []
        for i in range(q_len):
            t = n - q_len + i
            visible = step.visible[:, i]  # [B, N]
            if t >= self.inserted:
                self.cached[..., t] = visible[:, None, t]
                self.inserted = t + 1
            budget = step.budgets[:, i]
            rank = visible.cumsum(-1)
            recent = visible & (rank > rank[:, -1:] - (budget * self.recent_ratio).long()[:, None])
            cached = self.cached[..., :n] & visible[:, None]
            priority = self.score_sum[..., :n].masked_fill(~cached, float("-inf"))
            priority = torch.where(recent[:, None] & cached, _RECENT + positions, priority)
            priority = torch.where(step.forced[:, i, None] & cached, _FORCED + positions, priority)
            keep = keep_mask(priority, budget)
            self.cached[..., :n] &= keep | ~cached  # evict for good; future positions are untouched
            self.score_sum[..., :n] += self._attention(step.query[:, :, i], step.keys, keep, step).double()
            masks.append(keep)
        mask = torch.stack(masks, dim=2)  # [B, S, Q, N]
        width = step.max_budget()
        order = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True)[..., :width]
        return Selection(indices=order, valid=mask.gather(-1, order))
