"""Self-index LUT scoring: the per-(kv head, query) table [d/4, 16] is built by torch (tiny), the kernel streams
each token's packed sign bits once (16-byte vectors for d=128) and sums the table entries of its 4-bit patterns.
The lookups hit L1: the table is 2 KB for d=128."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lut_kernel(
    lut_ptr,
    code_ptr,
    out_ptr,
    N,
    Q,
    HKV,
    scb,
    sch,
    scn,
    sob,
    soh,
    soq,
    W: tl.constexpr,
    WP: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    nb = tl.program_id(0)
    r = tl.program_id(1)
    qi = r % Q
    kvh = (r // Q) % HKV
    b = r // (Q * HKV)
    offs = nb * BLOCK + tl.arange(0, BLOCK)
    nm = offs < N
    w = tl.arange(0, WP)
    codes = tl.load(code_ptr + b.to(tl.int64) * scb + kvh.to(tl.int64) * sch + offs[:, None].to(tl.int64) * scn
                    + w[None, :], mask=nm[:, None] & (w < W)[None, :], other=0)  # fmt: skip
    lut = lut_ptr + r.to(tl.int64) * GROUPS * 16  # LUT rows follow (b, kvh, q) order
    acc = tl.zeros([BLOCK, WP], dtype=tl.float32)
    for j in tl.static_range(8):  # 8 nibbles per word
        grp = w * 8 + j
        pat = (codes >> (4 * j)) & 0xF
        gm = (grp < GROUPS)[None, :] & nm[:, None]
        acc += tl.load(lut + grp[None, :] * 16 + pat, mask=gm, other=0.0)
    score = tl.sum(acc, axis=1)
    tl.store(
        out_ptr + b.to(tl.int64) * sob + kvh.to(tl.int64) * soh + qi.to(tl.int64) * soq + offs, score, mask=nm
    )


def lut_scores_triton(query, centroids, sign_codes):
    from sparsekv.kernels.lut_score import lut_tables

    lut = lut_tables(query, centroids).contiguous()  # [B, Hkv, Q, G, 16] fp32
    b, hkv, q, groups, _ = lut.shape
    n, w = sign_codes.shape[2], sign_codes.shape[3]
    out = torch.empty(b, hkv, q, n, dtype=torch.float32, device=query.device)
    if n == 0:
        return out
    codes = sign_codes if sign_codes.stride(-1) == 1 else sign_codes.contiguous()
    block = 256
    _lut_kernel[(triton.cdiv(n, block), b * hkv * q)](
        lut, codes, out, n, q, hkv, *codes.stride()[:3], *out.stride()[:3],
        W=w, WP=triton.next_power_of_2(w), GROUPS=groups, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
