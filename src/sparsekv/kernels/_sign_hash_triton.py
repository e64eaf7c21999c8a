"""One program per (batch, kv head, tile of 16 rows, block of output bits): x @ W1 (+ b1, SiLU, @ W2) (+ x @ Wr +
b2) on the tensor cores, sign, pack. float32 weights run as 3xTF32 with 8 warps: about float32 accuracy on the
tensor cores. Measured on the H200 for a Llama-3-8B query batch of 8 (scripts/gpu_probe.py hash), all 128 bits in
one program: 3xTF32 12.1 us with 8 warps but 181 us with 4 (register spills), IEEE fp32 26 / 236 us, plain TF32
or bf16 6-8 us. Two programs of 64 bits each: 3xTF32 9.5 us; four of 32: 15 us. Decode hashes split the bits as
finely as one program per SM allows (`decode_cols`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import pdl_enter
from sparsekv.kernels._triton import MAX_GRID, check_grid, pdl_launch

# output bits per program for decode queries ("auto": `decode_cols`); early: load the second layer's weights
# before the first dot (scripts/gpu_probe.py hash / pair sweep both)
TUNE = {"cols": "auto", "early": False}


#: bytes of one dot operand tile (x rows, a chunk of W1, W2 or Wr): 64 KB, what a float32 head_dim 128 takes in
#: one piece (a 256 x 256 float32 W1 in one tile asked for 512 KB of shared memory on the H200, which has 227 KB)
TILE_BYTES = 64 * 1024


def _fit(size: int, per_unit: int, least: int) -> int:
    """`size` halved until `size` x `per_unit` bytes fit in TILE_BYTES (never below `least`; powers of two stay)."""
    while size > least and size * per_unit > TILE_BYTES:
        size //= 2
    return size


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_cols(programs: int, bits: int, sms: int) -> int:
    """Output bits per program of a decode hash whose grid has `programs` programs per block of output bits:
    the narrowest of 32 / 64 / 128 whose grid still holds one program per SM. With 3xTF32 a program takes 255
    registers, so two do not share an SM. H200, Llama-3-8B shapes: B1
    (8 kv heads) 32 bits 8.6 us, 64 bits 9.6 us; B8 64 bits 9.8 us, 32 bits 15.6 us, 128 bits 13.6 us."""
    if TUNE["cols"] != "auto":
        return TUNE["cols"]
    for cols in (32, 64, 128):
        if bits % cols == 0 and programs * (bits // cols) <= sms:
            return cols
    return 128 if bits % 128 == 0 else bits


@triton.jit
def hash_outputs(x, w1_ptr, w2_ptr, b1_ptr, wr_ptr, kvh, cb, sw1h, sw1d, sw2h, sw2k, D: tl.constexpr,
                 HID: tl.constexpr, BITS: tl.constexpr, MLP: tl.constexpr, BIAS: tl.constexpr, RESID: tl.constexpr,
                 PREC: tl.constexpr, COLS: tl.constexpr, EARLY: tl.constexpr, HC: tl.constexpr,
                 BM: tl.constexpr):  # fmt: skip
    """Rows x [BM, D] of one kv head through x @ W1 (+ b1, SiLU, @ W2) (+ x @ Wr): output columns
    [cb * COLS, (cb + 1) * COLS) in float32. The MLP's hidden layer runs in chunks of HC units (each chunk's
    SiLU output times its rows of W2, summed), so that a weight tile stays within shared memory at any head_dim."""
    d = tl.arange(0, D)
    kb = cb * COLS + tl.arange(0, COLS)
    w_head = kvh.to(tl.int64)
    if not MLP:  # sign(x W1 + b2): this program's output columns of W1
        w1 = tl.load(w1_ptr + w_head * sw1h + d[:, None] * sw1d + kb[None, :])
        return tl.dot(x.to(w1.dtype), w1, input_precision=PREC)  # [BM, COLS] fp32
    y = tl.zeros([BM, COLS], dtype=tl.float32)
    for h0 in tl.static_range(0, HID, HC):
        hid = h0 + tl.arange(0, HC)
        w1 = tl.load(w1_ptr + w_head * sw1h + d[:, None] * sw1d + hid[None, :])
        if EARLY:  # the second layer's weights in flight with the first's, not after the first dot
            w2 = tl.load(w2_ptr + w_head * sw2h + hid[:, None] * sw2k + kb[None, :])
        h = tl.dot(x.to(w1.dtype), w1, input_precision=PREC)  # [BM, HC] fp32
        if BIAS:
            h += tl.load(b1_ptr + kvh * HID + hid)[None, :].to(tl.float32)
        h = h * tl.sigmoid(h)
        if not EARLY:
            w2 = tl.load(w2_ptr + w_head * sw2h + hid[:, None] * sw2k + kb[None, :])
        y += tl.dot(h.to(w2.dtype), w2, input_precision=PREC)  # [BM, COLS]
    if RESID:  # Spotlight's MLP hash adds a linear branch: x @ Wr (same shape as W2's output)
        wr = tl.load(wr_ptr + w_head * D * BITS + d[:, None] * BITS + kb[None, :])
        y += tl.dot(x.to(wr.dtype), wr, input_precision=PREC)
    return y


@triton.jit
def packed_signs(y, BM: tl.constexpr, COLS: tl.constexpr):
    """[BM, COLS] floats -> [BM, COLS / 32] int32 words of their sign bits (bit j of a word: column j > 0)."""
    bitv = tl.reshape((y > 0).to(tl.int32), [BM, COLS // 32, 32])
    return tl.sum(bitv << tl.arange(0, 32)[None, None, :], axis=2)  # bit 31 wraps to the sign: intended


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
    EARLY: tl.constexpr = False,
    HC: tl.constexpr = 16,
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
    y = hash_outputs(x, w1_ptr, w2_ptr, b1_ptr, wr_ptr, kvh, cb, sw1h, sw1d, sw2h, sw2k, D, HID, BITS, MLP, BIAS,
                     RESID, PREC, COLS, EARLY, HC, BM)  # fmt: skip
    kb = cb * COLS + tl.arange(0, COLS)
    if BIAS2:
        y += tl.load(b2_ptr + kvh * BITS + kb)[None, :].to(tl.float32)
    W: tl.constexpr = BITS // 32
    w = cb * (COLS // 32) + tl.arange(0, COLS // 32)
    tl.store(
        out_ptr + ((b.to(tl.int64) * HKV + kvh) * M + rows[:, None]) * W + w[None, :],
        packed_signs(y, BM, COLS),
        mask=rmask[:, None],
    )


@triton.jit
def _sign_hash_pair_kernel(
    xq_ptr,
    xk_ptr,
    mean_ptr,
    kscale_ptr,
    qscale_ptr,
    w1_ptr,
    w2_ptr,
    b1_ptr,
    wr_ptr,
    outq_ptr,
    outk_ptr,
    slots_ptr,
    MQ,
    MK,
    HKV,
    sqb,
    sqh,
    skb,
    skh,
    skt,
    sob,
    soh,
    sot,
    sw1h,
    sw1d,
    sw2h,
    sw2k,
    D: tl.constexpr,
    HID: tl.constexpr,
    BITS: tl.constexpr,
    MLP: tl.constexpr,
    RESID: tl.constexpr,
    PREC: tl.constexpr,
    BM: tl.constexpr,
    COLS: tl.constexpr,
    EARLY: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    HC: tl.constexpr = 16,
    SLOTS: tl.constexpr = False,
):
    """Queries and new keys of one kv head in one tile: rows [0, MQ) are the group's queries (x / query scale),
    rows [MQ, MQ + MK) the new keys ((x - key mean) / key scale); one MLP pass, two outputs. SLOTS: key t's
    codes go to row slots[t] of the key output (a fixed-shape buffer), else to row t."""
    pdl_enter(USE_PDL)
    r = tl.program_id(0)
    cb = tl.program_id(1)
    kvh = r % HKV
    b = r // HKV
    rows = tl.arange(0, BM)
    is_q = rows < MQ
    is_k = (rows >= MQ) & (rows < MQ + MK)
    d = tl.arange(0, D)
    kt = tl.where(is_k, rows - MQ, 0)
    xq = tl.load(xq_ptr + b.to(tl.int64) * sqb + kvh.to(tl.int64) * sqh + rows[:, None] * D + d[None, :],
                 mask=is_q[:, None], other=0.0)  # fmt: skip
    xk = tl.load(xk_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh + kt[:, None] * skt + d[None, :],
                 mask=is_k[:, None], other=0.0)  # fmt: skip
    mean = tl.load(mean_ptr + kvh * D + d)
    scale = tl.where(is_q, tl.load(qscale_ptr + kvh), tl.load(kscale_ptr + kvh))
    x = tl.where(is_q[:, None], xq.to(tl.float32), xk.to(tl.float32) - mean[None, :]) / scale[:, None]
    y = hash_outputs(x, w1_ptr, w2_ptr, b1_ptr, wr_ptr, kvh, cb, sw1h, sw1d, sw2h, sw2k, D, HID, BITS, MLP, True,
                     RESID, PREC, COLS, EARLY, HC, BM)  # fmt: skip
    words = packed_signs(y, BM, COLS)
    W: tl.constexpr = BITS // 32
    w = cb * (COLS // 32) + tl.arange(0, COLS // 32)
    tl.store(outq_ptr + ((b.to(tl.int64) * HKV + kvh) * MQ + rows[:, None]) * W + w[None, :], words,
             mask=is_q[:, None])  # fmt: skip
    out_row = tl.load(slots_ptr + kt, mask=is_k, other=0) if SLOTS else kt.to(tl.int64)
    tl.store(outk_ptr + b.to(tl.int64) * sob + kvh.to(tl.int64) * soh + out_row[:, None] * sot + w[None, :], words,
             mask=is_k[:, None])  # fmt: skip


def sign_hash_triton(x, w1, w2=None, b1=None, wr=None, b2=None):
    """x [B, H, Q, d] -> int32 codes [B, H, Q, bits/32] of sign(silu(x W1 + b1) W2 + x Wr + b2) per kv head
    (sign(x W1 + b2) without W2). Weights [Hkv, ...] in one dtype; x is cast to it."""
    b, heads, q, d = x.shape
    hkv, _, hid = w1.shape
    bits = (w2 if w2 is not None else w1).shape[-1]
    g = heads // hkv
    m = g * q
    if b > 1 and b * hkv > MAX_GRID[1]:  # grid axis y holds the (batch, kv head) pairs: big batches in slices
        per = max(1, MAX_GRID[1] // hkv)
        return torch.cat([sign_hash_triton(x[i : i + per], w1, w2, b1, wr, b2) for i in range(0, b, per)])
    # rows of one kv head's group are contiguous when x is [B, H, Q, d] contiguous: index them as (B, Hkv, M)
    x = x.contiguous()
    w1 = w1.contiguous()
    w2c = w2.contiguous() if w2 is not None else w1
    wrc = wr.contiguous() if wr is not None else w1
    out = torch.empty(b, heads, q, bits // 32, dtype=torch.int32, device=x.device)
    # 16 rows per program for decode (a few queries); long prompts take 128 (prompt keys of one 128K x B8 layer,
    # 3xTF32 on the H200: 35 ms at 16 rows, 49 ms at 64, 24 ms at 128; torch's float32 matmuls take 51 ms)
    size = w1.element_size()
    bm = 16 if m < 128 else _fit(128, d * size, 16)
    # decode queries: each program computes `decode_cols` output bits (the MLP's hidden layer is recomputed per
    # program), so more programs with shorter dot chains and smaller second-layer weight loads
    cols = decode_cols(triton.cdiv(m, bm) * b * hkv, bits, _sms(x.device)) if m < 128 else bits
    cols = _fit(cols if bits % cols == 0 else bits, d * size, 32)
    _sign_hash_kernel[check_grid("sign_hash", x.shape, (triton.cdiv(m, bm), b * hkv, bits // cols))](
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
        EARLY=TUNE["early"],
        HC=_fit(hid, d * size, 16),
        num_warps=8 if cols > 256 or w1.dtype == torch.float32 else 4,
        **pdl_launch(x.device),
    )
    return out


def sign_hash_pair_triton(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2=None, b1=None, wr=None,
                          key_slots=None):  # fmt: skip
    """One launch for a decode step's queries and new keys (see `sign_hash.sign_hash_pair`): both sets of rows of
    a kv head share its program, so the keys' hash adds no launch and no latency."""
    b, hq, q, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    hid = w1.shape[-1]
    bits = (w2 if w2 is not None else w1).shape[-1]
    mq = hq // hkv * q
    query = query.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    w2c = w2.contiguous() if w2 is not None else w1
    out_q = torch.empty(b, hq, q, bits // 32, dtype=torch.int32, device=query.device)
    size = w1.element_size()
    cols = decode_cols(b * hkv, bits, _sms(query.device))
    cols = _fit(cols if bits % cols == 0 else bits, d * size, 32)
    _sign_hash_pair_kernel[check_grid("sign_hash_pair", query.shape, (b * hkv, bits // cols))](
        query,
        keys,
        key_mean,
        key_scale,
        query_scale,
        w1,
        w2c,
        b1 if b1 is not None else w1,
        wr if wr is not None else w1,
        out_q,
        key_out,
        key_slots if key_slots is not None else key_out,
        mq,
        t,
        hkv,
        hq * q * d,
        mq * d,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        key_out.stride(0),
        key_out.stride(1),
        key_out.stride(2),
        w1.stride(0),
        w1.stride(1),
        w2c.stride(0),
        w2c.stride(1),
        D=d,
        HID=hid,
        BITS=bits,
        MLP=w2 is not None,
        RESID=wr is not None and w2 is not None,
        PREC="tf32x3" if w1.dtype == torch.float32 else "tf32",
        BM=max(16, triton.next_power_of_2(mq + t)),
        COLS=cols,
        EARLY=TUNE["early"],
        HC=_fit(hid, d * size, 16),
        SLOTS=key_slots is not None,
        num_warps=8 if w1.dtype == torch.float32 else 4,
        **pdl_launch(query.device),
    )
    return out_q
