"""StreamingLLM: attention sinks + a recent window, the same for every query (no content awareness)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.selectors.base import TokenSelector, maybe_compiled
from sparsekv.step import DecodeStep, Selection


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
    same_in_every_layer = True

    def crop(self, length: int) -> None:
        pass  # no state: every step ranks the visible tokens afresh

    def select(self, step: DecodeStep) -> Selection:
        hints = step.hints
        if hints is None or not hints.fixed or step.query.shape[2] != 1:
            return super().select(step)
        return self._fixed_select(step)

    def _fixed_select(self, step: DecodeStep) -> Selection:
        """The eager rule's set at a fixed shape (an unpadded batch: slot i is the i-th visible token); with
        `compiled_step` its few tensor ops run as one compiled kernel. Rows with masked slots (lossless rounds)
        lose those from the window."""
        k = min(step.hints.max_budget, step.keys.shape[-2])
        sinks = max(self.config.sink, self.sink_tokens)
        window = maybe_compiled(sinks_and_window, self.compiled_step)
        indices, valid = window(step.budgets, step.hints.written, k, sinks, self.config.local)
        heads = step.selection_heads
        return Selection(indices.expand(-1, heads, -1, -1), valid.expand(-1, heads, -1, -1))

    def score(self, step: DecodeStep) -> torch.Tensor:
        visible = step.visible
        order = visible.cumsum(-1)  # 1-based rank of each visible token from the start
        sinks = max(self.config.sink, self.sink_tokens)
        recency = order.float()
        score = torch.where(order <= sinks, torch.full_like(recency, float(visible.shape[-1] + 1)), recency)
        return score[:, None].expand(-1, step.selection_heads, -1, -1)


def sinks_and_window(budgets: torch.Tensor, written: torch.Tensor, k: int, sinks: int, local: int):
    """Streaming's fixed-shape selection: budgets [B, 1] tokens per row, `written` [1] slots cached (the step's
    own the last), k the host bound of the budgets -> (indices, valid) [B, 1, 1, k]. The forced local tokens come
    first among a row's budget (the eager rule keeps them over the extra sinks), then up to `sinks` first slots;
    the rest of the budget is the newest slots."""
    budgets = budgets[:, None, :, None]
    recent = torch.clamp(budgets - sinks, min=local)  # the newest slots a row keeps
    first_recent = budgets - recent  # ranks below it are sinks
    rank = torch.arange(k, device=budgets.device)
    from_sink = rank < first_recent
    indices = torch.where(from_sink, rank, written - 1 - (rank - first_recent))
    valid = (rank < budgets) & (indices >= 0) & (from_sink | (indices >= first_recent))
    return indices.clamp(min=0), valid
