"""Self-index LUT scoring. The per-(kv head, query) table [d/4, 16] is built by torch (tiny); the kernel streams each
token's packed sign bits once (16-byte vectors for d=128) and sums table entries.

Two 4-bit groups per lookup through a 256-entry table per byte of sign bits (half the lookups), read with global
loads that hit L1; each program scores `tiles` x `tile` tokens. 106 us at 128K x B8 on the H200 (tiles of 512 x 4;
131 us with 256 x 8; fp16 tables would give 96 us but change the scores). Measured and dropped: the same tables
read with `tl.gather` from registers / shared memory (214 us), and one L1 load per 4-bit group (197 us, 20% of copy
bandwidth).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import chunk_and_row
from sparsekv.kernels._triton import row_grid

LUT_TUNE = {"tile": 512, "tiles": 4, "num_warps": 4, "table": torch.float32}


@triton.jit
def _lut_pairs_kernel(
    table_ptr, code_ptr, out_ptr, N, Q, HKV, scb, sch, scn, sob, soh, soq,
    W: tl.constexpr, WP: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """table [rows, WP * 4 * 256]: entry (w * 4 + j) * 256 + byte = score of the two 4-bit groups held in byte j of
    sign word w (zero past the last group)."""
    nb, r = chunk_and_row()
    qi = r % Q
    kvh = (r // Q) % HKV
    b = r // (Q * HKV)
    b64, h64 = b.to(tl.int64), kvh.to(tl.int64)
    ENTRIES: tl.constexpr = WP * 4 * 256
    table_base = table_ptr + r.to(tl.int64) * ENTRIES
    w = tl.arange(0, WP)
    slot = (w[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]) * 256  # [1, WP, 4]
    shift = (tl.arange(0, 4) * 8)[None, None, :]
    code_base = code_ptr + b64 * scb + h64 * sch
    out_base = out_ptr + b64 * sob + h64 * soh + qi.to(tl.int64) * soq
    for t in range(TILES):
        offs = (nb * TILES + t) * TILE + tl.arange(0, TILE)
        nm = offs < N
        codes = tl.load(code_base + offs[:, None].to(tl.int64) * scn + w[None, :],
                        mask=nm[:, None] & (w < W)[None, :], other=0)  # fmt: skip
        entry = slot + ((codes[:, :, None] >> shift) & 0xFF)  # [TILE, WP, 4]
        vals = tl.load(table_base + entry)
        score = tl.sum(tl.reshape(vals.to(tl.float32), [TILE, WP * 4]), axis=1)
        tl.store(out_base + offs, score, mask=nm)


def pair_tables(lut: torch.Tensor, words: int) -> torch.Tensor:
    """lut [B, Hkv, Q, G, 16] -> [B * Hkv * Q, words * 4 * 256]: one 256-entry table per byte of the sign words
    (byte = low group's pattern + 16 x high group's), groups past G padded with zero tables."""
    b, hkv, q, groups, _ = lut.shape
    padded = torch.zeros(b, hkv, q, words * 8, 16, dtype=torch.float32, device=lut.device)
    padded[:, :, :, :groups] = lut
    pairs = padded[:, :, :, 1::2, :, None] + padded[:, :, :, 0::2, None, :]  # [.., P, high, low]
    return pairs.reshape(b * hkv * q, words * 4 * 256)


def lut_scores_triton(query, centroids, sign_codes):
    from sparsekv.kernels.lut_score import lut_tables

    lut = lut_tables(query, centroids).contiguous()  # [B, Hkv, Q, G, 16] fp32
    b, hkv, q = lut.shape[:3]
    n, w = sign_codes.shape[2], sign_codes.shape[3]
    out = torch.empty(b, hkv, q, n, dtype=torch.float32, device=query.device)
    if n == 0:
        return out
    codes = sign_codes if sign_codes.stride(-1) == 1 else sign_codes.contiguous()
    wp = triton.next_power_of_2(w)
    tile = LUT_TUNE["tile"]
    tiles = max(1, min(LUT_TUNE["tiles"], triton.cdiv(n, tile)))
    _lut_pairs_kernel[row_grid("lut_scores", query.shape, triton.cdiv(n, tile * tiles), b * hkv * q)](
        pair_tables(lut, wp).to(LUT_TUNE["table"]), codes, out, n, q, hkv, *codes.stride()[:3], *out.stride()[:3],
        W=w, WP=wp, TILE=tile, TILES=tiles, num_warps=LUT_TUNE["num_warps"],
    )  # fmt: skip
    return out
