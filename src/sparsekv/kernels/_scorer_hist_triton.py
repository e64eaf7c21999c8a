"""The histogram the Hamming scorer (_hamming_triton) fuses into its pass: level 0 of the radix select in packed
per-lane counters, or the threshold window around each row's previous threshold. _topk_triton reads these
histograms (derive_threshold, window_threshold) and builds the later levels itself (digit_histogram)."""

from __future__ import annotations

import triton
import triton.language as tl

# How the level histograms are built: the scorer's level-0 histogram keeps per-lane packed
# counters (`packed_bits`: bytes, 4 bins per int32, in a [BLOCK, 8] register tile, about 25 instructions per key;
# 4-bit counters where a program has at most 15 tiles), reduced across lanes once per program; a level-0 pass
# uses tl.histogram, and the later level passes, where only the keys under the prefix count, an atomic add per
# such key (`_topk_triton._level_pass`). tl.histogram costs about 4 warp instructions per key at 32 bins, which
# made the scorer instruction-bound: 76 -> 62 us at 128K x B8 on the H200. In the level-2 pass the packed
# counters measured slower (100 vs 62 us for the whole select), hence the split.
PACKED_MAX_TILES = 255  # byte counters: one lane sees at most this many tiles per program
NIBBLE_MAX_TILES = 15  # 4-bit counters: half the columns and registers of byte counters


@triton.jit
def window_base(hint, top, NBITS: tl.constexpr):
    """First value of a threshold window: the 2**NBITS bins hold one score each from base + 1 to base + bins - 2
    (bin 0: every score <= base, the last bin: every score >= base + bins - 1), centred on `hint` (the row's
    previous threshold) and kept inside [0, top]."""
    NB: tl.constexpr = 1 << NBITS
    return tl.minimum(tl.maximum(hint - NB // 2, 0), tl.maximum(top - (NB - 1), 0))


@triton.jit
def window_digit(score, base, NBITS: tl.constexpr):
    return tl.minimum(tl.maximum(score.to(tl.int32) - base, 0), (1 << NBITS) - 1)


@triton.jit
def level_digit(key, nmask, prefix, SHIFT: tl.constexpr, NBITS: tl.constexpr, FIRST: tl.constexpr):
    """(digit (key >> SHIFT) of NBITS bits, whether the key counts: valid, and its higher bits equal `prefix`)."""
    digit = ((key >> SHIFT) & ((1 << NBITS) - 1)).to(tl.int32)
    ok = nmask
    if not FIRST:
        ok = ok & ((key >> (SHIFT + NBITS)) == prefix.to(tl.uint32))
    return digit, ok


@triton.jit
def packed_add(acc, digit, ok, PACKED: tl.constexpr):
    """acc [BLOCK, PACKED] int32 of PACKED-bit counters (8 or 4): counter j of column r counts this lane's keys
    with digit (32 // PACKED) * r + j (digits < 32). 32 bins / (32 / PACKED counters per int32) = PACKED columns."""
    PER: tl.constexpr = 32 // PACKED
    one = tl.where(ok, 1 << ((digit & (PER - 1)) * PACKED), 0)
    col = digit // PER
    return acc + tl.where(col[:, None] == tl.arange(0, PACKED)[None, :], one[:, None], 0)


@triton.jit
def packed_counts(acc, PACKED: tl.constexpr):
    """The 32-bin histogram held by packed_add's counters. A program has fewer than 2**16 keys (packed_bits), so
    counters j and j + PER / 2 of a word add across lanes as the two 16-bit halves of one word: PER / 2 sums
    of the [BLOCK, PACKED] tile instead of one of a [BLOCK, PACKED, PER] unpacked tile (the scorer's registers:
    80 -> 64 with 4-bit counters, sm_90 SASS of triton 3.9)."""
    PER: tl.constexpr = 32 // PACKED
    HALF: tl.constexpr = PER // 2
    MASK: tl.constexpr = ((1 << PACKED) - 1) * 0x10001
    j = tl.arange(0, PER)
    counts = tl.zeros([PACKED, PER], dtype=tl.int32)
    for p in tl.static_range(HALF):
        pair = tl.sum((acc >> (PACKED * p)) & MASK, axis=0)
        counts += tl.where(j[None, :] == p, (pair & 0xFFFF)[:, None], 0)
        counts += tl.where(j[None, :] == p + HALF, (pair >> 16)[:, None], 0)
    return tl.reshape(counts, [32])


def packed_bits(nbits: int, tiles_per_program: int, scorer: bool = False, block: int = 512) -> int:
    """Counter width of the packed histogram (0: tl.histogram), which only the scorer keeps (`scorer`; the level
    passes get 0). One lane sees one key per tile, so 4-bit counters hold up to 15 tiles a program: half the
    columns and compares of byte counters. A program's keys (tiles x block) must stay below 2**16
    (packed_counts)."""
    too_many = tiles_per_program > PACKED_MAX_TILES or tiles_per_program * block >= 1 << 16
    if not scorer or nbits != 5 or too_many:
        return 0
    return 4 if tiles_per_program <= NIBBLE_MAX_TILES else 8
