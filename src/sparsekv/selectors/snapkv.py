"""SnapKV: permanent eviction of prompt tokens, decided by the prompt's last queries.

The last `window` prompt queries (the observation window) vote: their softmax attention over the earlier
prompt tokens is summed per head, smoothed by 1-D pooling (kernel 5) so that neighbours of a hit survive with
it, and ranked. The cache then holds `budget` tokens: the most recent ones (the observation window, then every
generated token, newest first) and the best-voted rest of the prompt. Each generated token displaces the
weakest prompt token once the budget is full, and nothing evicted comes back: the scores never change after
the prompt.

The eviction is a selection mask here (K/V stay in memory); its effect on quality is what this baseline shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsekv.config import ConfigError
from sparsekv.selectors.base import TokenSelector, to_selection_heads
from sparsekv.step import DecodeStep

POOLINGS = ("avg", "max")


def prompt_attention(
    query: torch.Tensor, keys: torch.Tensor, real: torch.Tensor, scaling: float, chunk: int = 256
) -> torch.Tensor:
    """Causal softmax attention of the prompt's last `Q` queries, summed over them per query head.

    query [B, Hq, Q, d] (the last Q prompt positions), keys [B, Hkv, P, d], real [B, P] non-padding positions.
    Returns [B, Hq, P]; padded queries and keys contribute nothing.
    """
    batch, heads, q_len, _ = query.shape
    prompt = keys.shape[-2]
    group = heads // keys.shape[1]
    dtype = torch.promote_types(keys.dtype, torch.float32)
    keys = keys.to(dtype).repeat_interleave(group, dim=1)
    total = torch.zeros(batch, heads, prompt, dtype=dtype, device=keys.device)
    columns = torch.arange(prompt, device=keys.device)
    for lo in range(0, q_len, chunk):
        q = query[:, :, lo : lo + chunk].to(dtype)
        rows = torch.arange(prompt - q_len + lo, prompt - q_len + lo + q.shape[2], device=keys.device)
        allowed = (columns[None, :] <= rows[:, None])[None] & real[:, None, :]  # [B, c, P]
        logits = torch.matmul(q, keys.transpose(-1, -2)) * scaling
        weights = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        weights = weights.nan_to_num(0.0) * real[:, None, rows, None]  # a padded query has no row
        total += weights.sum(2)
    return total


@dataclass
class SnapKVSelector(TokenSelector):
    """Options: window (observation window, 32), kernel (pooling width, 5), pooling avg|max."""

    name = "snapkv"
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"

    @classmethod
    def check_config(cls, config) -> None:
        for key, low in (("window", 1), ("kernel", 1)):
            value = config.options.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"snapkv {key} must be an int >= {low}, got {value!r}")
        if config.options.get("kernel", cls.kernel) % 2 == 0:
            raise ConfigError("snapkv kernel must be odd (the pooling is centred on each token)")
        if config.options.get("pooling", cls.pooling) not in POOLINGS:
            raise ConfigError(f"snapkv pooling must be one of {', '.join(POOLINGS)}")

    def __post_init__(self) -> None:
        self.prompt_length = 0
        self.window_query: torch.Tensor | None = None
        self.prompt_scores: torch.Tensor | None = None  # [B, S, P], in [0, group * window]

    def prompt_query_window(self) -> int | None:
        return self.window

    def crop(self, length: int) -> None:
        pass  # the votes cover the prompt only, which is never cropped; later tokens rank by recency

    def prefill(
        self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> None:
        # the vote runs at the first decode step, where `step.visible` tells the padding apart
        self.prompt_length = keys.shape[-2]
        self.window_query = query[:, :, -self.window :]

    def _vote(self, step: DecodeStep) -> torch.Tensor:
        prompt = self.prompt_length
        real = step.visible[:, 0, :prompt]
        votes = prompt_attention(self.window_query, step.keys[..., :prompt, :], real, self.layer.scaling)
        window = self.window_query.shape[2]
        head = votes[..., : prompt - window]
        if head.shape[-1]:
            pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
            pad = self.kernel // 2
            flat = head.reshape(-1, 1, head.shape[-1])
            if self.pooling == "avg":
                flat = pool(flat, self.kernel, stride=1, padding=pad, count_include_pad=True)
            else:
                # zero padding (not -inf) so a token next to the left padding pools exactly as it would alone
                flat = pool(F.pad(flat, (pad, pad)), self.kernel, stride=1)
            head = flat.view_as(head)
        self.window_query = None
        return head

    def score(self, step: DecodeStep) -> torch.Tensor:
        if self.prompt_scores is None:
            self.prompt_scores = to_selection_heads(self._vote(step)[:, :, None], step)[:, :, 0]
        voted = self.prompt_scores
        n = step.keys.shape[-2]
        # recent tokens (window + generated) outrank every vote; newest first when the budget is short
        ceiling = float(self.window * step.layer.group_size + 1)
        recency = ceiling + torch.arange(n, dtype=voted.dtype, device=voted.device)
        scores = torch.cat([voted, recency[voted.shape[-1] :].expand(*voted.shape[:2], -1)], dim=-1)
        return scores[:, :, None, :].expand(-1, -1, step.query.shape[2], -1)
