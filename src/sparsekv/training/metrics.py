"""Retrieval quality of a hash: IoU(predicted top-k, oracle top-k) per head on captured queries and keys."""

from __future__ import annotations

import torch

from sparsekv.budget import budget_tokens
from sparsekv.kernels.bits import pack_sign_bits
from sparsekv.kernels.hamming import hamming_scores_reference
from sparsekv.selectors.spotlight import LayerHash


def query_positions(length: int, count: int, min_position: int, seed: int) -> torch.Tensor:
    """`count` distinct sorted query positions in [min_position, length) (fixed by `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    span = length - min_position
    if span <= 0:
        raise ValueError(f"min_position {min_position} leaves no query in a window of {length}")
    picks = torch.randperm(span, generator=generator)[: min(count, span)] + min_position
    return picks.sort().values


def hash_codes(fn: LayerHash, x: torch.Tensor, role: str) -> torch.Tensor:
    """x [H, T, d] with H a multiple of the hash's heads (query heads grouped per kv head) -> int32 [H, T, W]."""
    h, t, d = x.shape
    group = h // fn.num_heads
    with torch.no_grad():
        out = fn(x.float().reshape(fn.num_heads, group * t, d), role)
    return pack_sign_bits(out).reshape(h, t, -1)


def _topk_mask(rank_key: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """rank_key [..., P, N] (higher = better; invisible rows already at the minimum), k [P] -> bool mask."""
    k_max = int(k.max())
    idx = rank_key.topk(k_max, dim=-1).indices
    keep = torch.arange(k_max) < k[:, None]
    return torch.zeros(rank_key.shape, dtype=torch.bool).scatter_(-1, idx, keep.expand_as(idx))


def _iou(pred: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    inter = (pred & oracle).sum(-1).float()
    union = (pred | oracle).sum(-1).float()
    return inter / union.clamp(min=1)


@torch.no_grad()
def layer_iou(
    fn: LayerHash | None,
    q: torch.Tensor,
    k: torch.Tensor,
    budget: float,
    positions: torch.Tensor,
    policies: tuple[str, ...] = ("group", "head"),
) -> dict[str, torch.Tensor]:
    """Mean IoU per selection head for each GQA policy, over windows and query positions.

    q [W, Hq, L, d], k [W, Hkv, L, d]; budget = fraction of each query's visible tokens (rounded up, as the
    decode path does). "group": top-k of the group-summed Hamming scores vs top-k of the group-summed exact
    softmax weights (one selection per kv head); "head": per query head. fn=None scores with the exact
    weights (IoU 1, a sanity check).
    """
    w_count, hq, length, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    visible = torch.arange(length)[None, :] <= positions[:, None]  # [P, L]
    kk = torch.tensor([budget_tokens(float(budget), int(p) + 1) for p in positions])
    key_pos = torch.arange(length, dtype=torch.int64)
    sums = {p: torch.zeros(hkv if p == "group" else hq) for p in policies}
    for w in range(w_count):
        qs = q[w][:, positions].float()  # [Hq, P, d]
        ks = k[w].float()  # [Hkv, L, d]
        logits = torch.matmul(qs.view(hkv, g * len(positions), d), ks.transpose(-1, -2)) * d**-0.5
        logits = logits.view(hq, len(positions), length).masked_fill(~visible, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        if fn is not None:
            q_codes = hash_codes(fn, qs, "q")
            k_codes = hash_codes(fn, ks, "k")
            match = hamming_scores_reference(
                q_codes[None], k_codes.repeat_interleave(g, 0)[None], bits=fn.bits
            )[0]  # [Hq, P, L] per query head
        for policy in policies:
            if policy == "group":
                oracle_w = weights.view(hkv, g, -1, length).sum(1)
                score = match.view(hkv, g, -1, length).sum(1) if fn is not None else oracle_w
            else:
                oracle_w, score = weights, (match if fn is not None else weights)
            oracle = _topk_mask(oracle_w.masked_fill(~visible, -1.0), kk)
            rank_key = (score.to(torch.int64) << 32) | key_pos if fn is not None else score
            rank_key = rank_key.masked_fill(~visible, -1)
            pred = _topk_mask(rank_key, kk)
            sums[policy] += _iou(pred, oracle).mean(-1)
    return {p: s / w_count for p, s in sums.items()}
