"""Triton Hamming scorer: one 16-byte load per token's 128-bit code, XNOR-popcount against every query head of
the kv-head's group, summed in registers so scores leave the kernel per kv-head. Optionally writes int16 scores
plus per-chunk histograms, the first pass of the sort-free top-k (`hamming_topk`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import pdl_enter, popcount_tl
from sparsekv.kernels._topk_triton import (
    chunking,
    digit_histogram,
    int_levels,
    level_digit,
    max_chunk_tiles,
    max_chunks,
    packed_add,
    packed_bits,
    packed_counts,
    radix_topk,
    window_base,
    window_digit,
)
from sparsekv.kernels._triton import MAX_GRID, check_grid, next_pow2, pdl_launch
from sparsekv.kernels.bits import check_code_shapes

WINDOW_BITS = 5  # the threshold window has 32 one-score bins (the packed histogram's width)
# launch parameters of the scorer (scripts/gpu_probe.py sweep / plain; docs/kernels-notes.md). _plain: the
# scorer without a histogram (int32 scores). group_adders: combine a GQA group's query heads before the popcounts
# (group_words), for groups of up to 8. prefetch: how many tiles ahead of the one being scored have their codes
# in flight (0 / False: none). rotate: in the decode step's scoring (newest key first, threshold window), the
# programs of chunks of at least rotate_min_tiles tiles start at a tile that depends on their row
# (docs/kernels-notes.md). H200, 128K x B8: step 106.0 -> 102.8 us, 131077 keys 111.0 -> 106.5 us. It lost
# elsewhere, which keeps the plain order: 32K x B8 (4 tiles a chunk) 0.3 us, forward scoring 4.5 us, newest-first
# scoring without a window 3.7 us.
TUNE = {"block": 512, "block_plain": 1024, "num_warps": 4, "vec": True, "progs_per_sm": 8, "progs_per_sm_plain": 16,
        "group_adders": True, "prefetch": True, "rotate": True, "rotate_min_tiles": 8}


# Summing popcount(q_h ^ k) over a GQA group costs one POPC per head and word, and POPC issues at a quarter of the
# logic-op rate: once the loads were pipelined it was the scorer's next limit (H200: 55.6 -> 48.0 us at 128K x B8).
# Per bit, the group's sum only counts how many heads differ from the key, so heads combine first, with one full adder over three heads (sum = a ^ b ^ c, carry = maj(a, b, c), both
# commuting with "^ k") and the identity popc(x) + popc(y) = popc(x ^ y) + 2 popc(x & y). Four heads then cost
# two POPC per word instead of four, plus one per-query constant.
@triton.jit
def group_words(q_ptr, sqh, w, wmask, word_mask, FIRST: tl.constexpr, HEADS: tl.constexpr, USE_POPC: tl.constexpr):
    """(u, v, m, c) for query heads FIRST..FIRST+HEADS-1 (HEADS <= 4): the words group_terms compares keys
    with, and the key-independent part c of the group's summed popcount."""
    q0 = tl.load(q_ptr + FIRST * sqh + w, mask=wmask, other=0) & word_mask
    zero = tl.zeros_like(q0)
    if HEADS == 1:
        return q0, zero, zero, 0
    q1 = tl.load(q_ptr + (FIRST + 1) * sqh + w, mask=wmask, other=0) & word_mask
    if HEADS == 2:
        return q0, q1, zero, tl.sum(popcount_tl(q0 ^ q1, USE_POPC), axis=0)
    q2 = tl.load(q_ptr + (FIRST + 2) * sqh + w, mask=wmask, other=0) & word_mask
    a = q0 ^ q1 ^ q2
    m = (q0 & q1) | (q2 & (q0 | q1))
    if HEADS == 3:
        return a, zero, m, 0
    q3 = tl.load(q_ptr + (FIRST + 3) * sqh + w, mask=wmask, other=0) & word_mask
    return a, q3, m, tl.sum(popcount_tl(a ^ q3, USE_POPC), axis=0)


