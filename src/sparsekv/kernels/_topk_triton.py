"""Sort-free top-k on the GPU: radix select with small digits, then a deterministic compaction.

Scores map to uint32 keys whose order is the score order (int: score - lo; float: sign-flipped bits). The key is
cut into LEVELS digits of NBITS bits (int scores of range 513 -> 2 x 5 bits; floats -> 4 x 8 bits). Level l
writes, per (row, chunk), a 2**NBITS-bin histogram of digit l over the keys whose higher digits equal the
threshold prefix found from levels < l. Every later kernel re-derives that prefix from the stored histograms
(a few KB from L2), so there is no separate threshold launch. The compaction writes every key above the final
threshold and the first `need` (by position) equal to it: exactly k, deterministic.

Histograms stay small on purpose: triton's histogram costs about bins/32 * log2(bins) operations per element,
and 1024 bins made the first version 9x slower than scoring itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the scorer's histogram helpers live in _scorer_hist_triton; _hamming_triton imports them from here
from sparsekv.kernels._scorer_hist_triton import (  # noqa: F401
    level_digit,
    packed_add,
    packed_bits,
    packed_counts,
    window_base,
    window_digit,
)
from sparsekv.kernels._tl_utils import chunk_and_row, pdl_enter, popcount_tl, scatter_store_i64
from sparsekv.kernels._triton import pdl_launch, row_grid

INT_DIGIT_BITS = 5
FLOAT_DIGIT_BITS = 8
MAX_BINS = 1 << 20  # int scores whose range is below this take the radix path (4 levels of 5 bits)


@triton.jit
def sortable_key(s, lo, IS_FLOAT: tl.constexpr):
    # uint32 key whose unsigned order is the score order
    if IS_FLOAT:
        b = s.to(tl.float32).to(tl.int32, bitcast=True)
        b = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: reverse the order of their magnitude bits
        return (b ^ -2147483648).to(tl.uint32, bitcast=True)  # flip the sign bit: signed -> unsigned order
    else:
        return (s.to(tl.int32) - lo).to(tl.uint32, bitcast=True)


@triton.jit
def derive_threshold(
    hist_ptr, r, num_rows, num_chunks, k, LEVELS: tl.constexpr, NBITS: tl.constexpr, CP: tl.constexpr
):
    """From the histograms of levels 0..LEVELS-1 of row r: (key prefix, k still to place among keys equal to the
    prefix, per-chunk count above the prefix [CP], per-chunk count equal at the last level [CP])."""
    NB: tl.constexpr = 1 << NBITS
    bins = tl.arange(0, NB)
    chunks = tl.arange(0, CP)
    cmask = chunks < num_chunks
    prefix = tl.zeros([], dtype=tl.int32)
    k_rem = tl.zeros([], dtype=tl.int32) + k
    gt_chunk = tl.zeros([CP], dtype=tl.int32)
    eq_chunk = tl.zeros([CP], dtype=tl.int32)
    for level in tl.static_range(LEVELS):
        # int64: levels x rows x chunks x bins can pass 2**31 (float keys, 256 bins: 4 levels of 2M rows)
        base = hist_ptr + ((level * num_rows + r.to(tl.int64)) * num_chunks) * NB
        h = tl.load(base + chunks[:, None] * NB + bins[None, :], mask=cmask[:, None], other=0)
        tot = tl.sum(h, axis=0)
        ge = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # keys with digit >= bin
        t = tl.max(tl.where(ge >= k_rem, bins, -1), axis=0)
        above = bins[None, :] > t
        gt_chunk += tl.sum(tl.where(above, h, 0), axis=1)
        eq_chunk = tl.sum(tl.where(bins[None, :] == t, h, 0), axis=1)
        k_rem -= tl.sum(tl.where(bins > t, tot, 0), axis=0)
        prefix = (prefix << NBITS) | t
    return prefix, k_rem, gt_chunk, eq_chunk


@triton.jit
def window_threshold(hist_ptr, base_ptr, r, num_rows, num_chunks, k, top, LEVELS: tl.constexpr,
                     NBITS: tl.constexpr, CP: tl.constexpr):  # fmt: skip
    """derive_threshold over the window histogram (stored after the LEVELS radix levels), with its base and
    whether the threshold bin holds a single score (then it is exact and the radix levels are not needed)."""
    NB: tl.constexpr = 1 << NBITS
    base = tl.load(base_ptr + r)
    window = tl.full([], LEVELS, tl.int64) * num_rows * num_chunks * NB  # int64, as every histogram offset
    t, k_rem, gt_chunk, eq_chunk = derive_threshold(
        hist_ptr + window, r, num_rows, num_chunks, k, 1, NBITS, CP
    )
    exact = ((t >= 1) & (t <= NB - 2)) | ((t == 0) & (base == 0)) | ((t == NB - 1) & (base + NB - 1 >= top))
    return t, k_rem, gt_chunk, eq_chunk, base, exact


# tile and warps of the level and compaction kernels (scripts/gpu_probe.py sweep)
SELECT_TUNE = {"block": 512, "num_warps": 2}


@triton.jit
def digit_histogram(
    key,
    nmask,
    prefix,
    SHIFT: tl.constexpr,
    NBITS: tl.constexpr,
    FIRST: tl.constexpr,
):
    """Histogram (2**NBITS bins) of digit (key >> SHIFT) of the valid keys whose higher bits equal `prefix`."""
    digit = ((key >> SHIFT) & ((1 << NBITS) - 1)).to(tl.int32)
    ok = nmask
    if not FIRST:
        ok = ok & ((key >> (SHIFT + NBITS)) == prefix.to(tl.uint32))
    digit = tl.where(ok, digit, 0)
    h = tl.histogram(digit, 1 << NBITS)
    # excluded lanes were counted in bin 0 (histogram's mask argument is not in every triton version)
    n_out = tl.sum((~ok).to(tl.int32), axis=0)
    return tl.where(tl.arange(0, 1 << NBITS) == 0, h - n_out, h)


@triton.jit
def chunk_length(c, num_chunks, chunk_len, n_load):
    """Keys in chunk c (a multiple of 16, so that masked loads stay vectors): chunk_len, except the last chunk,
    which runs to the end of the row (see `chunking`)."""
    return tl.where(c == num_chunks - 1, (n_load - c * chunk_len + 15) // 16 * 16, chunk_len)


@triton.jit
def row_count(counts_ptr, r, k, COUNTS: tl.constexpr):
    """How many keys row r selects: its entry of counts (at most k) with COUNTS, else k."""
    if COUNTS:
        return tl.minimum(tl.load(counts_ptr + r).to(tl.int32), k)
    return k


@triton.jit
def pad_tail(out_row, kept, k, c, BLOCK: tl.constexpr):
    """Chunk 0's program fills a row's entries [kept, k) with position 0 (padding: in range, never valid)."""
    if c == 0:
        for j in range(kept, k, BLOCK):
            offs = j + tl.arange(0, BLOCK)
            tl.store(out_row + offs, tl.zeros([BLOCK], dtype=tl.int64), mask=offs < k)


@triton.jit
def _hist_kernel(
    src_ptr,
    hist_ptr,
    N,
    n_load,
    stride_row,
    lo,
    k,
    num_rows,
    num_chunks,
    blocks_per_chunk,
    LEVEL: tl.constexpr,
    LEVELS: tl.constexpr,
    NBITS: tl.constexpr,
    CP: tl.constexpr,
    IS_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
    WINDOW: tl.constexpr = False,
    base_ptr=None,
    top=0,
    USE_PDL: tl.constexpr = False,
    counts_ptr=None,
    COUNTS: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    c, r = chunk_and_row()
    kept = row_count(counts_ptr, r, k, COUNTS)
    if WINDOW:  # the radix levels run only for rows whose threshold fell outside the window
        _t, _k, _g, _e, _b, exact = window_threshold(
            hist_ptr, base_ptr, r, num_rows, num_chunks, kept, top, LEVELS, NBITS, CP
        )
        needed = exact == 0
    else:
        needed = True
    if needed:
        _level_pass(src_ptr, hist_ptr, N, n_load, stride_row, lo, kept, num_rows, num_chunks, blocks_per_chunk, c,
                    r, LEVEL, LEVELS, NBITS, CP, IS_FLOAT, BLOCK)  # fmt: skip


@triton.jit
def _level_pass(src_ptr, hist_ptr, N, n_load, stride_row, lo, k, num_rows, num_chunks, blocks_per_chunk, c, r,
                LEVEL: tl.constexpr, LEVELS: tl.constexpr, NBITS: tl.constexpr, CP: tl.constexpr,
                IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    if LEVEL > 0:
        prefix, _k, _g, _e = derive_threshold(hist_ptr, r, num_rows, num_chunks, k, LEVEL, NBITS, CP)
    else:
        prefix = tl.zeros([], dtype=tl.int32)
    SHIFT: tl.constexpr = NBITS * (LEVELS - 1 - LEVEL)
    out = hist_ptr + ((LEVEL * num_rows + r.to(tl.int64)) * num_chunks + c) * (1 << NBITS)
    if LEVEL > 0:
        # Past level 0 only the keys under the prefix count (a few percent of them): each adds one to its bin
        # with an atomic, in this program's own zeroed bins, instead of every key going through tl.histogram,
        # which made the pass ALU-bound (H200, 128K x B28, 224 rows: 87 -> 50 us at level 1, 84 -> 37 at
        # level 2). The barrier orders the zeroing before any thread's atomics.
        tl.store(out + tl.arange(0, 1 << NBITS), tl.zeros([1 << NBITS], dtype=tl.int32))
        tl.debug_barrier()
    h = tl.zeros([1 << NBITS], dtype=tl.int32)
    row_ptr = src_ptr + r.to(tl.int64) * stride_row
    length = chunk_length(c, num_chunks, blocks_per_chunk, n_load)
    first = c * blocks_per_chunk + tl.arange(0, BLOCK)
    nxt = tl.load(row_ptr + first, mask=(first < n_load) & (tl.arange(0, BLOCK) < length), other=0)
    # chunk c = keys from c * blocks_per_chunk (runtime: chunk length in elements) on, read BLOCK at a time
    for i in range(0, length, BLOCK):
        loc = i + tl.arange(0, BLOCK)
        offs = c * blocks_per_chunk + loc
        nmask = (offs < N) & (loc < length)
        # the next tile's load is in flight while this one is counted
        s = nxt
        nxt = tl.load(
            row_ptr + offs + BLOCK, mask=(offs + BLOCK < n_load) & (loc + BLOCK < length), other=0
        )
        key = sortable_key(s, lo, IS_FLOAT)
        if LEVEL > 0:
            digit, ok = level_digit(key, nmask, prefix, SHIFT, NBITS, False)
            tl.atomic_add(out + digit, 1, mask=ok, sem="relaxed")
        else:
            h += digit_histogram(key, nmask, prefix, SHIFT, NBITS, True)
    if LEVEL == 0:
        tl.store(out + tl.arange(0, 1 << NBITS), h)


@triton.jit
def row_threshold(hist_ptr, base_ptr, hint_ptr, r, c, lo, k, num_rows, num_chunks, top, LEVELS: tl.constexpr,
                  NBITS: tl.constexpr, CP: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """Row r's threshold key, equal keys still to place, the keys above / equal to it in the chunks before c
    (chunk c's first slots) and each chunk's equal keys, from the window histogram where it pins the threshold
    down, else from the radix levels. With WINDOW, chunk 0 stores the threshold score to
    `hint_ptr` (the next decode step centres its window on it)."""
    if WINDOW:
        thr, need_eq, gt_chunk, eq_chunk, base, exact = window_threshold(
            hist_ptr, base_ptr, r, num_rows, num_chunks, k, top, LEVELS, NBITS, CP
        )
        if exact:  # the threshold bin holds the one score base + t: compare the keys with it directly
            thr = base + thr - lo
        else:
            thr, need_eq, gt_chunk, eq_chunk = derive_threshold(
                hist_ptr, r, num_rows, num_chunks, k, LEVELS, NBITS, CP
            )
        tl.store(hint_ptr + r, thr + lo, mask=c == 0)
    else:
        thr, need_eq, gt_chunk, eq_chunk = derive_threshold(
            hist_ptr, r, num_rows, num_chunks, k, LEVELS, NBITS, CP
        )
    before = tl.arange(0, CP) < c
    base_gt = tl.sum(tl.where(before, gt_chunk, 0), axis=0)
    base_eq = tl.sum(tl.where(before, eq_chunk, 0), axis=0)
    return thr, need_eq, base_gt, base_eq, eq_chunk


@triton.jit
def _scan_store(packed, total, m_gt, m_eq, pos, out_row, base_gt, base_eq, cnt_gt, need_eq,
                INLINE_STORE: tl.constexpr):
    cs = tl.cumsum(packed, axis=0)
    rank = base_eq + (cs >> 16) - 1
    # one slot per key (-1: not selected) and one store. tl.store would run in a register layout of its own, each
    # value taken from the scan's layout a shared-memory round trip; on the GPU scatter_store_i64 stores in place
    slot = tl.where(m_gt, base_gt + (cs & 0xFFFF) - 1, tl.where(m_eq & (rank < need_eq), cnt_gt + rank, -1))
    scatter_store_i64(out_row + slot, pos, slot >= 0, INLINE_STORE)
    return base_gt + (total & 0xFFFF), base_eq + (total >> 16)


@triton.jit
def _compact_kernel(
    src_ptr,
    out_ptr,
    hist_ptr,
    N,
    n_load,
    stride_row,
    lo,
    k,
    num_rows,
    num_chunks,
    blocks_per_chunk,
    LEVELS: tl.constexpr,
    NBITS: tl.constexpr,
    CP: tl.constexpr,
    IS_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
    REVERSE: tl.constexpr = False,
    WINDOW: tl.constexpr = False,
    base_ptr=None,
    hint_ptr=None,
    top=0,
    USE_PDL: tl.constexpr = False,
    INLINE_STORE: tl.constexpr = False,
    counts_ptr=None,
    COUNTS: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    c, r = chunk_and_row()
    out_row = out_ptr + r.to(tl.int64) * k
    kept = row_count(counts_ptr, r, k, COUNTS)
    if COUNTS:
        pad_tail(out_row, kept, k, c, BLOCK)
    thr, need_eq, base_gt, base_eq, _ = row_threshold(
        hist_ptr, base_ptr, hint_ptr, r, c, lo, kept, num_rows, num_chunks, top, LEVELS, NBITS, CP, WINDOW
    )
    thr = thr.to(tl.uint32, bitcast=True)
    cnt_gt = kept - need_eq  # keys strictly above the threshold, all selected
    row_ptr = src_ptr + r.to(tl.int64) * stride_row
    length = chunk_length(c, num_chunks, blocks_per_chunk, n_load)
    first = c * blocks_per_chunk + tl.arange(0, BLOCK)
    nxt = tl.load(row_ptr + first, mask=(first < n_load) & (tl.arange(0, BLOCK) < length), other=0)
    for i in range(0, length, BLOCK):
        loc = i + tl.arange(0, BLOCK)
        offs = c * blocks_per_chunk + loc
        nmask = (offs < N) & (loc < length)
        # the next tile's load is in flight during this tile's scan and stores
        raw = nxt
        nxt = tl.load(
            row_ptr + offs + BLOCK, mask=(offs + BLOCK < n_load) & (loc + BLOCK < length), other=0
        )
        key = sortable_key(raw, lo, IS_FLOAT)
        m_gt = nmask & (key > thr)
        m_eq = nmask & (key == thr)
        # REVERSE: the scores were stored newest key first; report the keys' own positions
        pos = ((N - 1 - offs) if REVERSE else offs).to(tl.int64)
        m_eq = m_eq & (
            (base_eq + tl.zeros_like(offs)) < need_eq
        )  # equal keys past the quota need no scan
        # one scan for both classes: counts above the threshold in the low 16 bits, equal in the high bits
        packed = m_gt.to(tl.int32) + (m_eq.to(tl.int32) << 16)
        total = tl.sum(packed, axis=0)
        if total != 0:  # skip the scan of tiles without a selected key
            base_gt, base_eq = _scan_store(packed, total, m_gt, m_eq, pos, out_row, base_gt, base_eq,
                                           cnt_gt, need_eq, INLINE_STORE)  # fmt: skip


SCORE_PAIRS = 4  # 32-bit words of two int16 scores per thread and tile row: one 16-byte load, 8 keys


@triton.jit
def _pair_bits(words, const, W: tl.constexpr):
    """[R, W] uint32 words, each two int16 scores in [0, 2**15) -> [R] int32 masks whose bit 2j (2j + 1) is set
    where the low (high) score of word j plus `const` reaches 2**15. Both halves add in one 32-bit add: a score
    below 2**15 plus a constant below 2**15 never carries into the other half."""
    hit = ((words & 0x7FFF7FFF) + const) & 0x80008000
    pair = ((hit >> 15) & 1) | ((hit >> 30) & 2)
    return tl.sum(pair.to(tl.int32) << (2 * tl.arange(0, W))[None, :], axis=1)


def _store_bits_asm(step: str) -> str:
    """PTX of _store_bits: $1 m_gt, $2 gt_slot, $3 m_eq, $4 eq_slot, $5 pos0, $6 out_row, $7 eq_allowed. Each
    pass takes the lowest set bit b (bfind of m & -m), clears it and stores pos0 -/+ b at slot s, s + 1, ..."""
    store = (
        "neg.s32 low, m; and.b32 low, m, low; xor.b32 m, m, low; bfind.u32 j, low; cvt.s64.s32 jj, j; "
        f"{step} v, $5, jj; mul.wide.s32 a, s, 8; add.s64 a, a, $6; st.global.b64 [a], v; add.s32 s, s, 1; "
    )
    return (
        "{ .reg .pred p; .reg .b32 m, low, j, s, n; .reg .b64 a, v, jj; mov.b32 m, $1; mov.b32 s, $2; "
        f"GT${{:uid}}: setp.eq.b32 p, m, 0; @p bra EQ${{:uid}}; {store}bra GT${{:uid}}; "
        "EQ${:uid}: mov.b32 m, $3; mov.b32 s, $4; mov.b32 n, $7; "
        f"EQL${{:uid}}: setp.eq.b32 p, m, 0; setp.eq.or.b32 p, n, 0, p; @p bra END${{:uid}}; {store}"
        "sub.s32 n, n, 1; bra EQL${:uid}; END${:uid}: mov.b32 $0, 0; }"
    )


STORE_BITS_ASM = tl.constexpr((_store_bits_asm("add.s64"), _store_bits_asm("sub.s64")))


@triton.jit
def _store_bits(out_row, m_gt, gt_slot, m_eq, eq_slot, eq_allowed, pos0, KEYS: tl.constexpr, REVERSE: tl.constexpr,
                INLINE: tl.constexpr, USE_POPC: tl.constexpr):  # fmt: skip
    """Each thread writes the positions of its row's selected keys: every set bit b of m_gt to slots gt_slot,
    gt_slot + 1, ... and the first eq_allowed set bits of m_eq to eq_slot, ...; key b's position is pos0 + b
    (pos0 - b with REVERSE). INLINE (GPU): a PTX loop over the set bits, so a thread with nothing selected, the
    usual case at a 2% budget, does no per-key work. Otherwise one masked store per bit."""
    if INLINE:
        tl.inline_asm_elementwise(
            STORE_BITS_ASM[1] if REVERSE else STORE_BITS_ASM[0],
            "=r,r,r,r,r,l,l,r",
            [m_gt, gt_slot, m_eq, eq_slot, pos0, out_row, eq_allowed],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        for b in tl.static_range(KEYS):
            below = (1 << b) - 1
            eq_rank = popcount_tl(m_eq & below, USE_POPC)
            slot = tl.where(
                ((m_gt >> b) & 1) != 0,
                gt_slot + popcount_tl(m_gt & below, USE_POPC),
                tl.where((((m_eq >> b) & 1) != 0) & (eq_rank < eq_allowed), eq_slot + eq_rank, -1),
            )
            pos = (pos0 - b) if REVERSE else (pos0 + b)
            tl.store(out_row + slot, pos, mask=slot >= 0)


@triton.jit
def _compact_pairs_kernel(
    src_ptr,
    out_ptr,
    hist_ptr,
    N,
    n_load,
    stride_row,
    lo,
    k,
    num_rows,
    num_chunks,
    blocks_per_chunk,
    LEVELS: tl.constexpr,
    NBITS: tl.constexpr,
    CP: tl.constexpr,
    BLOCK: tl.constexpr,
    W: tl.constexpr,
    REVERSE: tl.constexpr = False,
    WINDOW: tl.constexpr = False,
    base_ptr=None,
    hint_ptr=None,
    top=0,
    INLINE: tl.constexpr = False,
    USE_POPC: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    counts_ptr=None,
    COUNTS: tl.constexpr = False,
):
    """The compaction of int16 scores in [0, 2**15) on bit masks: the same output as _compact_kernel's scan mode
    (keys above the threshold by position, then the first `need` equal ones). A thread compares two scores per
    32-bit add, turns its 2W keys into two bit masks, and the block scan runs over one count pair per thread
    instead of one per key."""
    pdl_enter(USE_PDL)
    c, r = chunk_and_row()
    KEYS: tl.constexpr = 2 * W
    R: tl.constexpr = BLOCK // KEYS
    words_row = (src_ptr + r.to(tl.int64) * stride_row).to(tl.pointer_type(tl.int32))
    out_row = out_ptr + r.to(tl.int64) * k
    kept = row_count(counts_ptr, r, k, COUNTS)
    if COUNTS:
        pad_tail(out_row, kept, k, c, BLOCK)
    chunk0 = c * blocks_per_chunk
    length = chunk_length(c, num_chunks, blocks_per_chunk, n_load)
    limit = tl.minimum(N, chunk0 + length)
    rows = tl.arange(0, R)
    cols = tl.arange(0, W)
    # pairs_ok: rows are 16-byte aligned and n_load a multiple of KEYS, so a row that starts below the limit
    # lies inside the buffer, and a mask of one value per row keeps the load one vector. The first tile is
    # requested before the threshold is derived: its latency overlaps the histogram reads.
    widx = chunk0 // 2 + rows[:, None] * W + cols[None, :]
    nxt = tl.load(words_row + widx, mask=(chunk0 + rows * KEYS < limit)[:, None], other=0)
    thr, need_eq, base_gt, base_eq, _ = row_threshold(
        hist_ptr, base_ptr, hint_ptr, r, c, lo, kept, num_rows, num_chunks, top, LEVELS, NBITS, CP, WINDOW
    )
    t = thr + lo  # the threshold as a score
    # score > t  <=>  score + (0x7FFF - t) reaches 2**15;  score >= t  <=>  score + (0x8000 - t) does
    c_gt = (0x7FFF - t).to(tl.uint32)
    c_ge = (0x8000 - t).to(tl.uint32)
    c_gt = (c_gt << 16) | c_gt
    c_ge = (c_ge << 16) | c_ge
    cnt_gt = kept - need_eq
    for i in range(0, length, BLOCK):
        key0 = chunk0 + i + rows * KEYS  # first key of each thread's row
        words = nxt.to(tl.uint32, bitcast=True)
        # the next tile's load is in flight while this one is compared and stored
        nxt = tl.load(words_row + widx + (i + BLOCK) // 2, mask=(key0 + BLOCK < limit)[:, None], other=0)
        valid = (1 << tl.minimum(tl.maximum(limit - key0, 0), KEYS)) - 1
        m_gt = _pair_bits(words, c_gt, W) & valid
        m_eq = (_pair_bits(words, c_ge, W) & ~m_gt) & valid
        m_eq = tl.where(base_eq < need_eq, m_eq, 0)  # equal keys past the quota are not stored
        n_eq = popcount_tl(m_eq, USE_POPC)
        packed = popcount_tl(m_gt, USE_POPC) + (n_eq << 16)
        total = tl.sum(packed, axis=0)
        if total != 0:
            before = tl.cumsum(packed, axis=0) - packed
            eq_rank = base_eq + (before >> 16)
            allowed = tl.minimum(tl.maximum(need_eq - eq_rank, 0), n_eq)
            pos0 = ((N - 1 - key0) if REVERSE else key0).to(tl.int64)
            _store_bits(out_row + tl.zeros_like(rows), m_gt, base_gt + (before & 0xFFFF), m_eq, cnt_gt + eq_rank,
                        allowed, pos0, KEYS, REVERSE, INLINE, USE_POPC)  # fmt: skip
            base_gt += total & 0xFFFF
            base_eq += total >> 16


def chunking(
    rows: int, n: int, block: int, device: torch.device, max_chunks: int = 128, progs_per_sm: int = 16,
    max_tiles: int | None = None,
) -> tuple[int, int]:
    """(num_chunks, blocks_per_chunk): enough programs to fill the GPU, each streaming several blocks; chunk c
    starts at block c * blocks_per_chunk, and the last chunk ends with the row. max_tiles: at least as many chunks
    as keep each one within that many blocks (up to max_chunks)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    blocks = triton.cdiv(n, block)
    # progs_per_sm programs per SM at most: 64 rows of 131077 keys in 17 chunks left 32 programs for a second wave
    # (H200: score + select 86.4 us, 79.9 us in 16 chunks). Whether they are one wave depends on the compiled
    # kernel: triton 3.6 gives the scorer 72 registers, 7 programs per SM, and capping it at 8 was slower
    # (docs/kernels-notes.md, Hamming scorer)
    want_chunks = max(1, progs_per_sm * sms // rows)
    if max_tiles is not None:
        want_chunks = max(want_chunks, triton.cdiv(blocks, max_tiles))
    want_chunks = min(max_chunks, want_chunks)
    # The last chunk always runs to the end of the row. A row a tile or two longer than want_chunks equal
    # chunks (decode lengths 2**17 + t: 257 tiles of 512 for 16 chunks) gives those tiles to the last chunk
    # rather than one more tile to every chunk (17 each: score + select 69.6 vs 65.1 us at 2**17, H200).
    even = blocks // want_chunks
    if even >= 8 and blocks - even * want_chunks <= even // 8:
        return want_chunks, even
    blocks_per_chunk = max(1, triton.cdiv(blocks, want_chunks))
    return triton.cdiv(blocks, blocks_per_chunk), blocks_per_chunk


def max_chunk_tiles(n: int, block: int, num_chunks: int, bpc: int) -> int:
    """Tiles of `block` keys in the longest chunk: the last chunk runs to the end of the row (`chunking`)."""
    return max(bpc, triton.cdiv(n, block) - (num_chunks - 1) * bpc)


def max_chunks(nbits: int) -> int:
    """Chunks per row such that one [chunks, bins] histogram tile stays in registers when re-derived."""
    return max(1, min(128, 8192 >> nbits))


def int_levels(num_values: int) -> tuple[int, int]:
    """(levels, digit bits) of the radix select over keys 0..num_values-1."""
    key_bits = max(1, (num_values - 1).bit_length())
    nbits = min(INT_DIGIT_BITS, key_bits)
    return triton.cdiv(key_bits, nbits), nbits


def _sblock(chunk_len: int) -> int:
    # measured on the H200 (docs/kernels-notes.md): whole-chunk tiles of 4096-8192 keys made the
    # compaction 1.5x slower than a loop over 512-key tiles; 512 keys with 2 warps (SELECT_TUNE) are the fastest
    return min(SELECT_TUNE["block"], triton.next_power_of_2(chunk_len))


def _dense_counts(counts: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read row r's count at counts_ptr + r: one shared budget expanded over the rows (stride 0) is
    copied out first, or every row past the first would read past the tensor."""
    return None if counts is None else counts.contiguous()  # no copy where it already is


def radix_levels(src, k, *, lo, levels, nbits, is_float, block, num_chunks, bpc, hist=None, first_done=False,
                 window=None, n_load=None, counts=None):  # fmt: skip
    """Histogram levels of the radix select (level 0 skipped when a fused scoring kernel already wrote it).
    Chunk c covers keys [c * bpc * block, (c + 1) * bpc * block), the last chunk to the end of the row: the
    same split as the histograms.
    window=(base [R] int32, top): the scorer wrote a threshold-window histogram after the levels; the levels
    then run only for the rows whose threshold it did not pin down (launched for every row: no host sync).
    n_load: how far each row may be read (default N). Rows padded to a multiple of 16 keep the score loads
    vectorized when N is not one (a mask that ends mid-vector splits them into 2-byte loads).
    counts: int32 [R] on the device, how many keys each row selects (at most k; see radix_compact)."""
    rows, n = src.shape
    n_load = n if n_load is None else n_load
    base, top = window if window is not None else (None, 0)
    counts = _dense_counts(counts)
    if hist is None:
        hist = torch.empty(levels, rows, num_chunks, 1 << nbits, dtype=torch.int32, device=src.device)
    chunk_len = bpc * block
    sb = _sblock(chunk_len)
    for level in range(1 if first_done else 0, levels):
        _hist_kernel[row_grid("topk", src.shape, num_chunks, rows)](
            src, hist, n, n_load, src.stride(0), lo, k, rows, num_chunks, chunk_len,
            LEVEL=level, LEVELS=levels, NBITS=nbits, CP=triton.next_power_of_2(num_chunks), IS_FLOAT=is_float,
            BLOCK=sb,
            WINDOW=window is not None, base_ptr=base, top=top, num_warps=SELECT_TUNE["num_warps"],
            counts_ptr=counts, COUNTS=counts is not None, **pdl_launch(src.device),
        )  # fmt: skip
    return hist


def pairs_ok(src: torch.Tensor, lo: int, is_float: bool, n_load: int, chunk_len: int) -> bool:
    """Whether _compact_pairs_kernel can read src: int16 scores >= 0 (lo >= 0), rows of 16-byte tiles."""
    keys = 2 * SCORE_PAIRS
    aligned = src.stride(0) % keys == 0 and n_load % keys == 0 and chunk_len % keys == 0 and src.data_ptr() % 16 == 0
    return src.dtype == torch.int16 and not is_float and lo >= 0 and aligned


def radix_compact(src, k, hist, *, lo, levels, nbits, is_float, block, num_chunks, bpc, reverse=False,
                  window=None, hint=None, n_load=None, counts=None):  # fmt: skip
    """The k positions above / at the threshold that the histograms define: [R, k] int64, deterministic
    (`reverse`: src holds the keys newest first, and N - 1 - position comes out). With `window` (see
    radix_levels) each row's threshold score is written to `hint` [R] int32 for the next call. int16 scores >= 0
    take the bit-mask compaction (`pairs_ok`), the others the ordered scan: the same output either way.
    counts (int32 [R], each at most k): row r selects its counts[r] best keys into entries [0, counts[r]) and
    fills the rest with position 0."""
    rows, n = src.shape
    n_load = n if n_load is None else n_load
    counts = _dense_counts(counts)
    chunk_len = bpc * block
    sb = _sblock(chunk_len)
    assert sb < 1 << 16, "the compaction packs two per-block counts into one int32 scan"
    out = torch.empty(rows, k, dtype=torch.int64, device=src.device)
    # the compaction reads no counter: no fill kernel. Without one between the level passes and the compaction, the
    # compaction launches early (PDL) and its programs sit resident while the level passes work. H200, same run:
    # in-window step 119.0 -> 117.5 us (128K x B8) and 32.6 -> 30.8 us (32K x B1), but a window miss 76 -> 108 us
    # and a B8 select without window 51 -> 72 us. Releasing the launch at the end of the level kernel instead gave
    # back all four (docs/kernels-notes.md); decoding is in the window 97-99.9% of steps, so the early launch stays.
    win = {"WINDOW": window is not None, "base_ptr": window[0] if window else None, "hint_ptr": hint,
           "top": window[1] if window else 0, "counts_ptr": counts, "COUNTS": counts is not None}  # fmt: skip
    if pairs_ok(src, lo, is_float, n_load, chunk_len):
        _compact_pairs_kernel[row_grid("topk", src.shape, num_chunks, rows)](
            src, out, hist, n, n_load, src.stride(0), lo, k, rows, num_chunks, chunk_len,
            LEVELS=levels, NBITS=nbits, CP=triton.next_power_of_2(num_chunks),
            BLOCK=max(sb, 2 * SCORE_PAIRS), W=SCORE_PAIRS, REVERSE=reverse, INLINE=src.is_cuda,
            USE_POPC=src.is_cuda, num_warps=SELECT_TUNE["num_warps"], **win, **pdl_launch(src.device),
        )  # fmt: skip
        return out
    _compact_kernel[row_grid("topk", src.shape, num_chunks, rows)](
        src, out, hist, n, n_load, src.stride(0), lo, k, rows, num_chunks, chunk_len,
        LEVELS=levels, NBITS=nbits, CP=triton.next_power_of_2(num_chunks), IS_FLOAT=is_float, BLOCK=sb,
        REVERSE=reverse,
        INLINE_STORE=src.is_cuda, num_warps=SELECT_TUNE["num_warps"], **win, **pdl_launch(src.device),
    )  # fmt: skip
    return out


def radix_topk(
    src, k, *, lo, levels, nbits, is_float, block, num_chunks, bpc, hist=None, first_done=False, reverse=False,
    window=None, hint=None, n_load=None, counts=None,
):
    """Histogram levels + compaction. src [R, N] (unit column stride) -> [R, k] int64 (see radix_compact)."""
    kw = {
        "lo": lo,
        "levels": levels,
        "nbits": nbits,
        "is_float": is_float,
        "block": block,
        "num_chunks": num_chunks,
        "bpc": bpc,
        "n_load": n_load,
    }
    hist = radix_levels(src, k, hist=hist, first_done=first_done, window=window, counts=counts, **kw)
    return radix_compact(src, k, hist, reverse=reverse, window=window, hint=hint, counts=counts, **kw)


def _rows(scores: torch.Tensor) -> torch.Tensor:
    flat = scores.reshape(-1, scores.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _block(n: int) -> int:
    return 1024 if n >= 16384 else 256


def _select(scores: torch.Tensor, k: int, lo: int, levels: int, nbits: int, is_float: bool,
            counts: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    src = _rows(scores)
    rows, n = src.shape
    block = _block(n)
    num_chunks, bpc = chunking(rows, n, block, src.device, max_chunks=max_chunks(nbits))
    out = radix_topk(src, k, lo=lo, levels=levels, nbits=nbits, is_float=is_float, block=block,
                     num_chunks=num_chunks, bpc=bpc, counts=counts)  # fmt: skip
    return out.reshape(*scores.shape[:-1], k)


def select_topk_int(scores: torch.Tensor, k: int, lo: int, hi: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    levels, nbits = int_levels(hi - lo + 1)
    return _select(scores, k, lo, levels, nbits, False, counts)


def select_topk_float(scores: torch.Tensor, k: int) -> torch.Tensor:
    nbits = FLOAT_DIGIT_BITS
    return _select(scores, k, 0, triton.cdiv(32, nbits), nbits, True)
