"""Self-index LUT scoring. The per-(kv head, query) integer table [d/4, 16] (`lut_score.quantized_lut`) is built by
torch (tiny); the kernels stream each token's packed sign bits once (16-byte vectors for d=128) and sum table
entries: two 4-bit groups per lookup through a 256-entry table per byte of sign bits (half the lookups), read with
global loads that hit L1; each program scores `tiles` x `tile` tokens. The float table of the same layout took
106 us at 128K x B8 on the H200 (tiles of 512 x 4; 131 us with 256 x 8); measured and dropped: the tables read
with `tl.gather` from registers / shared memory (214 us), one L1 load per 4-bit group (197 us).

`lut_topk_fixed_triton` is the decode step's first stage: the same scoring writes int16 ranks (empty slots 0,
forced keys on top) and level 0 of the radix select's histograms in one pass, and `_topk_triton`'s levels and
compaction pick the k best with no sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._scorer_hist_triton import NIBBLE_MAX_TILES
from sparsekv.kernels._tl_utils import chunk_and_row, pdl_enter
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
)
from sparsekv.kernels._triton import check_grid, next_pow2, pdl_launch, row_grid
from sparsekv.kernels.lut_score import LUT_RANK_TOP, LUT_SCORE_LIMIT

LUT_TUNE = {"tile": 512, "tiles": 4, "num_warps": 4}
SELECT_TUNE = {"block": 256, "num_warps": 2, "progs_per_sm": 16}


@triton.jit
def _tile_scores(table_base, code_base, tok, held, scn, W: tl.constexpr, WP: tl.constexpr, TILE: tl.constexpr):
    """[TILE] int32 table sums of the keys at positions tok (0 where not `held`)."""
    w = tl.arange(0, WP)
    slot = (w[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]) * 256  # [1, WP, 4]
    shift = (tl.arange(0, 4) * 8)[None, None, :]
    codes = tl.load(code_base + tok[:, None].to(tl.int64) * scn + w[None, :],
                    mask=held[:, None] & (w < W)[None, :], other=0)  # fmt: skip
    vals = tl.load(table_base + slot + ((codes[:, :, None] >> shift) & 0xFF)).to(tl.int32)  # [TILE, WP, 4]
    return tl.sum(tl.reshape(vals, [TILE, WP * 4]), axis=1)


@triton.jit
def _lut_pairs_kernel(
    table_ptr, step_ptr, code_ptr, out_ptr, N, Q, HKV, scb, sch, scn, sob, soh, soq,
    W: tl.constexpr, WP: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """table [rows, WP * 4 * 256] int16: entry (w * 4 + j) * 256 + byte = the two 4-bit groups held in byte j of
    sign word w (zero past the last group); out = sum x the row's step."""
    nb, r = chunk_and_row()
    qi = r % Q
    kvh = (r // Q) % HKV
    b = r // (Q * HKV)
    b64, h64 = b.to(tl.int64), kvh.to(tl.int64)
    table_base = table_ptr + r.to(tl.int64) * (WP * 4 * 256)
    step = tl.load(step_ptr + r)
    code_base = code_ptr + b64 * scb + h64 * sch
    out_base = out_ptr + b64 * sob + h64 * soh + qi.to(tl.int64) * soq
    for t in range(TILES):
        offs = (nb * TILES + t) * TILE + tl.arange(0, TILE)
        nm = offs < N
        score = _tile_scores(table_base, code_base, offs, nm, scn, W, WP, TILE)
        tl.store(out_base + offs, score.to(tl.float32) * step, mask=nm)


@triton.jit
def _lut_select_kernel(
    table_ptr, code_ptr, out_ptr, hist_ptr, written_ptr, forced_ptr, N, HKV, num_chunks, blocks_per_chunk,
    scb, sch, scn, s_out, sfb, sfh, S, sink, local,
    W: tl.constexpr, WP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr, NBITS: tl.constexpr,
    LEVELS: tl.constexpr, PACKED: tl.constexpr, TOP: tl.constexpr, BIAS: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One (chunk, row) of a fixed-shape step (one query per row): int16 ranks (lut_score.lut_topk_fixed_reference's
    rule) of the chunk's slots, and the chunk's histogram of the ranks' top digit (level 0 of the radix select)."""
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    r = tl.program_id(1)
    kvh = r % HKV
    b = r // HKV
    b64, h64 = b.to(tl.int64), kvh.to(tl.int64)
    table_base = table_ptr + r.to(tl.int64) * (WP * 4 * 256)
    code_base = code_ptr + b64 * scb + h64 * sch
    out_base = out_ptr + r.to(tl.int64) * s_out
    written = tl.load(written_ptr)
    s = tl.arange(0, SP)
    listed = tl.load(forced_ptr + b64 * sfb + h64 * sfh + s, mask=s < S, other=-1)  # [SP], -1 never a position
    if PACKED:
        acc = tl.zeros([BLOCK, PACKED], dtype=tl.int32)
    else:
        h = tl.zeros([1 << NBITS], dtype=tl.int32)
    first = c * blocks_per_chunk * BLOCK + tl.arange(0, BLOCK)
    chunk_end = tl.where(c == num_chunks - 1, N, (c + 1) * blocks_per_chunk * BLOCK)
    tiles = tl.cdiv(chunk_end - c * blocks_per_chunk * BLOCK, BLOCK)
    for i in range(tiles):
        offs = first + i * BLOCK
        nmask = offs < N
        held = nmask & (offs < written)
        score = _tile_scores(table_base, code_base, offs, held, scn, W, WP, BLOCK)
        hinted = (offs < sink) | (offs >= written - local)
        tile_first = c * blocks_per_chunk * BLOCK + i * BLOCK
        order = tl.full([BLOCK], SP, dtype=tl.int32)  # index of each slot in the listed positions (SP: none)
        in_tile = tl.sum(((listed >= tile_first) & (listed < tile_first + BLOCK)).to(tl.int32), axis=0)
        if in_tile > 0:  # only tiles holding a listed position compare their keys with the list
            order = tl.min(tl.where(offs[:, None] == listed[None, :], s[None, :], SP), axis=1)
        rank = tl.where(order < SP, TOP - 1 - order, score + BIAS)
        rank = tl.where(held, tl.where(hinted, TOP, rank), 0)
        tl.store(out_base + offs, rank.to(tl.int16), mask=nmask)
        key = rank.to(tl.uint32, bitcast=True)
        if PACKED:
            digit, ok = level_digit(key, nmask, 0, NBITS * (LEVELS - 1), NBITS, True)
            acc = packed_add(acc, digit, ok, PACKED)
        else:
            h += digit_histogram(key, nmask, 0, NBITS * (LEVELS - 1), NBITS, True)
    if PACKED:
        h = packed_counts(acc, PACKED)
    tl.store(hist_ptr + (r.to(tl.int64) * num_chunks + c) * (1 << NBITS) + tl.arange(0, 1 << NBITS), h)


def pair_tables(table: torch.Tensor, words: int) -> torch.Tensor:
    """table [B, Hkv, Q, G, 16] int32 (`quantized_lut`) -> [B * Hkv * Q, words * 4 * 256] int16: one 256-entry
    table per byte of the sign words (byte = low group's pattern + 16 x high group's), groups past G padded with
    zero tables. A pair's entry is within +-LUT_SCORE_LIMIT (the table's whole sum bound), so int16 holds it; half
    the bytes the lookups touch: 508.8 -> 495.0 us for the first stage at 128K x B28 (H200), the same at B4."""
    b, hkv, q, groups, _ = table.shape
    padded = table.new_zeros(b, hkv, q, words * 8, 16)
    padded[:, :, :, :groups] = table
    pairs = padded[:, :, :, 1::2, :, None] + padded[:, :, :, 0::2, None, :]  # [.., P, high, low]
    return pairs.reshape(b * hkv * q, words * 4 * 256).to(torch.int16)


def _codes(sign_codes: torch.Tensor) -> torch.Tensor:
    return sign_codes if sign_codes.stride(-1) == 1 else sign_codes.contiguous()


def lut_scores_triton(table: torch.Tensor, step: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    b, hkv, q = table.shape[:3]
    n, w = sign_codes.shape[2], sign_codes.shape[3]
    out = torch.empty(b, hkv, q, n, dtype=torch.float32, device=table.device)
    if n == 0:
        return out
    codes = _codes(sign_codes)
    wp = next_pow2(w)
    tile = LUT_TUNE["tile"]
    tiles = max(1, min(LUT_TUNE["tiles"], triton.cdiv(n, tile)))
    _lut_pairs_kernel[row_grid("lut_scores", table.shape, triton.cdiv(n, tile * tiles), b * hkv * q)](
        pair_tables(table, wp), step.float().contiguous(), codes, out, n, q, hkv, *codes.stride()[:3],
        *out.stride()[:3], W=w, WP=wp, TILE=tile, TILES=tiles, num_warps=LUT_TUNE["num_warps"],
    )  # fmt: skip
    return out


def lut_topk_fixed_triton(table, sign_codes, k, written, forced, *, sink=0, local=0, counts=None):
    """`lut_score.lut_topk_fixed` for one query per row (0 < k < N): fused scoring + level-0 histogram, then the
    radix levels and the compaction (each row's counts[r] best first with counts) -> (indices [B, Hkv, 1, k]
    int64, their int16 ranks)."""
    b, hkv = table.shape[:2]
    n, w = sign_codes.shape[2], sign_codes.shape[3]
    rows = b * hkv
    codes = _codes(sign_codes)
    forced = forced.contiguous()
    wp = next_pow2(w)
    levels, nbits = int_levels(LUT_RANK_TOP + 1)
    block = SELECT_TUNE["block"] if n >= 8192 else 128
    # chunks of at most 15 tiles keep the level-0 counters 4-bit: the scorer's registers at 128K x B28 (224 rows)
    # were 213 with byte counters (9 chunks of 57 tiles, 8 programs of 2 warps a SM) and the whole first stage
    # 551.7 us against 508.8 us in 35 chunks of 15 tiles (H200)
    num_chunks, bpc = chunking(rows, n, block, codes.device, max_chunks=max_chunks(nbits),
                               progs_per_sm=SELECT_TUNE["progs_per_sm"], max_tiles=NIBBLE_MAX_TILES)  # fmt: skip
    # the selection reads each row of ranks in 16-byte vectors: rows padded to a multiple of 64
    ranks = torch.empty(rows, triton.cdiv(n, 64) * 64, dtype=torch.int16, device=codes.device)[:, :n]
    hist = torch.empty(levels, rows, num_chunks, 1 << nbits, dtype=torch.int32, device=codes.device)
    _lut_select_kernel[check_grid("lut_topk_fixed", table.shape, (num_chunks, rows))](
        pair_tables(table, wp), codes, ranks, hist, written, forced, n, hkv, num_chunks, bpc,
        *codes.stride()[:3], ranks.stride(0), forced.stride(0), forced.stride(1), forced.shape[2], sink, local,
        W=w, WP=wp, SP=max(2, next_pow2(forced.shape[2])), BLOCK=block, NBITS=nbits, LEVELS=levels,
        TOP=LUT_RANK_TOP, BIAS=1 + LUT_SCORE_LIMIT,
        PACKED=packed_bits(nbits, max_chunk_tiles(n, block, num_chunks, bpc), True, block),
        num_warps=SELECT_TUNE["num_warps"], **pdl_launch(codes.device),
    )  # fmt: skip
    picked = radix_topk(ranks, k, lo=0, levels=levels, nbits=nbits, is_float=False, block=block,
                        num_chunks=num_chunks, bpc=bpc, hist=hist, n_load=ranks.stride(0), first_done=True,
                        counts=counts)  # fmt: skip
    return picked.view(b, hkv, 1, k), ranks.gather(-1, picked).view(b, hkv, 1, k)
