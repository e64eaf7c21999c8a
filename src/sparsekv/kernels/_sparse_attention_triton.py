"""Split-K (flash-decoding style) attention over gathered key positions.

One program owns one (batch, selection head, query) row and one slice of its index list; it gathers each listed
K/V row once and uses it for every query head that the row serves (the GQA group when S = Hkv, one head when
S = Hq). Where every query of a call shares its index list (indices expanded over Q, as in a dense forward of
several new tokens) one program serves all Q queries of its heads ("packed"): each K/V row is read once for the
G x Q query rows, each of which keeps its own `valid` row (causality among the new tokens). Partial outputs +
log-sum-exp per slice are merged either by the row's last program to finish (with `tickets`: a caller-owned int32
counter per row, zero between launches) or by a second small kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import chunk_and_row, pdl_enter
from sparsekv.kernels._triton import (
    MAX_TENSOR_NUMEL,
    check_grid,
    interpreting,
    next_pow2,
    pdl_launch,
    row_grid,
)

# launch parameters (the kernel benchmark sweeps them): tokens per step, programs per SM, warps, stages
TUNE = {"block": 64, "sm_mult": 4, "num_warps": 4, "num_stages": 3}
#: the most query rows (heads x queries) one program of a packed call holds (its accumulator is rows x d floats)
PACKED_ROWS = 64
#: where a K/V row has at most this many channels, a step takes twice TUNE's tokens (the same 16 KB tile of
#: 128-channel rows) while its program holds at most 16 query rows, or 32 that share one valid row. H200, graph
#: replays, the embedded model's shapes (64 channels, 3 kv heads x 3 query heads, B128): the dense step's attention
#: over 8,448 slots 259.5 -> 200.7 us (the bytes take 195 us), over 820 listed slots 37.3 -> 31.6 us; a
#: verification's 9 queries x 3 heads (32 rows) with a causal limit and one valid row 374.9 -> 269.8 us, with a
#: valid row per query 320 us at 64 tokens against 389 at 128. 128-channel rows (Llama 3 8B's) were fastest at 64.
NARROW_CHANNELS = 64
#: rows of more channels than this (Gemma 3's 256) take half TUNE's tokens a step where a program holds more than 16
#: query rows or reads a window (`start`). H200, graph replays, 1 kv head x 4 query heads, d 256, 32,800 written
#: slots: a verification's 9 queries at B128 1480 -> 1058 us (the bytes take 1012 us); a 512-slot window from its
#: start 32.2 -> 27.7 us at B128, 15.2 -> 8.6 us at B16 (the best launch of the sweep); one query over the whole
#: buffer stays at 64 tokens (B128: 1027 us at 64, 1193 at 32).
WIDE_CHANNELS = 128
#: ... and where such a program holds more than 32 query rows, each loading its own valid row, and reads a window,
#: a quarter of TUNE's tokens and half its programs per SM. H200, 9 queries x 4 heads, d 256, B128, a 512-slot
#: window: 96.9 -> 57.6 us (the bytes take 15.8 us). With one valid row for every query and a start per query (a
#: lossless verification's sliding layer) half TUNE's tokens is best: B192 78.2 us at 16 tokens, 66.3 at 32 (the
#: bytes take 23.7 us; programs per SM made no difference).
WINDOW_QUERY_ROWS = 32
#: shared memory a program may take (an H100's or H200's SM: 227 KB); a launch over it fails to compile
SHARED_MEMORY_BYTES = 232448
#: an in-order read (no index list, `EVERY_SLOT`) stages its K/V tiles in shared memory, `num_stages` deep: at most
#: this many bytes of them, which leaves two programs to an SM (float32 rows of 128 channels at 64 tokens, 3 stages:
#: 262,144 bytes, over an SM's)
EVERY_SLOT_STAGE_BYTES = 98304


def reads_in_order(channels: int, query_rows: int) -> bool:
    """Whether a call without an index list reads the slots in order (`EVERY_SLOT`) rather than through the list
    it stands for. H200, graph replays, a whole buffer under a kept row (`scripts/gpu_probe.py order`): in order is
    faster for one query at every width (64 channels, the embedded model's B128 step: 219 -> 202 us; 128, Llama 3
    8B's 128K x B4: 697 -> 505; 256, Gemma 3 270M's 32K x B192: 2,118 -> 1,417) and for many queries over wider
    rows (128 channels, 9 queries: 712 -> 608; 256: 2,324 -> 2,247), not for many queries over 64 channels (the
    embedded model's 9-query verification: 271 listed, 314 at best in order)."""
    return channels > NARROW_CHANNELS or query_rows <= 16


def default_block(channels: int, query_rows: int, row_per_query: bool = False, window: bool = False,
                  element_size: int = 2, every_slot: bool = False, rows_over_sms: bool = False) -> int:  # fmt: skip
    """Tokens per step of a program with `query_rows` query rows (heads x packed queries) of `channels` each;
    row_per_query: each query row loads its own valid row every step; window: the call reads from a `start`;
    element_size: bytes of a query / key channel; every_slot: the call reads the buffer's slots in order (no
    index list: Triton stages the K/V tiles in shared memory, `num_stages` of them); rows_over_sms: the call has
    more rows (batch x kv heads) than the device has SMs."""
    block = _listed_block(channels, query_rows, row_per_query, window, element_size)
    if every_slot and channels > NARROW_CHANNELS and query_rows <= 16 and not window:
        # one query in order (H200, graph replays): 128 channels take 32 tokens (498 us at 128K x B4, 529 at 64);
        # 256 channels 16 tokens while a row has several splits (B16: 152 us, 183 at 32; B128: 1,097, 1,289 at
        # 32), 32 once rows outnumber the SMs and a row has about two (B192: 1,417, about 1,700 at 16)
        block = 32 if channels <= WIDE_CHANNELS or rows_over_sms else 16
    while every_slot and block > 16 and TUNE["num_stages"] * block * channels * element_size * 2 > EVERY_SLOT_STAGE_BYTES:
        block //= 2
    return block


def _listed_block(channels: int, query_rows: int, row_per_query: bool, window: bool, element_size: int) -> int:
    """`default_block` of a call with an index list."""
    if channels > WIDE_CHANNELS:
        if window and row_per_query and query_rows > WINDOW_QUERY_ROWS:
            return TUNE["block"] // 4
        block = TUNE["block"] // 2 if query_rows > 16 or window else TUNE["block"]
        # float32 rows of 256 channels, 64 query rows: Triton's buffers for the dots' layout conversions take
        # 262,400 bytes of shared memory at 32 tokens (sm_90, scripts/kernel_sass.py), 196,736 at 16
        return block // 2 if element_size > 2 and query_rows > 32 else block
    wide = channels <= NARROW_CHANNELS and query_rows <= (16 if row_per_query else 32)
    return 2 * TUNE["block"] if wide else TUNE["block"]


def programs_per_sm(channels: int, query_rows: int, window: bool = False, row_per_query: bool = False) -> int:
    """How many programs of a row's splits an SM takes at most in one wave (the splits of a call), as
    `default_block`'s rows: TUNE's, or half of it for wide rows of many queries, each with its own valid row, over
    a window."""
    if channels > WIDE_CHANNELS and window and row_per_query and query_rows > WINDOW_QUERY_ROWS:
        return max(1, TUNE["sm_mult"] // 2)
    return TUNE["sm_mult"]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: 3xTF32 dots, about float32 accuracy on the tensor cores (one TF32 pass rounds scores to
    ~1e-3 and made a greedy token of the embedded model differ from the CPU path at a 0.01 logit margin).
    16-bit inputs ignore it. The interpreter computes in IEEE float32."""
    if interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def online_softmax_block(m_i, l_i, sc):
    """One block of log2-domain scores sc [G, BLOCK] (-inf = not attended) into the running max m_i and sum l_i
    [G]: returns (new max, the factor that rescales the old accumulator, the block's weights p, new sum)."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing attended yet stay at 0
    corr = tl.exp2(m_i - m_safe)
    p = tl.exp2(sc - m_safe[:, None])
    return m_new, corr, p, l_i * corr + tl.sum(p, axis=1)


@triton.jit
def store_split_partial(o_ptr, lse_ptr, row, sp, num_splits, acc, l_i, m_i, cols, D: tl.constexpr, row_mask,
                        col_mask):  # fmt: skip
    """One split's partial for `_combine_kernel`: the normalised output rows [G, DP] and their log2-sum-exp [G]
    (-inf for a split that attended nothing)."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + row * num_splits + sp, lse, mask=row_mask)
    tl.store(o_ptr + (row * num_splits + sp)[:, None] * D + cols[None, :], out,
             mask=row_mask[:, None] & col_mask[None, :])  # fmt: skip


@triton.jit
def merge_if_last(o_ptr, lse_ptr, out_ptr, tickets_ptr, r, row0, row_step, num_splits, D: tl.constexpr,
                  DP: tl.constexpr, G, GC: tl.constexpr, SP: tl.constexpr):  # fmt: skip
    """After a split's `store_split_partial`: the row's last split to arrive merges the partials of its G output
    rows (row0 + h * row_step) into out (what `_combine_kernel` does, without its launch) and zeroes the
    row's ticket for the next launch."""
    tl.debug_barrier()  # every thread's partial stores come before the ticket, which releases them (acq_rel)
    ticket = tl.atomic_add(tickets_ptr + r, 1, sem="acq_rel")
    if ticket == num_splits - 1:
        heads = tl.arange(0, GC)
        sp = tl.arange(0, SP)
        d = tl.arange(0, DP)
        rows = row0 + heads * row_step
        ok = (heads < G)[:, None] & (sp < num_splits)[None, :]
        # the other splits' partials were written on other SMs: read them from L2 (.cg), not this SM's L1
        lse = tl.load(lse_ptr + rows[:, None] * num_splits + sp[None, :], mask=ok, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        m = tl.max(lse, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # padding heads: every weight 0
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m[:, None]))
        o = tl.load(o_ptr + (rows[:, None, None] * num_splits + sp[None, :, None]) * D + d[None, None, :],
                    mask=ok[:, :, None] & (d < D)[None, None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        total = tl.sum(w, axis=1)
        res = tl.sum(o * w[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]  # padding heads: 0
        tl.store(out_ptr + rows[:, None] * D + d[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=(heads < G)[:, None] & (d < D)[None, :])  # fmt: skip
        tl.store(tickets_ptr + r, 0)


@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    valid_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    tickets_ptr,
    limit_ptr,
    start_ptr,
    S,
    Q,
    K,
    split_len,
    num_splits,
    HQ,
    g,
    qk_scale,
    sqb,
    sqh,
    sqq,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sib,
    sis,
    siq,
    svlb,
    svls,
    svlq,
    sstb,
    sstq,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
    VALID: tl.constexpr = True,
    MERGE: tl.constexpr = False,
    GC: tl.constexpr = 1,
    SP: tl.constexpr = 1,
    PREC: tl.constexpr = "tf32",
    USE_PDL: tl.constexpr = False,
    PACKED: tl.constexpr = False,
    LIMIT: tl.constexpr = False,
    VALID_PER_QUERY: tl.constexpr = True,
    CAUSAL: tl.constexpr = False,
    START: tl.constexpr = False,
    START_PER_QUERY: tl.constexpr = False,
    EVERY_SLOT: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    sp, r = chunk_and_row()
    # packed: the program's query rows are G heads x Q queries, head-major, and its grid row is (b, s); Q stays a
    # runtime value (one compiled kernel serves every Q whose G x Q rows fit GP)
    pack = Q if PACKED else 1
    rows_q = Q // pack
    qi = r % rows_q
    s = (r // rows_q) % S
    b = r // (rows_q * S)
    kvh = (s * G) // g
    heads = tl.arange(0, GP)
    head_of = heads // pack
    query_of = qi * pack + heads % pack
    hmask = heads < G * pack
    d = tl.arange(0, DP)
    dmask = d < D
    q = tl.load(
        q_ptr + b.to(tl.int64) * sqb + query_of[:, None].to(tl.int64) * sqq
        + (s * G + head_of[:, None]).to(tl.int64) * sqh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    i_base = idx_ptr + b.to(tl.int64) * sib + s.to(tl.int64) * sis + qi.to(tl.int64) * siq
    vl_base = valid_ptr + b.to(tl.int64) * svlb + s.to(tl.int64) * svls + qi.to(tl.int64) * svlq
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, K)
    if LIMIT:  # the row's splits share the entries from `start` (or 0) up to the limit; a split past them stores
        # an empty partial
        written = tl.load(limit_ptr).to(tl.int32)
        hi = tl.minimum(written, K)
        if START:  # each query's first entry; the program reads from the least of its queries'
            first = tl.load(start_ptr + b.to(tl.int64) * sstb + query_of.to(tl.int64) * sstq, mask=hmask,
                            other=0).to(tl.int32)  # fmt: skip
            lo = tl.minimum(tl.maximum(tl.min(tl.where(hmask, first, hi), axis=0), 0), hi)
        else:
            lo = hi * 0
        share = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK) * BLOCK
        start = lo + sp * share
        end = tl.minimum(start + share, hi)
        # causal: query i's own token is entry written - Q + i, the last it reads
        last = written - Q + query_of
    for j in range(start, end, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        jm = offs < end
        if VALID and not PACKED:
            ok = jm & (tl.load(vl_base + offs, mask=jm, other=0) != 0)
        else:  # every listed index is read (packed: each query row's valid mask applies to its scores only)
            ok = jm
        if EVERY_SLOT:  # entry j is slot j: K/V rows read in order, no index list
            idx = offs.to(tl.int64)
        else:
            idx = tl.load(i_base + offs, mask=jm, other=0).to(tl.int64)
        kt = tl.load(k_base + idx[:, None] * skn + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        # V issued with K: both gathers are in flight before the first dot needs K
        vt = tl.load(v_base + idx[:, None] * svn + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        sc = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale  # [GP, BLOCK], log2 domain
        if VALID and PACKED and VALID_PER_QUERY:
            # packed, the grid has one query row (qi = 0): query_of is the query's index
            seen = tl.load(vl_base + query_of[:, None].to(tl.int64) * svlq + offs[None, :],
                           mask=hmask[:, None] & jm[None, :], other=0) != 0  # fmt: skip
            attended = seen & jm[None, :]
        elif VALID and PACKED:  # one valid row for every query: one [BLOCK] load, not [G x Q, BLOCK]
            attended = (jm & (tl.load(vl_base + offs, mask=jm, other=0) != 0))[None, :]
        else:
            attended = ok[None, :]
        if CAUSAL:
            attended = attended & (offs[None, :] <= last[:, None])
        if START_PER_QUERY:  # packed queries that start at different entries (a window per query)
            attended = attended & (offs[None, :] >= first[:, None])
        sc = tl.where(attended, sc, float("-inf"))
        m_i, corr, p, l_i = online_softmax_block(m_i, l_i, sc)
        acc = acc * corr[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
    row = (b.to(tl.int64) * HQ + s * G + head_of) * Q + query_of  # [GP] rows of the (B, Hq, Q) output
    store_split_partial(o_ptr, lse_ptr, row, sp, num_splits, acc, l_i, m_i, d, D, hmask, dmask)
    if MERGE and PACKED:  # the G x Q rows are consecutive
        merge_if_last(o_ptr, lse_ptr, out_ptr, tickets_ptr, r, (b.to(tl.int64) * HQ + s * G) * Q, 1, num_splits, D,
                      DP, G * pack, GC, SP)  # fmt: skip
    elif MERGE:
        merge_if_last(o_ptr, lse_ptr, out_ptr, tickets_ptr, r, (b.to(tl.int64) * HQ + s * G) * Q + qi, Q,
                      num_splits, D, DP, G, GC, SP)  # fmt: skip


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, num_splits, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
                    USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SP)
    d = tl.arange(0, DP)
    smask = sp < num_splits
    lse = tl.load(lse_ptr + row * num_splits + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    o = tl.load(
        o_ptr + (row * num_splits + sp)[:, None] * D + d[None, :],
        mask=smask[:, None] & (d < D)[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * D + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


def sparse_attention_triton(
    query, keys, values, indices, valid, scaling, *, tickets=None, block: int | None = None,
    splits: int | None = None, merge: bool | None = None, limit=None, causal: bool = False, start=None,
):
    """merge: whether the rows' last splits merge the partials (needs `tickets`); None decides by the grid.
    limit, causal, start: see `sparse_attention.sparse_attention`."""
    if (causal or start is not None) and limit is None:
        raise ValueError("causal and start need `limit`")
    b, hq, q, d = query.shape
    hkv = keys.shape[1]
    every_slot = False
    if indices is None:  # entry j is slot j for every row and query: one list for every query
        s, kk = (valid.shape[1] if valid is not None else hkv), keys.shape[2]
        pack = q if q > 1 and hq // s * q <= PACKED_ROWS else 1
        every_slot = reads_in_order(d, max(16, next_pow2(hq // s * pack)))
        if every_slot:
            indices = keys.new_zeros(1, dtype=torch.int64).expand(b, s, q, kk)  # never read
        else:  # through the list it stands for
            indices = torch.arange(kk, device=keys.device).view(1, 1, 1, kk).expand(b, s, q, kk)
    else:
        s, kk = indices.shape[1], indices.shape[3]
    g = hq // hkv
    heads_per_row = hq // s
    # one index list for every query (a dense forward of several tokens): a program serves them all
    pack = q if q > 1 and indices.stride(2) == 0 and heads_per_row * q <= PACKED_ROWS else 1
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    if query.stride(-1) != 1:
        query = query.contiguous()
    has_valid = valid is not None
    if not has_valid:
        valid = indices  # unused (VALID=False)
    elif valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    # packed queries with a valid row each (no row shared over the queries): [G x Q, BLOCK] mask loads a step
    row_per_query = has_valid and pack > 1 and valid.stride(2) != 0
    query_rows = max(16, next_pow2(heads_per_row * pack))
    rows = b * s * q // pack
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 4
    block = block or default_block(d, query_rows, row_per_query, start is not None, query.element_size(), every_slot,
                                   rows > sms)  # fmt: skip
    if splits is None:
        # at most one wave of sm_mult resident programs per SM: a partial second wave adds a whole program's
        # latency (H200, 128K x B8, 64 rows: 9 splits 39.6 us, 8 splits 36.0 us)
        splits = max(1, min(programs_per_sm(d, query_rows, start is not None, row_per_query) * sms // rows,
                               triton.cdiv(kk, block)))  # fmt: skip
    # the combine reads [SP, DP] partials as one Triton tensor (only an explicit `splits` nears its limit)
    splits = min(splits, MAX_TENSOR_NUMEL // next_pow2(d))
    split_len = triton.cdiv(triton.cdiv(kk, splits), block) * block
    splits = max(1, triton.cdiv(kk, split_len))
    o_part = torch.empty(b * hq * q, splits, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(b * hq * q, splits, dtype=torch.float32, device=query.device)
    out = torch.empty(b, hq, q, d, dtype=query.dtype, device=query.device)
    # the last split's merge pays off where programs outnumber SMs: it overlaps the other programs' work (H200,
    # 128K x B8, 512 programs: whole step 117.2 -> 113.0 us). With fewer programs than SMs the combine kernel
    # spreads the merge over more SMs and its launch overlaps (PDL): 32K x B1, 88 programs, 8.0 vs 8.5 us
    if merge is None:
        merge = splits * rows > sms
    # the merge reads a [GC, SP, DP] tile of partials: over Triton's tensor limit (triton 3.9 does not compile
    # it) for many splits of a wide row (MQA, 8 heads x d 256, one row: 528 splits on an H100), which the
    # combine kernel then merges
    merge = merge and tickets is not None
    merge = merge and next_pow2(heads_per_row * pack) * next_pow2(splits) * next_pow2(d) <= MAX_TENSOR_NUMEL
    # start: one entry for every query, or one per (row, query) ([B, Q], possibly expanded)
    start_strides = (0, 0) if start is None or start.numel() == 1 else start.stride()
    _partial_kernel[row_grid("sparse_attention", query.shape, splits, rows)](
        query,
        keys,
        values,
        indices,
        valid,
        o_part,
        lse,
        out,
        tickets if merge else lse,
        limit if limit is not None else lse,
        start if start is not None else lse,
        s,
        q,
        kk,
        split_len,
        splits,
        hq,
        g,
        scaling * 1.4426950408889634,
        *query.stride()[:3],
        *keys.stride()[:3],
        *values.stride()[:3],
        *indices.stride()[:3],
        *valid.stride()[:3],
        *start_strides,
        G=heads_per_row,
        GP=max(16, next_pow2(heads_per_row * pack)),
        D=d,
        DP=next_pow2(d),
        BLOCK=block,
        VALID=has_valid,
        MERGE=merge,
        GC=next_pow2(heads_per_row * pack),
        SP=next_pow2(splits),
        PREC=dot_precision(query.dtype),
        num_warps=TUNE["num_warps"],
        num_stages=TUNE["num_stages"],
        PACKED=pack > 1,
        LIMIT=limit is not None,
        VALID_PER_QUERY=row_per_query,
        CAUSAL=causal,
        START=start is not None,
        START_PER_QUERY=pack > 1 and start_strides[1] != 0,
        EVERY_SLOT=every_slot,
        **pdl_launch(query.device),
    )
    if merge:
        return out
    _combine_kernel[check_grid("sparse_attention", query.shape, (b * hq * q,))](
        o_part, lse, out, splits, D=d, DP=next_pow2(d), SP=next_pow2(splits), **pdl_launch(query.device)
    )
    return out
