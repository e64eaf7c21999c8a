"""StreamingLLM: attention sinks + a recent window, the same for every query (no content awareness)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.selectors.base import DecodeStep, TokenSelector


@dataclass
class StreamingSelector(TokenSelector):
    """Keeps the first `sink_tokens` visible tokens and fills the rest of the budget with the most recent ones.

    `sink_tokens` is used when the config's `sink` is 0 (StreamingLLM's default of 4 sinks).
    """

    name = "streaming"
    sink_tokens: int = 4

    def crop(self, length: int) -> None:
        pass  # no state: every step ranks the visible tokens afresh

    def score(self, step: DecodeStep) -> torch.Tensor:
        visible = step.visible
        order = visible.cumsum(-1)  # 1-based rank of each visible token from the start
        sinks = max(self.config.sink, self.sink_tokens)
        recency = order.float()
        score = torch.where(order <= sinks, torch.full_like(recency, float(visible.shape[-1] + 1)), recency)
        return score[:, None].expand(-1, step.selection_heads, -1, -1)
