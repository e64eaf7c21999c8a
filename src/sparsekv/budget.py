"""The budget rule: how many tokens a query keeps, from the configured budget and the tokens it sees.

An int budget is a token count; a float in (0, 1) is a fraction of the visible tokens, rounded up. The result is
at least 1 and at most the visible count (1 when nothing is visible). The sink/local tokens of a config may raise
it further; that step stays with the decode step (`attention.token_budgets`, `selectors.base.host_budget`).

The scalar form (host side) and the tensor form (one count per row, on the device) round identically: both
multiply in float64 and take the ceiling. Every place that turns a budget into tokens calls one of these two.
This module imports nothing of sparsekv (and not torch: the tensor form only calls tensor methods).
"""

from __future__ import annotations

import math

#: an int is a token count, a float in (0, 1) a fraction of the visible tokens (the two are told apart by type)
Budget = int | float


def budget_tokens(budget: Budget, visible: int) -> int:
    """Tokens kept by a query that sees `visible` tokens, before sink/local tokens are forced in."""
    tokens = math.ceil(budget * visible) if isinstance(budget, float) else int(budget)
    return max(1, min(tokens, max(visible, 1)))


def budget_tokens_tensor(budget: Budget, visible):
    """`budget_tokens` of every entry of the int64 tensor `visible` (visible counts), as an int64 tensor."""
    if isinstance(budget, float):
        tokens = (visible.double() * budget).ceil().long()
    else:
        tokens = visible.new_full(visible.shape, int(budget))
    return tokens.clamp(min=1).minimum(visible.clamp(min=1))
