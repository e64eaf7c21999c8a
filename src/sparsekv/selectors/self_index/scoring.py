"""First-stage scores of the self-index: the LUT over the sign codes, and the sink tokens (chosen SnapKV-style at the
prefill, then put first in every selection, at most `sink_share` of a query's budget).

`lut_scores` here is the torch reference for gqa="head" and float64; GQA "group" steps go through
`kernels.lut_score` (Triton on CUDA). The second stage (the re-rank by q . K as attention reads K) is
`SelfIndexSelector._rescored` through `device.candidate_scores`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsekv.selectors.self_index.codes import GROUP_DIMS

SNAP_WINDOW = 32  # prompt queries that vote for the sink tokens
SNAP_KERNEL = 5  # avg-pooling width of the SnapKV votes
SINK_BASE = 1.0e7  # sink scores: SINK_BASE + (sinks - rank), exact in float32 and above any LUT score
SENTINEL = 2**31 - 1  # sink position of an unused sink slot (sorts last, never matches a key)


def lut_scores(
    query: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, max_elements: int = 1 << 25
) -> torch.Tensor:
    """Compressed-domain q.k: query [B, S, Q, d] (S a multiple of the kv heads), centroids [B, Hkv, G, 16, 4],
    codes [B, Hkv, N, G] -> [B, S, Q, N] = sum_g (q_g . centroid[g, code_g]) in the centroids' dtype.

    Reference implementation (table then gather + sum over groups, in a fixed order, so a query's scores do not
    depend on how many queries are scored together).
    """
    b, s, q, _ = query.shape
    hkv, n, groups = codes.shape[1], codes.shape[2], codes.shape[3]
    rep = s // hkv
    cents = centroids.repeat_interleave(rep, dim=1) if rep > 1 else centroids
    table = torch.einsum(
        "bsqgi,bsgci->bsqgc", query.to(centroids.dtype).unflatten(-1, (groups, GROUP_DIMS)), cents
    )
    table = table.flatten(-2)  # [B, S, Q, G*16]
    offsets = torch.arange(groups, device=codes.device) * 16
    flat = (codes.long() + offsets).flatten(-2)  # [B, Hkv, N*G]
    if rep > 1:
        flat = flat.repeat_interleave(rep, dim=1)
    out = torch.empty(b, s, q, n, dtype=table.dtype, device=table.device)
    step = max(1, max_elements // max(1, b * s * n * groups))
    for lo in range(0, q, step):
        hi = min(q, lo + step)
        picked = table[:, :, lo:hi].gather(-1, flat[:, :, None].expand(-1, -1, hi - lo, -1))
        out[:, :, lo:hi] = picked.view(b, s, hi - lo, n, groups).sum(-1)
    return out


#: float32 elements of one work tensor that a prompt's per-sequence computations make at once (32 MB: one sequence
#: of an 8,192-token chunk at Llama-3-8B's 8 kv heads of 128 channels, 42 of a 1,024-token chunk at the embedded
#: model's 3 of 64)
GROUP_ELEMENTS = 1 << 23


def sequence_groups(batch: int, elements_per_sequence: int) -> list[slice]:
    """Slices of a batch of `batch` sequences, each as many sequences as keep a work tensor of
    `elements_per_sequence` elements a sequence within GROUP_ELEMENTS (at least one)."""
    size = max(1, GROUP_ELEMENTS // max(1, elements_per_sequence))
    return [slice(start, min(batch, start + size)) for start in range(0, batch, size)]


def snap_sinks(
    keys: torch.Tensor, query: torch.Tensor, count: int, scaling: float, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` prompt tokens per kv-head most attended by the last SNAP_WINDOW real prompt queries (softmax
    weights summed over the window and the group's heads, avg-pooled over SNAP_KERNEL neighbours).

    Returns (positions [B, Hkv, count] int64 sorted ascending, unused slots = SENTINEL; rank [B, Hkv, count]
    int64, 0 = most attended, in the same order).

    A few sequences at a time (`sequence_groups`): the float32 logits and the keys' float32 copy for every query
    head are several times the prompt's own bytes, and a whole batch's would be alive at once, next to the cache
    that the prompt fills."""
    parts = [_snap_sinks_rows(keys[rows], query[rows], count, scaling, None if key_mask is None else key_mask[rows])
             for rows in sequence_groups(keys.shape[0], query.shape[1] * keys.shape[2] * keys.shape[3])]  # fmt: skip
    positions, rank = zip(*parts, strict=True)
    return torch.cat(positions), torch.cat(rank)