@triton.jit
def group_terms(kc, u, v, m, HEADS: tl.constexpr, USE_POPC: tl.constexpr):
    """Per key and word: sum over the group's heads of popcount(q_h ^ k), less group_words' constant."""
    if HEADS == 1:
        return popcount_tl(kc ^ u[None, :], USE_POPC)
    if HEADS == 2:
        return 2 * popcount_tl((kc ^ u[None, :]) & (kc ^ v[None, :]), USE_POPC)
    if HEADS == 3:
        return popcount_tl(kc ^ u[None, :], USE_POPC) + 2 * popcount_tl(kc ^ m[None, :], USE_POPC)
    return 2 * (popcount_tl((kc ^ u[None, :]) & (kc ^ v[None, :]), USE_POPC) + popcount_tl(kc ^ m[None, :], USE_POPC))


@triton.jit
def _load_codes(k_base, offs, nmask, N, w, wmask, W: tl.constexpr, skn, REVERSE: tl.constexpr, VEC: tl.constexpr):
    """[BLOCK, WP] code words of the keys at score positions `offs` (position N - 1 - offs with REVERSE)."""
    tok = (N - 1 - offs) if REVERSE else offs
    if VEC:
        # W (constexpr) between tokens, unit stride between a token's words: one 16-byte load per token
        kptrs = k_base + tok[:, None].to(tl.int64) * W + w[None, :]
    else:
        kptrs = k_base + tok[:, None].to(tl.int64) * skn + w[None, :]
    return tl.load(kptrs, mask=nmask[:, None] & wmask[None, :], other=0)


