"""Sort-free top-k on the GPU: per-chunk histograms -> per-row threshold -> deterministic compaction.

Integer scores of a small range take one histogram level on (score - lo). Float scores are mapped to
order-preserving uint32 keys and take three radix levels (11 + 11 + 10 bits), each level histogramming only the
elements whose higher digits equal the threshold prefix found so far. The compaction writes every element above
the final key and the first (by position) `need` elements equal to it, so the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._triton import next_pow2

MAX_BINS = 4096  # int scores whose range is below this take the one-level histogram path
_FLOAT_LEVELS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of each radix digit of the 32-bit key


@triton.jit
def _key(s, lo, IS_FLOAT: tl.constexpr):
    # uint32 key whose unsigned order is the score order
    if IS_FLOAT:
        b = s.to(tl.float32).to(tl.int32, bitcast=True)
        b = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: reverse the order of their magnitude bits
        return (b ^ -2147483648).to(tl.uint32, bitcast=True)  # flip the sign bit: signed -> unsigned order
    else:
        return (s.to(tl.int32) - lo).to(tl.uint32, bitcast=True)


@triton.jit
def chunk_histogram(key, nmask, prefix, SHIFT: tl.constexpr, NBITS: tl.constexpr, FIRST: tl.constexpr):
    """Histogram (2**NBITS bins) of the digit (key >> SHIFT) of the valid keys that match `prefix` above it."""
    digit = ((key >> SHIFT) & ((1 << NBITS) - 1)).to(tl.int32)
    ok = nmask
    if not FIRST:
        ok = ok & ((key >> (SHIFT + NBITS)) == prefix)
    digit = tl.where(ok, digit, 0)
    h = tl.histogram(digit, 1 << NBITS)
    # excluded lanes were counted in bin 0 (histogram's mask argument is not in every triton version)
    n_out = tl.sum((~ok).to(tl.int32), axis=0)
    return tl.where(tl.arange(0, 1 << NBITS) == 0, h - n_out, h)


@triton.jit
def _hist_kernel(
    src_ptr,
    hist_ptr,
    meta_ptr,
    N,
    stride_row,
    lo,
    num_chunks,
    blocks_per_chunk,
    SHIFT: tl.constexpr,
    NBITS: tl.constexpr,
    FIRST: tl.constexpr,
    IS_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    prefix = tl.load(meta_ptr + r * 4).to(tl.uint32, bitcast=True)
    h = tl.zeros([1 << NBITS], dtype=tl.int32)
    for i in range(blocks_per_chunk):
        offs = (c * blocks_per_chunk + i) * BLOCK + tl.arange(0, BLOCK)
        nmask = offs < N
        s = tl.load(src_ptr + r * stride_row + offs, mask=nmask, other=0)
        h += chunk_histogram(_key(s, lo, IS_FLOAT), nmask, prefix, SHIFT, NBITS, FIRST)
    tl.store(hist_ptr + (r * num_chunks + c) * (1 << NBITS) + tl.arange(0, 1 << NBITS), h)


@triton.jit
def _threshold_kernel(
    hist_ptr,
    meta_ptr,
    gt_ptr,
    eq_ptr,
    k,
    num_chunks,
    num_valid_bins,
    NBITS: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
):
    """meta[r] = (key prefix found so far, k still to place, total above the final key, needed equal).
    gt[r, c] accumulates the per-chunk counts above the threshold over the levels; on the last level gt and eq
    become the exclusive prefix sums over chunks used by the compaction."""
    r = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = 1 << NBITS
    bins = tl.arange(0, NB)
    if FIRST:
        prefix = 0
        k_rem = k
    else:
        prefix = tl.load(meta_ptr + r * 4)
        k_rem = tl.load(meta_ptr + r * 4 + 1)
    total = tl.zeros([NB], dtype=tl.int32)
    for c in range(num_chunks):
        total += tl.load(hist_ptr + (r * num_chunks + c) * NB + bins)
    total = tl.where(bins < num_valid_bins, total, 0)
    ge = tl.sum(total, axis=0) - tl.cumsum(total, axis=0) + total  # elements with digit >= bin
    t = tl.max(tl.where(ge >= k_rem, bins, -1), axis=0)
    cnt_gt = tl.sum(tl.where(bins > t, total, 0), axis=0)
    run_gt = 0
    run_eq = 0
    for c in range(num_chunks):
        h = tl.load(hist_ptr + (r * num_chunks + c) * NB + bins)
        g_c = tl.sum(tl.where(bins > t, h, 0), axis=0)
        if not FIRST:
            g_c += tl.load(gt_ptr + r * num_chunks + c)
        if LAST:
            tl.store(gt_ptr + r * num_chunks + c, run_gt)
            tl.store(eq_ptr + r * num_chunks + c, run_eq)
            run_eq += tl.sum(tl.where(bins == t, h, 0), axis=0)
        else:
            tl.store(gt_ptr + r * num_chunks + c, g_c)
        run_gt += g_c
    k_rem = k_rem - cnt_gt
    tl.store(meta_ptr + r * 4, (prefix << NBITS) | t)
    tl.store(meta_ptr + r * 4 + 1, k_rem)
    if LAST:
        tl.store(meta_ptr + r * 4 + 2, k - k_rem)
        tl.store(meta_ptr + r * 4 + 3, k_rem)


@triton.jit
def compact_block(
    key,
    nmask,
    offs,
    thr,
    out_row_ptr,
    base_gt,
    base_eq,
    cnt_gt,
    need_eq,
):
    """Write the positions of one block's selected keys; returns how many were above / equal to the threshold."""
    m_gt = nmask & (key > thr)
    m_eq = nmask & (key == thr)
    cg = tl.cumsum(m_gt.to(tl.int32), axis=0)
    tl.store(out_row_ptr + base_gt + cg - 1, offs.to(tl.int64), mask=m_gt)
    rank = base_eq + tl.cumsum(m_eq.to(tl.int32), axis=0) - 1
    keep = m_eq & (rank < need_eq)
    tl.store(out_row_ptr + cnt_gt + rank, offs.to(tl.int64), mask=keep)
    return tl.sum(m_gt.to(tl.int32), axis=0), tl.sum(m_eq.to(tl.int32), axis=0)


