"""StreamingLLM: attention sinks + a recent window, the same for every query (no content awareness)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.selectors.base import DecodeStep, Selection, TokenSelector


@dataclass
class StreamingSelector(TokenSelector):
    """Keeps the first `sink_tokens` visible tokens and fills the rest of the budget with the most recent ones.

    `sink_tokens` is used when the config's `sink` is 0 (StreamingLLM's default of 4 sinks). Its fixed-shape step
    computes the positions from the step's slot alone (nothing is scored), which makes it the cheapest draft of
    lossless decoding.
    """

    name = "streaming"
    sink_tokens: int = 4
    fixed_shape = True
    slot_state = True  # no state at all: a slot written again changes nothing

    def crop(self, length: int) -> None:
        pass  # no state: every step ranks the visible tokens afresh

    def select(self, step: DecodeStep) -> Selection:
        hints = step.hints
        if hints is None or not hints.fixed or step.query.shape[2] != 1:
            return super().select(step)
        return self._fixed_select(step)

    def _fixed_select(self, step: DecodeStep) -> Selection:
        """The eager rule's set at a fixed shape (an unpadded batch: slot i is the i-th visible token): the first
        sinks and the newest slots, `budgets` of them a row. The forced local tokens come first among the budget
        (as the eager rule keeps them over the extra sinks), then the sinks. Rows with masked slots (lossless
        rounds) lose those from the window."""
        hints = step.hints
        k = min(hints.max_budget, step.keys.shape[-2])
        budgets = step.budgets[:, None, :, None]  # [B, 1, 1, 1]
        sinks = max(self.config.sink, self.sink_tokens)
        recent = torch.clamp(budgets - sinks, min=self.config.local)  # the newest slots a row keeps
        rank = torch.arange(k, device=step.keys.device)
        newest = hints.written - 1  # the step's own slot
        from_sink = rank < budgets - recent
        indices = torch.where(from_sink, rank, newest - (rank - (budgets - recent)))
        valid = (rank < budgets) & (indices >= 0) & (from_sink | (indices >= budgets - recent))
        heads = step.selection_heads
        return Selection(indices.clamp(min=0).expand(-1, heads, -1, -1), valid.expand(-1, heads, -1, -1))

    def score(self, step: DecodeStep) -> torch.Tensor:
        visible = step.visible
        order = visible.cumsum(-1)  # 1-based rank of each visible token from the start
        sinks = max(self.config.sink, self.sink_tokens)
        recency = order.float()
        score = torch.where(order <= sinks, torch.full_like(recency, float(visible.shape[-1] + 1)), recency)
        return score[:, None].expand(-1, step.selection_heads, -1, -1)