@triton.jit
def _hamming_kernel(
    q_ptr,
    k_ptr,
    out_ptr,
    hist_ptr,
    hint_ptr,
    base_ptr,
    N,
    Q,
    HKV,
    bits,
    num_chunks,
    blocks_per_chunk,
    sqb,
    sqh,
    sqq,
    skb,
    skh,
    skn,
    sob,
    soh,
    soq,
    sink,
    local,
    forced_score,
    G: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
    HIST: tl.constexpr,
    NBITS: tl.constexpr,
    LEVELS: tl.constexpr,
    FULL: tl.constexpr,
    VEC: tl.constexpr,
    USE_POPC: tl.constexpr,
    REVERSE: tl.constexpr,
    PACKED: tl.constexpr,
    WINDOW: tl.constexpr = False,
    HSLOT: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
    HEADS0: tl.constexpr = 0,
    HEADS1: tl.constexpr = 0,
    PREFETCH: tl.constexpr = False,
    ROTATE: tl.constexpr = False,
    written_ptr=None,
    FIXED: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    r = tl.program_id(1)  # rows on axis y alone (see _query_step)
    qi = r % Q
    kvh = (r // Q) % HKV
    b = r // (Q * HKV)
    w = tl.arange(0, WP)
    wmask = w < W
    nb = tl.minimum(tl.maximum(bits - 32 * w, 0), 32)
    word_mask = tl.where(nb >= 32, -1, (1 << tl.minimum(nb, 31)) - 1)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    q_base = q_ptr + b.to(tl.int64) * sqb + (kvh * G).to(tl.int64) * sqh + qi.to(tl.int64) * sqq
    o_base = out_ptr + b.to(tl.int64) * sob + kvh.to(tl.int64) * soh + qi.to(tl.int64) * soq
    if HEADS0 > 0:  # groups of up to 8 heads: combined head words, loaded once (see group_words)
        u0, v0, m0, const = group_words(q_base, sqh, w, wmask, word_mask, 0, HEADS0, USE_POPC)
        if HEADS1 > 0:
            u1, v1, m1, c1 = group_words(q_base, sqh, w, wmask, word_mask, HEADS0, HEADS1, USE_POPC)
            const += c1
    if HIST:
        h = tl.zeros([1 << NBITS], dtype=tl.int32)
        if PACKED:
            acc = tl.zeros([BLOCK, PACKED], dtype=tl.int32)
        if WINDOW:  # width-1 bins around the row's previous threshold (see _topk_triton.window_base)
            base = window_base(tl.load(hint_ptr + r), forced_score, NBITS)
            tl.store(base_ptr + r, base, mask=c == 0)
    first = c * blocks_per_chunk * BLOCK + tl.arange(0, BLOCK)
    # the last chunk runs to the end of the row (_topk_triton.chunking)
    chunk_end = tl.where(c == num_chunks - 1, N, (c + 1) * blocks_per_chunk * BLOCK)
    tiles = tl.cdiv(chunk_end - c * blocks_per_chunk * BLOCK, BLOCK)
    # ROTATE: row r's programs start at tile r of their chunks and wrap around (the scores and histograms do not
    # depend on the order), so that a thousand programs do not stream addresses 128 KB apart in lockstep
    rot = r % tiles if ROTATE else 0
    if PREFETCH:
        start = first + rot * BLOCK
        nxt = _load_codes(k_base, start, start < N, N, w, wmask, W, skn, REVERSE, VEC)
        if PREFETCH > 1:
            ahead = first + ((1 + rot) % tiles) * BLOCK
            nxt2 = _load_codes(k_base, ahead, (ahead < N) & (tl.zeros_like(first) + 1 < tiles), N, w, wmask, W, skn,
                               REVERSE, VEC)  # fmt: skip
    for i in range(tiles):
        offs = first + ((i + rot) % tiles if ROTATE else i) * BLOCK
        nmask = offs < N
        # REVERSE: scores are stored newest key first, so that the selection's ties-to-the-lowest-position
        # rule keeps the most recent keys
        tok = (N - 1 - offs) if REVERSE else offs
        if PREFETCH:  # the next PREFETCH tiles' codes are in flight while this one is scored
            kc = nxt
            ahead = first + ((i + PREFETCH + rot) % tiles if ROTATE else i + PREFETCH) * BLOCK
            in_chunk = tl.zeros_like(first) + i + PREFETCH < tiles
            ahead_codes = _load_codes(k_base, ahead, (ahead < N) & in_chunk, N, w, wmask, W, skn, REVERSE, VEC)
            if PREFETCH > 1:
                nxt = nxt2
                nxt2 = ahead_codes
            else:
                nxt = ahead_codes
        else:
            kc = _load_codes(k_base, offs, nmask, N, w, wmask, W, skn, REVERSE, VEC)
        if HEADS0 > 0:
            if not FULL:
                kc = kc & word_mask[None, :]
            diff = group_terms(kc, u0, v0, m0, HEADS0, USE_POPC)
            if HEADS1 > 0:
                diff += group_terms(kc, u1, v1, m1, HEADS1, USE_POPC)
            score = G * bits - const - tl.sum(diff, axis=1)
        else:
            diff = tl.zeros([BLOCK, WP], dtype=tl.int32)
            for hh in tl.static_range(G):
                qc = tl.load(q_base + hh * sqh + w, mask=wmask, other=0)
                x = kc ^ qc[None, :]
                if not FULL:
                    x = x & word_mask[None, :]
                diff += popcount_tl(x, USE_POPC)
            score = G * bits - tl.sum(diff, axis=1)
        if FIXED:
            # a fixed-shape buffer: only the first `written` slots hold keys. They score 1 + matching bits, the
            # other slots 0 (below every key); the local keys are the last written ones
            written = tl.load(written_ptr)
            held = tok < written
            score = tl.where((tok < sink) | ((tok >= written - local) & held), forced_score,
                             tl.where(held, score + 1, 0))  # fmt: skip
        else:
            # sink / local keys always make the cut: they score above every real key
            score = tl.where((tok < sink) | (tok >= N - local), forced_score, score)
        tl.store(o_base + offs, score.to(out_ptr.dtype.element_ty), mask=nmask)
        if HIST:
            if WINDOW:
                shift = 0
                key = window_digit(score, base, NBITS).to(tl.uint32)
            else:
                shift = NBITS * (LEVELS - 1)
                key = score.to(tl.uint32, bitcast=True)
            if PACKED:
                digit, ok = level_digit(key, nmask, 0, shift, NBITS, True)
                acc = packed_add(acc, digit, ok, PACKED)
            else:
                h += digit_histogram(key, nmask, 0, shift, NBITS, True)
    if HIST:
        if PACKED:
            h = packed_counts(acc, PACKED)
        row = HSLOT * tl.num_programs(1) + r.to(tl.int64)
        tl.store(hist_ptr + (row * num_chunks + c) * (1 << NBITS) + tl.arange(0, 1 << NBITS), h)


def _launch(query_codes, key_codes, bits, out_dtype, radix=None, *, reverse=False, sink=0, local=0, hint=None,
            written=None):  # fmt: skip
    """radix=(levels, nbits): also write the level-0 radix histograms, or with `hint` ([rows] int32, each row's
    previous threshold) the threshold-window histogram instead. Forced (sink/local) keys score bits * g + 1;
    `reverse` stores the scores newest key first. `written` (int64 [1] on the device): only the first `written`
    key slots hold keys; scores are then shifted by one (0 = an empty slot) and forced keys score bits * g + 2."""
    b, hq, q, w = query_codes.shape
    hkv, n = key_codes.shape[1], key_codes.shape[2]
    g = hq // hkv
    if key_codes.stride(-1) != 1 or (TUNE["vec"] and key_codes.stride(-2) != w):
        key_codes = key_codes.contiguous()
    if query_codes.stride(-1) != 1:
        query_codes = query_codes.contiguous()
    rows = b * hkv * q
    # the selection reads each row of scores in 16-byte vectors: rows padded to a multiple of 64 (n_load)
    n_alloc = triton.cdiv(n, 64) * 64 if radix is not None else n
    out = torch.empty(b, hkv, q, n_alloc, dtype=out_dtype, device=key_codes.device)[..., :n]
    block = (TUNE["block"] if radix is not None else TUNE["block_plain"]) if n >= 8192 else 128
    # long codes (e.g. 1024-bit LSH, 32 words) keep the [block, words] tile within ~16 registers per thread
    block = min(block, max(16, 4096 // next_pow2(w)))
    levels, nbits = radix or (1, 1)
    num_chunks, bpc = chunking(
        rows, n, block, key_codes.device, max_chunks=max_chunks(nbits),
        progs_per_sm=TUNE["progs_per_sm"] if radix is not None else TUNE["progs_per_sm_plain"],
    )
    window = radix is not None and hint is not None
    if radix is not None:
        # level 0 of the radix select (or the window, stored after the levels) is written here; the rest by
        # _topk_triton
        slots = levels + 1 if window else levels
        hist = torch.empty(slots, rows, num_chunks, 1 << nbits, dtype=torch.int32, device=key_codes.device)
    else:
        hist = out  # unused
    base = torch.empty(rows, dtype=torch.int32, device=key_codes.device) if window else None
    _hamming_kernel[check_grid("hamming", query_codes.shape, (num_chunks, rows))](
        query_codes,
        key_codes,
        out,
        hist,
        hint if window else out,
        base if window else out,
        n,
        q,
        hkv,
        bits,
        num_chunks,
        bpc,
        *query_codes.stride()[:3],
        *key_codes.stride()[:3],
        *out.stride()[:3],
        sink,
        local,
        g * bits + (2 if written is not None else 1),
        G=g,
        W=w,
        WP=next_pow2(w),
        BLOCK=block,
        HIST=radix is not None,
        NBITS=nbits,
        LEVELS=levels,
        FULL=bits == 32 * w,
        VEC=TUNE["vec"],
        USE_POPC=key_codes.is_cuda,
        REVERSE=reverse,
        PACKED=packed_bits(nbits, max_chunk_tiles(n, block, num_chunks, bpc), True, block) if radix is not None else 0,
        WINDOW=window,
        HSLOT=levels if window else 0,
        HEADS0=min(g, 4) if TUNE["group_adders"] and g <= 8 else 0,
        HEADS1=max(g - 4, 0) if TUNE["group_adders"] and g <= 8 else 0,
        PREFETCH=int(TUNE["prefetch"]),
        ROTATE=TUNE["rotate"] and window and reverse and bpc >= TUNE["rotate_min_tiles"],
        written_ptr=written,
        FIXED=written is not None,
        num_warps=TUNE["num_warps"],
        **pdl_launch(key_codes.device),
    )
    return out, hist, num_chunks, bpc, block, base


def _query_step(query_codes: torch.Tensor, key_codes: torch.Tensor) -> int | None:
    """Queries per launch where the rows (batch x kv heads x queries) pass grid axis y's 65535, else None.
    The scorer keeps its rows on axis y: spreading them over axes y and z (`_triton.row_grid`, as the other
    kernels do) cost it 2.6 of 57 us at 128K x B8 (H100, triton 3.6), so a long prefill chunk is scored in
    slices of its queries instead."""
    per_query = query_codes.shape[0] * key_codes.shape[1]
    step = max(1, MAX_GRID[1] // per_query)
    return step if step < query_codes.shape[2] else None


def hamming_scores_triton(query_codes: torch.Tensor, key_codes: torch.Tensor, *, bits: int) -> torch.Tensor:
    check_code_shapes(query_codes, key_codes)
    step = _query_step(query_codes, key_codes)
    if step is not None:
        return torch.cat([hamming_scores_triton(query_codes[:, :, i : i + step], key_codes, bits=bits)
                          for i in range(0, query_codes.shape[2], step)], dim=2)  # fmt: skip
    return _launch(query_codes, key_codes, bits, torch.int32)[0]


def hamming_topk_triton(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    *,
    bits: int,
    recent_first: bool = False,
    sink: int = 0,
    local: int = 0,
    threshold_hint: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused scoring + histogram, then threshold + compaction: [B, Hkv, Q, k] int64 (unordered).

    threshold_hint: see `hamming_score_hist`; the result does not depend on it."""
    step = _query_step(query_codes, key_codes)
    if step is not None:  # slices of the queries (see _query_step), each with its rows' thresholds
        b, hkv, q = query_codes.shape[0], key_codes.shape[1], query_codes.shape[2]
        hints = None
        if threshold_hint is not None:
            hints = _check_hint(threshold_hint, b * hkv * q, key_codes).view(b, hkv, q)
        kw = {"bits": bits, "recent_first": recent_first, "sink": sink, "local": local}
        parts = []
        for i in range(0, q, step):
            hint = None if hints is None else hints[:, :, i : i + step].contiguous().view(-1)
            part = query_codes[:, :, i : i + step]
            parts.append(hamming_topk_triton(part, key_codes, k, threshold_hint=hint, **kw))
            if hints is not None:
                hints[:, :, i : i + step] = hint.view(b, hkv, -1)  # the slice's updated thresholds
        return torch.cat(parts, dim=2)
    state = hamming_score_hist(
        query_codes, key_codes, bits=bits, recent_first=recent_first, sink=sink, local=local,
        threshold_hint=threshold_hint,
    )  # fmt: skip
    return hamming_select(state, k)


@dataclass
class ScoreState:
    """What the scoring pass hands to the selection: int16/int32 scores [B, Hkv, Q, N] (newest key first when
    `reverse`) and the level-0 radix histograms."""

    scores: torch.Tensor
    hist: torch.Tensor
    num_chunks: int
    bpc: int
    block: int
    levels: int
    nbits: int
    reverse: bool
    window: tuple[torch.Tensor, int] | None = None  # (each row's window base, top score)
    hint: torch.Tensor | None = None


def hamming_score_hist(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    *,
    bits: int,
    recent_first: bool = False,
    sink: int = 0,
    local: int = 0,
    threshold_hint: torch.Tensor | None = None,
) -> ScoreState:
    """Stage 1 of hamming_topk (exposed for stage timings): scores + level-0 histograms.

    recent_first: equal scores go to the more recent key (the selectors' rule); sink/local: the first `sink` and
    last `local` keys are always selected (they must fit in k).

    threshold_hint: int32 [B * Hkv * Q] (contiguous), each row's threshold score of the previous call, updated in
    place by `hamming_select`. The first histogram then has one bin per score around it. Consecutive decode steps
    of a layer have close thresholds, and when the new one falls inside the window the second radix pass over
    the scores is skipped (its kernels still launch and exit at once: no host sync). The selection is exact
    either way; any int32 contents are valid."""
    _, g = check_code_shapes(query_codes, key_codes)
    top = g * bits + (1 if sink or local else 0)
    levels, nbits = int_levels(top + 1)
    dtype = torch.int16 if top < 2**15 else torch.int32
    if threshold_hint is not None:
        rows = query_codes.shape[0] * key_codes.shape[1] * query_codes.shape[2]
        _check_hint(threshold_hint, rows, key_codes)
        if nbits != WINDOW_BITS:
            threshold_hint = None  # ranges under 32 scores: one radix level is already exact
    scores, hist, num_chunks, bpc, block, base = _launch(
        query_codes, key_codes, bits, dtype, (levels, nbits), reverse=recent_first, sink=sink, local=local,
        hint=threshold_hint,
    )  # fmt: skip
    window = None if threshold_hint is None else (base, g * bits + 1)
    return ScoreState(scores, hist, num_chunks, bpc, block, levels, nbits, recent_first, window, threshold_hint)


def _check_hint(hint: torch.Tensor, rows: int, key_codes: torch.Tensor) -> torch.Tensor:
    if hint.dtype != torch.int32 or hint.shape != (rows,) or hint.device != key_codes.device:
        raise ValueError(f"threshold_hint must be int32 [{rows}] on {key_codes.device}")
    return hint


def hamming_select(state: ScoreState, k: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2 of hamming_topk: remaining radix levels + compaction from `hamming_score_hist`'s state (`counts`:
    each row's own number of keys, see `radix_compact`)."""
    scores = state.scores
    out = radix_topk(
        scores.view(-1, scores.shape[-1]), k, lo=0, levels=state.levels, nbits=state.nbits, is_float=False,
        block=state.block, num_chunks=state.num_chunks, bpc=state.bpc, hist=state.hist, n_load=scores.stride(-2),
        first_done=state.window is None, reverse=state.reverse, window=state.window, hint=state.hint, counts=counts,
    )  # fmt: skip
    return out.view(*scores.shape[:-1], k)


def hamming_topk_fixed_triton(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    written: torch.Tensor,
    *,
    bits: int,
    sink: int = 0,
    local: int = 0,
    threshold_hint: torch.Tensor | None = None,
    with_scores: bool = True,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hamming_topk_triton` (recent_first) over a fixed-shape buffer whose first `written` slots (int64 [1] on
    the device) hold keys: -> (indices [B, Hkv, Q, k] int64 unordered, their ranking scores: 0 for an empty
    slot, 1 + matching bits for a key, bits * g + 2 for a forced one). No host value depends on `written`, so
    a CUDA graph replays it at every length. `threshold_hint`: see `hamming_score_hist` (the window's top score
    is the forced keys' here)."""
    if _query_step(query_codes, key_codes) is not None:
        raise ValueError("fixed-shape decoding scores one query per row")
    _, g = check_code_shapes(query_codes, key_codes)
    top = g * bits + 2
    levels, nbits = int_levels(top + 1)
    dtype = torch.int16 if top < 2**15 else torch.int32
    if nbits != WINDOW_BITS:
        threshold_hint = None  # ranges under 32 scores: one radix level is already exact
    scores, hist, num_chunks, bpc, block, base = _launch(
        query_codes, key_codes, bits, dtype, (levels, nbits), reverse=True, sink=sink, local=local, written=written,
        hint=threshold_hint,
    )  # fmt: skip
    window = None if threshold_hint is None else (base, top)
    state = ScoreState(scores, hist, num_chunks, bpc, block, levels, nbits, True, window, threshold_hint)
    indices = hamming_select(state, k, counts)
    if not with_scores:
        return indices, scores[..., :0]
    n = scores.shape[-1]
    return indices, scores.gather(-1, (n - 1) - indices)
