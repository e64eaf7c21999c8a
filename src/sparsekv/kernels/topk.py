"""Top-k selection over the last dim of a score tensor (set semantics: returned order is unspecified)."""

from __future__ import annotations

import torch


def select_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, S, Q, N] (int or float) -> indices [B, S, Q, min(k, N)] int64 of the largest scores."""
    k = min(int(k), scores.shape[-1])
    if k <= 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.int64, device=scores.device)
    if not scores.dtype.is_floating_point and scores.device.type == "cpu" and scores.dtype != torch.int64:
        scores = scores.to(torch.int64)  # CPU topk covers every int type; int64 keeps one code path
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def select_topk(scores: torch.Tensor, k: int, *, value_range: tuple[int, int] | None = None) -> torch.Tensor:
    """Indices [B, S, Q, min(k, N)] int64 of the k largest scores per row, ties broken deterministically.

    On CUDA, integer scores with a small range (Hamming: 0..bits*g) take the sort-free histogram path; pass
    `value_range=(lo, hi)` (inclusive) when the caller knows it, which saves one pass over the scores.
    """
    from sparsekv.kernels._triton import use_triton

    if use_triton(scores) and scores.shape[-1] > 0 and 0 < k < scores.shape[-1]:
        from sparsekv.kernels import _topk_triton as impl

        if not scores.dtype.is_floating_point:
            if value_range is None:
                lo, hi = (int(v) for v in torch.aminmax(scores))  # host sync: pass value_range under a graph
            else:
                lo, hi = value_range
            if hi - lo < impl.MAX_BINS:
                return impl.select_topk_int(scores, int(k), lo, hi)
        # float scores: the 4 x 8-bit radix kernel (impl.select_topk_float) measured about 2x slower than
        # torch.topk on the H200 (BENCHMARKS.md), so floats stay on torch.topk
    return select_topk_reference(scores, k)
