"""Top-p threshold bisection, one program per row: the row's weights stay in L1/L2 across the ~20 iterations
(each iteration is one masked sum), then one pass writes the keep mask."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._triton import check_grid


@triton.jit
def _top_p_kernel(w_ptr, v_ptr, out_ptr, K, sw, sv, so, p, eps, MAX_ITERS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    w_row = w_ptr + r * sw
    v_row = v_ptr + r * sv
    total = tl.zeros([], dtype=tl.float32)
    high = tl.zeros([], dtype=tl.float32)
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([], dtype=tl.int32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < K
        ok = m & (tl.load(v_row + offs, mask=m, other=0) != 0)
        w = tl.where(ok, tl.load(w_row + offs, mask=m, other=0.0).to(tl.float32), 0.0)
        total += tl.sum(w, axis=0)
        high = tl.maximum(high, tl.max(w, axis=0))
        wv = tl.where(ok, w, float("-inf"))
        bm = tl.max(wv, axis=0)
        bi = tl.min(tl.where(wv == bm, offs, K), axis=0)  # first index of the block maximum
        take = bm > best
        best_i = tl.where(take, bi, best_i)
        best = tl.maximum(best, bm)
    target = p * total
    low = tl.zeros([], dtype=tl.float32)
    it = 0
    while (high - low >= eps) & (it < MAX_ITERS):
        mid = (low + high) * 0.5
        mass = tl.zeros([], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < K
            ok = m & (tl.load(v_row + offs, mask=m, other=0) != 0)
            w = tl.where(ok, tl.load(w_row + offs, mask=m, other=0.0).to(tl.float32), 0.0)
            mass += tl.sum(tl.where(w > mid, w, 0.0), axis=0)
        up = mass >= target
        low = tl.where(up, mid, low)
        high = tl.where(up, high, mid)
        it += 1
    kept = tl.zeros([], dtype=tl.int32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < K
        ok = m & (tl.load(v_row + offs, mask=m, other=0) != 0)
        w = tl.load(w_row + offs, mask=m, other=0.0).to(tl.float32)
        keep = ok & (w > low)
        kept += tl.sum(keep.to(tl.int32), axis=0)
        tl.store(out_ptr + r * so + offs, keep.to(tl.int8), mask=m)
    if (kept == 0) & (best > float("-inf")):
        tl.store(out_ptr + r * so + best_i, 1)


def top_p_threshold_triton(weights: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    from sparsekv.kernels.top_p import EPS, MAX_ITERS

    rows, k = weights.shape
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    v = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(rows, k, dtype=torch.int8, device=weights.device)
    block = min(4096, triton.next_power_of_2(max(k, 16)))
    grid = check_grid("top_p_threshold", weights.shape, (rows,))  # one program per row, on axis x
    _top_p_kernel[grid](weights, v, out, k, weights.stride(0), v.stride(0), out.stride(0), float(p), EPS,
                        MAX_ITERS=MAX_ITERS, BLOCK=block, num_warps=4 if block <= 1024 else 8)  # fmt: skip
    return out.view(torch.bool)