def _snap_sinks_rows(
    keys: torch.Tensor, query: torch.Tensor, count: int, scaling: float, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hkv, n, _ = keys.shape
    hq = query.shape[1]
    mask = torch.ones(b, n, dtype=torch.bool, device=keys.device) if key_mask is None else key_mask.bool()
    real = mask.sum(-1)  # left padding: the real tokens are the last `real` ones
    window = min(SNAP_WINDOW, n)
    pos = torch.arange(n - window, n, device=keys.device)
    q = query[:, :, query.shape[2] - window :].float()  # the prompt's last queries (only those may be given)
    k = keys.float().repeat_interleave(hq // hkv, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hq, W, N]
    allowed = (torch.arange(n, device=keys.device)[None, :] <= pos[:, None])[None] & mask[:, None, :]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    in_window = (pos[None, :] >= n - torch.clamp(real, max=SNAP_WINDOW)[:, None]) & mask[:, n - window :]
    weights = weights * in_window[:, None, :, None]
    votes = weights.sum(2).view(b, hkv, hq // hkv, n).sum(2)  # [B, Hkv, N]
    votes = F.avg_pool1d(votes, SNAP_KERNEL, stride=1, padding=SNAP_KERNEL // 2, count_include_pad=True)
    votes = votes.masked_fill(~mask[:, None], float("-inf"))
    positions, rank, _ = _most_voted(votes, None, count)
    return positions, rank


def _most_voted(
    votes: torch.Tensor, positions: torch.Tensor | None, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `count` most voted of votes [B, Hkv, P] (-inf: never chosen), whose positions are `positions` [B, Hkv, P]
    (None: their index) -> (positions [B, Hkv, count] sorted ascending, unused slots = SENTINEL; rank, 0 = most
    voted; index into P), all in the same order."""
    k_top = min(count, votes.shape[-1])
    top = votes.sort(dim=-1, descending=True, stable=True)
    chosen, used = top.indices[..., :k_top], top.values[..., :k_top] > float("-inf")
    rank = torch.arange(k_top, device=votes.device).expand_as(chosen)
    chosen_pos = chosen if positions is None else positions.long().gather(-1, chosen)
    chosen_pos, order = torch.where(used, chosen_pos, torch.full_like(chosen, SENTINEL)).sort(dim=-1)
    return chosen_pos, rank.gather(-1, order), chosen.gather(-1, order)


@dataclass(frozen=True)
class SinkBoost:
    """What `boost_sinks` needs of the sinks for scores of `heads` rows over `keys` keys: fixed from the prefill
    on, so a decode loop makes it once (`sink_boost`) instead of at every step."""

    positions: torch.Tensor  # [B, heads, S] int64, SENTINEL = unused
    rank: torch.Tensor  # [B, heads, S] int64
    boost: torch.Tensor  # [B, heads, S] the score each sink is given
    index: torch.Tensor  # [B, heads, S] positions clamped into the scores


def sink_boost(positions: torch.Tensor, rank: torch.Tensor, heads: int, keys: int, dtype: torch.dtype) -> SinkBoost:
    """positions / rank [B, Hkv, S] of `snap_sinks`, for scores [B, heads, Q, keys] of `dtype`."""
    rep = heads // positions.shape[1]
    positions = positions.long().repeat_interleave(rep, dim=1)
    rank = rank.long().repeat_interleave(rep, dim=1)
    boost = (SINK_BASE + (positions.shape[-1] - rank)).to(dtype)
    return SinkBoost(positions, rank, boost, positions.clamp(max=keys - 1))


def boost_sinks(scores: torch.Tensor, budgets: torch.Tensor, sinks: SinkBoost, share: float) -> torch.Tensor:
    """Puts the sinks (`sink_boost`) first in scores [B, heads, Q, N], best SnapKV rank first; a row forces at most
    share x its budget of them (budgets [B, Q]; the others keep their LUT score), so short contexts keep room for
    the query's own top-k. In place."""
    cap = torch.floor(budgets.to(torch.float64) * share).long()  # [B, Q]
    used = (sinks.positions < SENTINEL)[:, :, None] & (sinks.rank[:, :, None] < cap[:, None, :, None])  # [B,S,Q,K]
    index = sinks.index[:, :, None].expand(-1, -1, scores.shape[2], -1)
    current = scores.gather(-1, index)
    # in place: the scores are this step's own tensor (a copy of [B, H, Q, N] costs more than the LUT)
    return scores.scatter_(-1, index, torch.where(used, sinks.boost[:, :, None].expand_as(current), current))


def rank_sink_pool(
    keys: torch.Tensor, positions: torch.Tensor, query: torch.Tensor, count: int, scaling: float, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sinks of a prompt stored chunk by chunk: each chunk put forward its own `snap_sinks` candidates (keys
    [B, Hkv, P, d], absolute positions [B, Hkv, P], SENTINEL = no candidate); the prompt's last SNAP_WINDOW queries
    (query [B, Hq, >=W, d], at positions length - W .. length - 1, all real: the prompt held at least its
    statistics' tokens) vote over the candidates as `snap_sinks` votes over the whole prompt (softmax weights
    summed over the window and the group; no pooling, the candidates are not neighbours).

    Returns `snap_sinks`'s (positions [B, Hkv, count] sorted ascending, unused = SENTINEL; rank) and the index of
    each chosen candidate in the pool [B, Hkv, count] (its 16-bit K/V)."""
    b, hkv, pool, _ = keys.shape
    hq = query.shape[1]
    window = min(SNAP_WINDOW, length)
    q = query[:, :, query.shape[2] - window :].float()
    k = keys.float().repeat_interleave(hq // hkv, dim=1)
    query_pos = torch.arange(length - window, length, device=keys.device)
    candidate_pos = positions.long().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, P]
    allowed = (candidate_pos[:, :, None, :] <= query_pos[None, None, :, None]) & (
        candidate_pos[:, :, None, :] < SENTINEL
    )
    logits = (torch.matmul(q, k.transpose(-1, -2)) * scaling).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    votes = weights.sum(2).view(b, hkv, hq // hkv, pool).sum(2)
    return _most_voted(votes.masked_fill(positions.long() >= SENTINEL, float("-inf")), positions, count)
