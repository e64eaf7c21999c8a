"""Top-p pruning by threshold bisection (Twilight, Algorithm 1): keep the smallest set of the largest weights
whose mass reaches p, found without a sort."""

from __future__ import annotations

import torch

EPS = 1e-5
MAX_ITERS = 64


def top_p_threshold_reference(weights: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """weights [R, K] float (need not be normalised: mass is relative to each row's valid total),
    valid [R, K] bool -> keep mask [R, K] bool.

    Bisection on a threshold: low = 0, high = max; while high - low >= 1e-5: mid = (low + high) / 2, and if the
    valid weights > mid hold at least p of the mass then low = mid else high = mid. Keep valid & (w > low); a row
    whose kept set would be empty keeps its largest weight.
    """
    w = torch.where(valid, weights.float(), torch.zeros((), device=weights.device))
    total = w.sum(-1, keepdim=True)
    target = p * total
    low = torch.zeros_like(total)
    high = w.amax(-1, keepdim=True)
    for _ in range(MAX_ITERS):
        active = (high - low) >= EPS
        if not bool(active.any()):
            break
        mid = (low + high) * 0.5
        mass = torch.where(w > mid, w, 0.0).sum(-1, keepdim=True)
        up = active & (mass >= target)
        low = torch.where(up, mid, low)
        high = torch.where(active & ~up, mid, high)
    keep = valid & (w > low)
    # all-equal or single-weight rows: w > low can exclude everything; keep the row's maximum
    empty = ~keep.any(-1, keepdim=True) & valid.any(-1, keepdim=True)
    best = torch.where(valid, w, torch.full((), float("-inf"), device=w.device)).argmax(-1, keepdim=True)
    top = torch.zeros_like(keep).scatter_(-1, best, True) & valid
    return torch.where(empty, top, keep)


def top_p_threshold(weights: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """Keep mask [R, K] bool of the smallest high-weight set with mass >= p per row (see the reference).

    The op `sparsekv::top_p_threshold`: one Triton program per row on CUDA, the reference elsewhere."""
    if weights.shape != valid.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and valid {tuple(valid.shape)} must have one shape")
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool mask, not {valid.dtype}")
    return _top_p_threshold_op(weights, valid, float(p))


@torch.library.custom_op("sparsekv::top_p_threshold", mutates_args=())
def _top_p_threshold_op(weights: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    return top_p_threshold_reference(weights, valid, p)


@_top_p_threshold_op.register_kernel("cuda")
def _top_p_threshold_cuda(weights, valid, p):
    from sparsekv.kernels._triton import kernel, use_triton

    if use_triton(weights, valid) and weights.dim() == 2 and weights.shape[-1] > 0:
        impl = kernel("_top_p_triton", "top_p_threshold_triton")
        if impl is not None:
            return impl(weights, valid, p)
    return top_p_threshold_reference(weights, valid, p)


@_top_p_threshold_op.register_fake
def _top_p_threshold_fake(weights, valid, p):
    return torch.empty_like(weights, dtype=torch.bool)