@triton.jit
def _compact_kernel(
    src_ptr,
    out_ptr,
    meta_ptr,
    gt_ptr,
    eq_ptr,
    N,
    stride_row,
    lo,
    k,
    num_chunks,
    blocks_per_chunk,
    IS_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    thr = tl.load(meta_ptr + r * 4).to(tl.uint32, bitcast=True)
    cnt_gt = tl.load(meta_ptr + r * 4 + 2)
    need_eq = tl.load(meta_ptr + r * 4 + 3)
    base_gt = tl.load(gt_ptr + r * num_chunks + c)
    base_eq = tl.load(eq_ptr + r * num_chunks + c)
    for i in range(blocks_per_chunk):
        offs = (c * blocks_per_chunk + i) * BLOCK + tl.arange(0, BLOCK)
        nmask = offs < N
        s = tl.load(src_ptr + r * stride_row + offs, mask=nmask, other=0)
        n_gt, n_eq = compact_block(
            _key(s, lo, IS_FLOAT), nmask, offs, thr, out_ptr + r * k, base_gt, base_eq, cnt_gt, need_eq
        )
        base_gt += n_gt
        base_eq += n_eq


def chunking(rows: int, n: int, block: int, device: torch.device) -> tuple[int, int]:
    """(num_chunks, blocks_per_chunk): enough programs to fill the GPU, each streaming several blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    blocks = triton.cdiv(n, block)
    want_chunks = max(1, triton.cdiv(4 * sms, rows))
    blocks_per_chunk = max(1, triton.cdiv(blocks, want_chunks))
    return triton.cdiv(blocks, blocks_per_chunk), blocks_per_chunk


def topk_from_histogram(
    src, hist, num_chunks, blocks_per_chunk, k, lo, nbits, num_valid_bins, block, is_float=False
):
    """Threshold + compaction of rows whose first-level histogram `hist` [R, C, 2**nbits] is already built
    (by `_hist_kernel` or a fused scoring kernel). Single level only."""
    rows, n = src.shape
    dev = src.device
    meta = torch.empty(rows, 4, dtype=torch.int32, device=dev)
    gt = torch.empty(rows, num_chunks, dtype=torch.int32, device=dev)
    eq = torch.empty(rows, num_chunks, dtype=torch.int32, device=dev)
    _threshold_kernel[(rows,)](
        hist, meta, gt, eq, k, num_chunks, num_valid_bins, NBITS=nbits, FIRST=True, LAST=True
    )
    out = torch.empty(rows, k, dtype=torch.int64, device=dev)
    _compact_kernel[(num_chunks, rows)](
        src,
        out,
        meta,
        gt,
        eq,
        n,
        src.stride(0),
        lo,
        k,
        num_chunks,
        blocks_per_chunk,
        IS_FLOAT=is_float,
        BLOCK=block,
    )
    return out


def _rows(scores: torch.Tensor) -> torch.Tensor:
    flat = scores.reshape(-1, scores.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def select_topk_int(scores: torch.Tensor, k: int, lo: int, hi: int) -> torch.Tensor:
    src = _rows(scores)
    rows, n = src.shape
    block = 1024 if n >= 8192 else 256
    num_chunks, bpc = chunking(rows, n, block, src.device)
    nbits = max(1, (next_pow2(hi - lo + 1) - 1).bit_length())
    hist = torch.empty(rows, num_chunks, 1 << nbits, dtype=torch.int32, device=src.device)
    meta = torch.zeros(rows, 4, dtype=torch.int32, device=src.device)
    _hist_kernel[(num_chunks, rows)](
        src,
        hist,
        meta,
        n,
        src.stride(0),
        lo,
        num_chunks,
        bpc,
        SHIFT=0,
        NBITS=nbits,
        FIRST=True,
        IS_FLOAT=False,
        BLOCK=block,
    )
    out = topk_from_histogram(src, hist, num_chunks, bpc, k, lo, nbits, hi - lo + 1, block)
    return out.reshape(*scores.shape[:-1], k)


def select_topk_float(scores: torch.Tensor, k: int) -> torch.Tensor:
    src = _rows(scores)
    rows, n = src.shape
    dev = src.device
    block = 1024 if n >= 8192 else 256
    num_chunks, bpc = chunking(rows, n, block, dev)
    meta = torch.zeros(rows, 4, dtype=torch.int32, device=dev)
    gt = torch.empty(rows, num_chunks, dtype=torch.int32, device=dev)
    eq = torch.empty(rows, num_chunks, dtype=torch.int32, device=dev)
    hist = torch.empty(rows, num_chunks, 1 << 11, dtype=torch.int32, device=dev)
    for level, (shift, nbits) in enumerate(_FLOAT_LEVELS):
        first, last = level == 0, level == len(_FLOAT_LEVELS) - 1
        h = hist.view(-1)[: rows * num_chunks << nbits].view(rows, num_chunks, 1 << nbits)
        _hist_kernel[(num_chunks, rows)](
            src,
            h,
            meta,
            n,
            src.stride(0),
            0,
            num_chunks,
            bpc,
            SHIFT=shift,
            NBITS=nbits,
            FIRST=first,
            IS_FLOAT=True,
            BLOCK=block,
        )
        _threshold_kernel[(rows,)](
            h, meta, gt, eq, k, num_chunks, 1 << nbits, NBITS=nbits, FIRST=first, LAST=last
        )
    out = torch.empty(rows, k, dtype=torch.int64, device=dev)
    _compact_kernel[(num_chunks, rows)](
        src, out, meta, gt, eq, n, src.stride(0), 0, k, num_chunks, bpc, IS_FLOAT=True, BLOCK=block
    )
    return out.reshape(*scores.shape[:-1], k)
