"""Top-k selection over the last dim of a score tensor (set semantics: returned order is unspecified)."""

from __future__ import annotations

import torch


def select_topk_reference(scores: torch.Tensor, k: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """scores [B, S, Q, N] (int or float) -> indices [B, S, Q, min(k, N)] int64 of the largest scores.

    Integer scores: equal scores go to the lower position, the histogram kernel's rule (callers rely on it, e.g.
    reversed scores for ties to the more recent key). Float scores: torch.topk's choice among equal ones.
    counts (int32 [B * S * Q], each at most k): row r's counts[r] largest first, position 0 in its other entries."""
    k = min(int(k), scores.shape[-1])
    if k <= 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.int64, device=scores.device)
    best_first = counts is not None
    if scores.dtype.is_floating_point:
        picked = torch.topk(scores, k, dim=-1, sorted=best_first).indices
    elif scores.dtype in (torch.int64, torch.uint64, torch.uint32) or scores.shape[-1] >= 2**31:
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()
    else:
        # torch.topk leaves the choice among equal scores open: the position joins the key, lower positions
        # ranking higher. Exact in int64 for scores of at most 32 bits (offset to 0 .. 2**32 - 1, times N < 2**31)
        n = scores.shape[-1]
        offset = scores.to(torch.int64) - torch.iinfo(torch.int32).min
        tie = (n - 1) - torch.arange(n, device=scores.device)
        picked = torch.topk(offset * n + tie, k, dim=-1, sorted=best_first).indices
    if counts is None:
        return picked
    keep = torch.arange(k, device=picked.device) < counts.view(*picked.shape[:-1], 1)
    return torch.where(keep, picked, 0)


def select_topk(
    scores: torch.Tensor,
    k: int,
    *,
    value_range: tuple[int, int] | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices [B, S, Q, min(k, N)] int64 of the k largest scores per row, ties broken deterministically.

    The op `sparsekv::select_topk`. On CUDA, integer scores with a small range (Hamming: 0..bits*g) take the
    sort-free histogram path; pass `value_range=(lo, hi)` (inclusive, every score within it) when the caller
    knows it: without it the range is read from the scores here, one pass and a host sync (no CUDA graph).
    counts: int32 [B * S * Q] on the scores' device, at most k each: row r takes its counts[r] largest into its
    first entries and position 0 into the rest (each row's own budget where budgets are device values).
    """
    if counts is not None:
        rows = scores.shape[:-1].numel()
        if counts.dtype != torch.int32 or counts.shape != (rows,) or counts.device != scores.device:
            raise ValueError(f"counts must be an int32 tensor [{rows}] on {scores.device}")
    if value_range is not None:
        lo, hi = (int(v) for v in value_range)
        if lo > hi:
            raise ValueError(f"value_range {value_range} is empty (lo > hi)")
    elif scores.is_cuda and not scores.dtype.is_floating_point and 0 < k < scores.shape[-1]:
        lo, hi = (int(v) for v in torch.aminmax(scores))  # host sync: pass value_range under a graph
    else:
        lo = hi = None
    return _select_topk_op(scores, int(k), lo, hi, counts)


@torch.library.custom_op("sparsekv::select_topk", mutates_args=())
def _select_topk_op(
    scores: torch.Tensor, k: int, lo: int | None, hi: int | None, counts: torch.Tensor | None
) -> torch.Tensor:
    """lo / hi: the inclusive range of integer scores, which the CUDA kernel needs (the reference does not)."""
    return select_topk_reference(scores, k, counts)


@_select_topk_op.register_kernel("cuda")
def _select_topk_cuda(scores, k, lo, hi, counts):
    from sparsekv.kernels._triton import use_triton

    if (
        use_triton(scores)
        and 0 < k < scores.shape[-1]
        and not scores.dtype.is_floating_point
        and lo is not None
        and hi is not None
    ):
        from sparsekv.kernels import _topk_triton as impl

        if hi - lo < impl.MAX_BINS:
            return impl.select_topk_int(scores, k, lo, hi, counts)
    # float scores: the 4 x 8-bit radix kernel (impl.select_topk_float) measured about 2x slower than torch.topk
    # on the H200 (BENCHMARKS.md), so floats stay on torch.topk
    return select_topk_reference(scores, k, counts)


@_select_topk_op.register_fake
def _select_topk_fake(scores, k, lo, hi, counts):
    return scores.new_empty(*scores.shape[:-1], torch.sym_min(max(k, 0), scores.shape[-1]), dtype=torch.int64)
