"""One program per (batch, kv head, tile of 16 rows, block of output bits): x @ W1 (+ b1, SiLU, @ W2) (+ x @ Wr +
b2) on the tensor cores, sign, pack. float32 weights run as 3xTF32 with 8 warps: about float32 accuracy on the
tensor cores. Measured on the H200 for a Llama-3-8B query batch of 8 (scripts/gpu_probe.py hash), all 128 bits in
one program: 3xTF32 12.1 us with 8 warps but 181 us with 4 (register spills), IEEE fp32 26 / 236 us, plain TF32
or bf16 6-8 us. Two programs of 64 bits each (the default for decode queries): 3xTF32 9.5 us; four of 32: 15 us."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import pdl_enter
from sparsekv.kernels._triton import pdl_launch

TUNE = {"cols": 64}  # output bits per program for decode queries (scripts/gpu_probe.py sweeps it)


@triton.jit
def _sign_hash_kernel(
    x_ptr,
    w1_ptr,
    w2_ptr,
    b1_ptr,
    wr_ptr,
    b2_ptr,
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
    RESID: tl.constexpr,
    BIAS2: tl.constexpr,
    PREC: tl.constexpr,
    BM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    COLS: tl.constexpr = 32,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    r = tl.program_id(1)
    cb = tl.program_id(2)  # block of COLS output bits (a multiple of 32): short chains for decode queries
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
    x = x.to(w1.dtype)
    y = tl.dot(x, w1, input_precision=PREC)  # [BM, HID] fp32
    kb = cb * COLS + tl.arange(0, COLS)
    if MLP:
        if BIAS:
            y += tl.load(b1_ptr + kvh * HID + hid)[None, :].to(tl.float32)
        y = y * tl.sigmoid(y)
        w2 = tl.load(w2_ptr + kvh.to(tl.int64) * sw2h + hid[:, None] * sw2k + kb[None, :])
        y = tl.dot(y.to(w2.dtype), w2, input_precision=PREC)  # [BM, BITS]
        if RESID:  # Spotlight's MLP hash adds a linear branch: x @ Wr (same shape as W2's output)
            wr = tl.load(wr_ptr + kvh.to(tl.int64) * D * BITS + d[:, None] * BITS + kb[None, :])
            y += tl.dot(x, wr, input_precision=PREC)
    if BIAS2:
        y += tl.load(b2_ptr + kvh * BITS + kb)[None, :].to(tl.float32)
    W: tl.constexpr = BITS // 32
    WC: tl.constexpr = COLS // 32
    bitv = (y > 0).to(tl.int32)
    bitv = tl.reshape(bitv, [BM, WC, 32])
    words = tl.sum(bitv << tl.arange(0, 32)[None, None, :], axis=2)  # bit 31 wraps to the sign: intended
    w = cb * WC + tl.arange(0, WC)
    tl.store(
        out_ptr + ((b.to(tl.int64) * HKV + kvh) * M + rows[:, None]) * W + w[None, :],
        words,
        mask=rmask[:, None],
    )


def sign_hash_triton(x, w1, w2=None, b1=None, wr=None, b2=None):
    """x [B, H, Q, d] -> int32 codes [B, H, Q, bits/32] of sign(silu(x W1 + b1) W2 + x Wr + b2) per kv head
    (sign(x W1 + b2) without W2). Weights [Hkv, ...] in one dtype; x is cast to it."""
    b, heads, q, d = x.shape
    hkv, _, hid = w1.shape
    bits = (w2 if w2 is not None else w1).shape[-1]
    g = heads // hkv
    m = g * q
    # rows of one kv head's group are contiguous when x is [B, H, Q, d] contiguous: index them as (B, Hkv, M)
    x = x.contiguous()
    w1 = w1.contiguous()
    w2c = w2.contiguous() if w2 is not None else w1
    wrc = wr.contiguous() if wr is not None else w1
    out = torch.empty(b, heads, q, bits // 32, dtype=torch.int32, device=x.device)
    # 16 rows per program for decode (a few queries); long prompts take 128 (prompt keys of one 128K x B8 layer,
    # 3xTF32 on the H200: 35 ms at 16 rows, 49 ms at 64, 24 ms at 128; torch's float32 matmuls take 51 ms)
    bm = 16 if m < 128 else 128
    # decode queries: each program computes TUNE["cols"] output bits (the MLP's hidden layer is recomputed per
    # program), so more programs with shorter dot chains and smaller second-layer weight loads
    split = w2 is not None and m < 128 and bits % TUNE["cols"] == 0
    cols = TUNE["cols"] if split else bits
    _sign_hash_kernel[(triton.cdiv(m, bm), b * hkv, bits // cols)](
        x,
        w1,
        w2c,
        b1 if b1 is not None else w1,
        wrc,
        b2 if b2 is not None else w1,
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
        RESID=wr is not None and w2 is not None,
        BIAS2=b2 is not None,
        PREC="tf32x3" if w1.dtype == torch.float32 else "tf32",
        BM=bm,
        COLS=cols,
        num_warps=8 if cols > 256 or w1.dtype == torch.float32 else 4,
        **pdl_launch(x.device),
    )
    return out
