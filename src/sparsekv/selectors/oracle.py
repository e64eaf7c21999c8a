"""Oracle selectors from the exact attention weights: upper bounds for every approximate method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.config import ConfigError
from sparsekv.selectors.base import TokenSelector, to_selection_heads
from sparsekv.step import DecodeStep, Selection


def exact_weights(step: DecodeStep) -> torch.Tensor:
    """Softmax attention weights [B, S, Q, N] of the selection heads (group: summed over the query heads)."""
    layer = step.layer
    keys = step.keys.repeat_interleave(layer.group_size, dim=1)
    logits = torch.matmul(step.query.float(), keys.float().transpose(-1, -2)) * layer.scaling
    logits = logits.masked_fill(~step.visible[:, None], float("-inf"))
    return to_selection_heads(torch.softmax(logits, dim=-1), step)


def top_p_selection(weights: torch.Tensor, step: DecodeStep, top_p: float) -> Selection:
    """Smallest set per row whose weight reaches `top_p` of the row's total (forced tokens always in)."""
    weights = weights.masked_fill(~step.visible[:, None], 0.0)
    total = weights.sum(-1, keepdim=True)
    forced = step.forced[:, None].expand_as(weights)
    ranked = weights.masked_fill(forced, float("inf"))
    ranked, indices = ranked.sort(dim=-1, descending=True)
    sorted_weights = weights.gather(-1, indices)
    mass_before = sorted_weights.cumsum(-1) - sorted_weights
    # keep a token while the mass of the better tokens is still short of p; forced ones always
    keep = (mass_before < top_p * total) | torch.isinf(ranked)
    keep &= step.visible[:, None].expand_as(weights).gather(-1, indices)
    width = max(int(keep.sum(-1).max()), 1)
    return Selection(indices=indices[..., :width], valid=keep[..., :width])


@dataclass
class OracleTopK(TokenSelector):
    """Top-k by exact attention weight."""

    name = "oracle-topk"
    fixed_shape = True  # no state: the step scores the buffer it is handed
    slot_state = True

    def crop(self, length: int) -> None:
        pass  # no state: every step scores the cached keys exactly

    def score(self, step: DecodeStep) -> torch.Tensor:
        return exact_weights(step)


@dataclass
class OracleTopP(TokenSelector):
    """Smallest set with exact attention mass >= top_p; ignores the token budget."""

    name = "oracle-topp"
    consumes_top_p = True

    def crop(self, length: int) -> None:
        pass  # no state: every step scores the cached keys exactly

    @classmethod
    def check_config(cls, config) -> None:
        if config.top_p is None:
            raise ConfigError("oracle-topp needs top_p (e.g. top_p=0.9)")

    def select(self, step: DecodeStep) -> Selection:
        return top_p_selection(exact_weights(step), step, self.config.top_p)
