"""One program per (batch, kv head, tile of 16 rows): x @ W1 (+ b1, SiLU, @ W2) on the tensor cores, sign, pack."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sign_hash_kernel(
    x_ptr,
    w1_ptr,
    w2_ptr,
    b1_ptr,
    out_ptr,
    M,
    HKV,
    sxb,
    sxh,
    sxm,
    sw1h,
    sw1d,
    sw2h,
    sw2k,
    D: tl.constexpr,
    HID: tl.constexpr,
    BITS: tl.constexpr,
    MLP: tl.constexpr,
    BIAS: tl.constexpr,
    BM: tl.constexpr,
):
    t = tl.program_id(0)
    r = tl.program_id(1)
    kvh = r % HKV
    b = r // HKV
    rows = t * BM + tl.arange(0, BM)  # rows of this kv head's group: (head in group) * Q + query
    rmask = rows < M
    d = tl.arange(0, D)
    x = tl.load(
        x_ptr + b.to(tl.int64) * sxb + kvh.to(tl.int64) * sxh + rows[:, None] * sxm + d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )
    hid = tl.arange(0, HID)
    w1 = tl.load(w1_ptr + kvh.to(tl.int64) * sw1h + d[:, None] * sw1d + hid[None, :])
    y = tl.dot(x, w1)  # [BM, HID] fp32
    if MLP:
        if BIAS:
            y += tl.load(b1_ptr + kvh * HID + hid)[None, :].to(tl.float32)
        y = y * tl.sigmoid(y)
        kb = tl.arange(0, BITS)
        w2 = tl.load(w2_ptr + kvh.to(tl.int64) * sw2h + hid[:, None] * sw2k + kb[None, :])
        y = tl.dot(y.to(w2.dtype), w2)  # [BM, BITS]
    W: tl.constexpr = BITS // 32
    bitv = (y > 0).to(tl.int32)
    bitv = tl.reshape(bitv, [BM, W, 32])
    words = tl.sum(bitv << tl.arange(0, 32)[None, None, :], axis=2)  # bit 31 wraps to the sign: intended
    w = tl.arange(0, W)
    tl.store(
        out_ptr + ((b.to(tl.int64) * HKV + kvh) * M + rows[:, None]) * W + w[None, :],
        words,
        mask=rmask[:, None],
    )


def sign_hash_triton(x, w1, w2=None, b1=None):
    b, heads, q, d = x.shape
    hkv, _, hid = w1.shape
    bits = (w2 if w2 is not None else w1).shape[-1]
    g = heads // hkv
    m = g * q
    # rows of one kv head's group are contiguous when x is [B, H, Q, d] contiguous: index them as (B, Hkv, M)
    x = x.contiguous()
    w1 = w1.contiguous()
    w2c = w2.contiguous() if w2 is not None else w1
    out = torch.empty(b, heads, q, bits // 32, dtype=torch.int32, device=x.device)
    bm = 16
    _sign_hash_kernel[(triton.cdiv(m, bm), b * hkv)](
        x,
        w1,
        w2c,
        b1 if b1 is not None else w1,
        out,
        m,
        hkv,
        heads * q * d,
        g * q * d,
        d,
        w1.stride(0),
        w1.stride(1),
        w2c.stride(0),
        w2c.stride(1),
        D=d,
        HID=hid,
        BITS=bits,
        MLP=w2 is not None,
        BIAS=b1 is not None,
        BM=bm,
        num_warps=4 if bits <= 256 else 8,
    )
    return out
