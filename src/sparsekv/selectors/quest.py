"""Quest: page-level selection from per-page, per-channel key min/max (Tang et al., 2024).

A page's score is an upper bound of q·k over its keys: sum_i max(q_i * max_i, q_i * min_i). Whole pages are
taken best-first until the token budget is spent; the page holding the query is always attended (in a chunk
its min/max may already include later tokens, so it is never scored). If the budget ends inside a page, the
most recent tokens of that page fill the remainder, so the budget is met exactly and budget >= context is
dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.config import ConfigError
from sparsekv.kernels.quest import quest_page_scores
from sparsekv.selectors.base import TokenSelector, fixed_int_topk_selection, topk_selection
from sparsekv.selectors.lsh import unique_ranks
from sparsekv.step import DecodeStep, Selection


@dataclass
class QuestSelector(TokenSelector):
    """Option: page_size (16 as in the paper). Pages start at each sequence's first real token, so left
    padding does not shift them (batch invariance)."""

    name = "quest"
    fixed_shape = True
    #: the dense fallback's default (H200, Llama-3-8B shapes, B4, budget 2%, the page-level step: 0.86x at 128K
    #: cached tokens over the batch, 0.95x at 256K; the token-level step it replaced was 0.99x at 512K)
    dense_below = 393_216
    page_size: int = 16

    @classmethod
    def check_config(cls, config) -> None:
        size = config.options.get("page_size", cls.page_size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"quest page_size must be an int >= 1, got {size!r}")

    def __post_init__(self) -> None:
        self.prompt_length = 0
        self.start: torch.Tensor | None = None  # [B] first real position of each sequence
        self.built = 0
        self.page_max: torch.Tensor | None = None  # [B, Hkv, pages, d], -inf where no token yet
        self.page_min: torch.Tensor | None = None

    def prefill(
        self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> None:
        # pages are built at the first decode step: their alignment and min/max must skip left padding,
        # which only `step.visible` reveals; later steps extend them incrementally
        self.prompt_length = keys.shape[-2]

    def crop(self, length: int) -> None:
        if self.start is None or self.built <= length:
            return
        # the page holding position `length` (per row: pages start at the row's first real token) and every later
        # one are rebuilt from the kept keys at the next step; re-reducing a token into its page is idempotent
        page = (length - self.start).clamp(min=0) // self.page_size  # [B]
        stale = torch.arange(self.page_max.shape[2], device=page.device)[None, :] >= page[:, None]  # [B, P]
        self.page_max.masked_fill_(stale[:, None, :, None], float("-inf"))
        self.page_min.masked_fill_(stale[:, None, :, None], float("inf"))
        self.built = int((self.start + page * self.page_size).min())

    def begin_fixed_shape(self, capacity: int) -> None:
        # the pages and `start` exist: a fixed-shape step always follows at least one ordinary decode step
        pages = (capacity - 1) // self.page_size + 1
        if pages > self.page_max.shape[2]:
            self._grow(pages)

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        # the batch is unpadded, so the position lies past every row's start
        page = (position - self.start) // self.page_size  # [B]
        batch, heads, _, dim = keys.shape
        index = page[:, None, None, None].expand(batch, heads, 1, dim)
        new = keys.to(self.page_max.dtype)
        self.page_max.scatter_reduce_(2, index, new, "amax")
        self.page_min.scatter_reduce_(2, index, new, "amin")

    def end_fixed_shape(self, length: int) -> None:
        self.built = length

    def _grow(self, pages: int) -> None:
        """Room for `pages` pages; the new ones hold no token yet (max -inf, min inf)."""
        old_max, old_min = self.page_max, self.page_min
        shape = (*old_max.shape[:2], pages, old_max.shape[3])
        self.page_max = old_max.new_full(shape, float("-inf"))
        self.page_min = old_min.new_full(shape, float("inf"))
        self.page_max[:, :, : old_max.shape[2]] = old_max
        self.page_min[:, :, : old_min.shape[2]] = old_min

    def _sync(self, step: DecodeStep) -> None:
        keys = step.keys
        n = keys.shape[-2]
        if self.start is None:
            self.start = step.visible[:, 0, : self.prompt_length].to(torch.int32).argmax(-1)
        if self.built >= n:
            return
        batch, heads, _, dim = keys.shape
        pos = torch.arange(self.built, n, device=keys.device)
        rel = pos[None, :] - self.start[:, None]  # [B, new]
        pad = (rel < 0)[:, None, :, None]
        page = rel.clamp(min=0) // self.page_size
        pages = int(page.max()) + 1
        if self.page_max is None:
            dtype = torch.promote_types(keys.dtype, torch.float32)
            self.page_max = keys.new_full((batch, heads, 0, dim), float("-inf"), dtype=dtype)
            self.page_min = keys.new_full((batch, heads, 0, dim), float("inf"), dtype=dtype)
        if pages > self.page_max.shape[2]:
            self._grow(max(pages, 2 * self.page_max.shape[2]))
        new = keys[..., self.built :, :].to(self.page_max.dtype)
        index = page[:, None, :, None].expand(batch, heads, -1, dim)
        self.page_max.scatter_reduce_(2, index, new.masked_fill(pad, float("-inf")), "amax")
        self.page_min.scatter_reduce_(2, index, new.masked_fill(pad, float("inf")), "amin")
        self.built = n

    def page_ranks(self, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ranks [B, S, Q, P] of the pages that precede each query's own page, distinct, higher = better, the
        others below them; the query's page [B, Q]; the page count P)."""
        fixed = step.hints is not None and step.hints.fixed
        if not fixed:
            self._sync(step)  # a fixed-shape step's token is already in its page (`append_fixed_shape`)
        n, q_len, size = step.keys.shape[-2], step.query.shape[2], self.page_size
        if fixed:
            # every page of the buffer, and the query's page from the device count: no host read
            pages = (n - 1) // size + 1
            query_page = (step.hints.written - 1 - self.start[:, None]) // size  # [B, Q = 1]
        else:
            rel = torch.arange(n - q_len, n, device=step.keys.device)[None, :] - self.start[:, None]  # [B, Q]
            query_page = rel.clamp(min=0) // size
            pages = int(query_page.max()) + 1
        # [B, S, Q, P]: the op sums each GQA group's heads (gqa "group") or keeps every query head
        reduce = "sum" if step.gqa == "group" else "none"
        scores = quest_page_scores(step.query, self.page_min[:, :, :pages], self.page_max[:, :, :pages],
                                   group_reduce=reduce)  # fmt: skip
        earlier = torch.arange(pages, device=scores.device)[None, None, :] < query_page[:, :, None]
        # pages after the query's own are not yet visible; ranks put them (and the own page) last
        return unique_ranks(scores.masked_fill(~earlier[:, None], float("-inf"))), query_page, pages

    def score(self, step: DecodeStep) -> torch.Tensor:
        """[B, S, Q, N] ranking keys (higher = keep): own page (recent first), then pages best-first."""
        ranks, query_page, pages = self.page_ranks(step)
        n, size = step.keys.shape[-2], self.page_size
        rel = torch.arange(n, device=step.keys.device)[None, :] - self.start[:, None]  # [B, N]
        token_page, offset = rel.clamp(min=0) // size, rel.clamp(min=0) % size
        shape = (*ranks.shape[:3], n)
        token_rank = ranks.gather(-1, token_page[:, None, None, :].expand(shape))
        key = token_rank * size + offset[:, None, None, :]
        own = token_page[:, None, None, :] == query_page[:, None, :, None]
        return torch.where(own, float((pages + 1) * size) + offset[:, None, None, :], key)

    def fixed_page_selection(self, step: DecodeStep) -> Selection:
        """The ordinary step's set for a fixed-shape step, chosen among pages instead of tokens: the query's own
        page (its most recent tokens), then the best pages whole, then the most recent tokens of the next best
        page, until each row's budget is met. A top-k over the P page ranks and index arithmetic: nothing of the
        size of the buffer but the page scores, and no host read. (Sink and local tokens are not forced here:
        `select` takes the token path when the config has any.)"""
        ranks, query_page, _ = self.page_ranks(step)  # [B, S, Q, P], [B, Q]
        size, device = self.page_size, ranks.device
        b, s, q, _ = ranks.shape
        width = min(-(-step.hints.max_budget // size) + 1, ranks.shape[-1])  # pages a budget can reach
        best = ranks.topk(width, dim=-1).indices  # [B, S, Q, width], best first
        budget = step.budgets[:, None, :, None]  # [B, 1, Q, 1]
        own_start = self.start[:, None, None, None] + query_page[:, None, :, None] * size  # [B, 1, Q, 1]
        own_count = step.hints.written.view(1, 1, 1, 1) - own_start  # tokens written in the own page
        own_kept = torch.minimum(own_count, budget)
        rest = budget - own_kept
        full, partial = rest // size, rest % size
        slot = torch.arange(size, device=device)
        # own page: its last `own_kept` written tokens
        own_idx = (own_start + slot).expand(b, s, q, size)
        own_ok = (slot >= own_count - own_kept) & (slot < own_count)
        # ranked pages: the first `full` whole, then the `partial` most recent tokens of the next
        order = torch.arange(width, device=device)[:, None]  # [width, 1]
        page_idx = self.start[:, None, None, None, None] + best[..., None] * size + slot  # [B, S, Q, width, size]
        page_ok = (order < full[..., None]) | ((order == full[..., None]) & (slot >= size - partial[..., None]))
        indices = torch.cat([own_idx, page_idx.flatten(-2)], dim=-1)
        valid = torch.cat([own_ok.expand(b, s, q, size), page_ok.expand(b, s, q, width, size).flatten(-2)], dim=-1)
        # slots past the visible tokens (unused pages) stay in range: they are invalid entries
        return Selection(indices=indices.clamp(max=step.keys.shape[-2] - 1), valid=valid)

    def select(self, step: DecodeStep) -> Selection:
        if step.hints is not None and step.hints.fixed and step.hints.sink == 0 and step.hints.local == 0:
            return self.fixed_page_selection(step)
        scores = self.score(step)
        if step.hints is not None and step.hints.fixed:
            # the ranking keys are distinct integers below (pages + 2) x page_size: the sort-free histogram select
            # on the device (None elsewhere), the same set as ranking the whole row
            pages = (scores.shape[-1] - 1) // self.page_size + 1
            value_range = (0, (pages + 2) * self.page_size - 1)
            if (selection := fixed_int_topk_selection(scores, step, value_range)) is not None:
                return selection
        return topk_selection(scores, step)
