"""INT4 q.K estimate over candidate indices: gather each candidate's 64 packed bytes (d=128) + scale/zero once,
unpack to two nibble planes, and score every query head that shares the row with tensor-core dots:
q.k ~= scale * (q_even . lo + q_odd . hi) + zero * sum(q)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import chunk_and_row
from sparsekv.kernels._triton import row_grid

# candidates per program and warps (the kernel benchmark sweeps them)
TUNE = {"block": 128, "num_warps": 4}  # 128 x 4: 128 us vs 166 us at 64 (H200, 128K x B8)


@triton.jit
def _int4_qk_kernel(
    q_ptr,
    pk_ptr,
    sc_ptr,
    zr_ptr,
    idx_ptr,
    out_ptr,
    S,
    Q,
    K,
    HQ,
    g,
    sqb,
    sqh,
    sqq,
    spb,
    sph,
    spn,
    ssb,
    ssh,
    szb,
    szh,
    sib,
    sis,
    siq,
    G: tl.constexpr,
    GP: tl.constexpr,
    DH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    kb, r = chunk_and_row()
    qi = r % Q
    s = (r // Q) % S
    b = r // (Q * S)
    kvh = (s * G) // g
    heads = tl.arange(0, GP)
    hm = heads < G
    j = tl.arange(0, DH)
    qrow = q_ptr + b.to(tl.int64) * sqb + (s * G + heads[:, None]).to(tl.int64) * sqh + qi.to(tl.int64) * sqq
    q_even = tl.load(qrow + 2 * j[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    q_odd = tl.load(qrow + 2 * j[None, :] + 1, mask=hm[:, None], other=0.0).to(tl.float32)
    qsum = tl.sum(q_even + q_odd, axis=1)  # [GP]
    offs = kb * BLOCK + tl.arange(0, BLOCK)
    km = offs < K
    idx = tl.load(
        idx_ptr + b.to(tl.int64) * sib + s.to(tl.int64) * sis + qi.to(tl.int64) * siq + offs, mask=km, other=0
    ).to(tl.int64)
    pk = tl.load(
        pk_ptr + b.to(tl.int64) * spb + kvh.to(tl.int64) * sph + idx[:, None] * spn + j[None, :],
        mask=km[:, None],
        other=0,
    ).to(tl.int32)
    lo = (pk & 0xF).to(tl.float32)
    hi = (pk >> 4).to(tl.float32)
    sc = tl.load(sc_ptr + b.to(tl.int64) * ssb + kvh.to(tl.int64) * ssh + idx, mask=km, other=0.0)
    zr = tl.load(zr_ptr + b.to(tl.int64) * szb + kvh.to(tl.int64) * szh + idx, mask=km, other=0.0)
    # codes are exact in fp16 (0..15); the query rounds to fp16 like a bf16/fp16 model's own q
    dot = tl.dot(q_even.to(tl.float16), tl.trans(lo.to(tl.float16))) + tl.dot(
        q_odd.to(tl.float16), tl.trans(hi.to(tl.float16))
    )  # [GP, BLOCK]
    est = dot * sc[None, :] + qsum[:, None] * zr[None, :]
    rows = (b.to(tl.int64) * HQ + s * G + heads) * Q + qi
    tl.store(out_ptr + rows[:, None] * K + offs[None, :], est, mask=hm[:, None] & km[None, :])


def int4_qk_triton(query, packed, scale, zero, indices):
    b, hq, q, d = query.shape
    hkv = packed.shape[1]
    s, kk = indices.shape[1], indices.shape[3]
    g = hq // hkv
    heads_per_row = hq // s
    out = torch.empty(b, hq, q, kk, dtype=torch.float32, device=query.device)
    if kk == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    scale, zero = scale.float(), zero.float()
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    zero = zero if zero.stride(-1) == 1 else zero.contiguous()
    block = TUNE["block"]
    _int4_qk_kernel[row_grid("int4_qk", indices.shape, triton.cdiv(kk, block), b * s * q)](
        query, packed, scale, zero, indices, out, s, q, kk, hq, g,
        *query.stride()[:3], *packed.stride()[:3], *scale.stride()[:2], *zero.stride()[:2], *indices.stride()[:3],
        G=heads_per_row, GP=max(16, triton.next_power_of_2(heads_per_row)), DH=d // 2, BLOCK=block, num_warps=TUNE["num_warps"],
    )  # fmt: skip
    return out
