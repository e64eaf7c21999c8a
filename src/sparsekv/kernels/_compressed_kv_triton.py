"""Triton kernels over the self-index compressed cache: each program gathers a block of listed tokens and
dequantizes their K (sign bit x alpha x magnitude level x scale, + mu) and V (level x scale + zero) in registers,
so only the selected tokens' bytes are read and nothing of the whole cache is materialized.

* `compressed_key_scores_triton`: q . (K - mu) for candidate rows (the re-rank), one kv-head query per row.
* `compressed_attention_triton`: split-K attention over the selected rows (GQA group shares each gathered row),
  sinks and the query's newest tokens read from their 16-bit copies; merged by the split-K combine kernel.
* `scored_attention_triton`: the same attention with the logits taken from the re-rank's scores of the selected
  candidates: V alone is gathered and dequantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._sparse_attention_triton import (
    _combine_kernel,
    online_softmax_block,
    store_split_partial,
)
from sparsekv.kernels._tl_utils import chunk_and_row
from sparsekv.kernels._triton import check_grid, interpreting, next_pow2, register_cap, row_grid

# attention launch. precision "auto": 3xTF32 dots for float32 queries (float32 accuracy on tensor cores; plain IEEE
# float32 dots run on the FMA units: 1481 us vs 195 us at 128K x B8 on the H200), one TF32 pass for 16-bit queries,
# whose output rounding is coarser than TF32's (139 us; scripts/gpu_probe.py selfindex), and where the caller asks
# for it (`tf32`: a 16-bit model's rotated float32 query). Each program attends about `split_keys` of a row's
# selected tokens, and a launch has at least `min_programs_per_sm` programs per SM: at 128K x B4 (32 rows) and B8,
# 2% selected, 16 tokens a tile with 2 warps and 80 tokens a program took 67.7 / 127.9 us, against 80.7 / 138.8 us
# for 32 x 4 warps and 4 programs per SM, and 76.0 / 139.1 us with 96 tokens a program (scripts/gpu_probe.py
# selfindex, PROBE_BATCH=4 / 8)
ATTN_TUNE = {"block": 16, "num_warps": 2, "precision": "auto", "split_keys": 80, "min_programs_per_sm": 2}
# re-rank of 3 x 2% of 128K: 16 tokens a program with 2 warps took 74.3 us at B4 and 467.1 us at B28, against 74.9 /
# 461.6 us with 32 tokens and 2 warps, and 81-83 / 509-525 us with 1 or 4 warps or 8 tokens a program; before the
# one-load copies, at B4: 90.2 / 110.5 us with 32 / 64 tokens and 4 warps against 77.6 (scripts/gpu_probe.py selfindex)
# Capping the re-rank at 64 registers a thread (from 96: 10 -> 16 programs a SM) hides more of the latency of its
# gathered loads: 74.5 -> 66.5 us at B4, 467.4 -> 405.3 us at B28, the same scores (H200, Llama-3-8B shapes); caps on the
# scored attention (96 -> 64: 40 -> 132 us at B4) and the LUT first stage made them slower
KEYS_TUNE = {"block": 16, "num_warps": 2, "max_registers": 64}
# the scored attention: `ATTN_TUNE`'s tiles and splits, one warp a program (no K to dequantize: V's tile alone). With
# P @ V on the FMA units: 29.5 / 119.5 us at 128K x B4 / B28 against 39.4 / 242.9 us for a TF32 tensor-core dot
# padded to 16 heads, 35.1 / 130.0 us with 8 tokens a tile, and slower still with 2 or 4 warps (H200)
SCORED_WARPS = 1


@triton.jit
def _unpack_row(base, idx, ok, s_row, FIRST: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                DP: tl.constexpr):  # fmt: skip
    """[BLOCK, DP] int32 fields of BITS bits packed from byte FIRST of each listed row (element i in bits
    (i % per_byte) * BITS of byte i // per_byte): one load per byte, unpacked in registers."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, DP // PER)
    byte = tl.load(base + idx[:, None] * s_row + FIRST + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
    q = (byte[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(q, [BLOCK, DP])


@triton.jit
def _spread(base, idx, ok, s_row, EVERY: tl.constexpr, BLOCK: tl.constexpr, DP: tl.constexpr):
    """[BLOCK, DP] float32: entry i // EVERY of each listed row, for element i."""
    j = tl.arange(0, DP // EVERY)
    x = tl.load(base + idx[:, None] * s_row + j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(x[:, :, None], [BLOCK, DP // EVERY, EVERY]), [BLOCK, DP])


@triton.jit
def _level_and_scale_row(q, idx, scale_offset, scale_rows, MIDRISE: tl.constexpr, SCALE_TOKENS: tl.constexpr):
    """|K| level of the codes q (float32) and the k_scale row of each listed token idx [BLOCK]."""
    level = q.to(tl.float32)
    if MIDRISE:
        level += 0.5
    if SCALE_TOKENS > 1:
        srow = tl.minimum((idx + scale_offset) // SCALE_TOKENS, scale_rows - 1)
    else:
        srow = idx
    return level, srow


@triton.jit
def _centred_keys_vec(sign_base, mag_base, scale_base, zero_base, idx, ok, alpha, s_sign, s_mag, s_scale,
                      scale_offset, scale_rows, D: tl.constexpr, KBITS: tl.constexpr, MIDRISE: tl.constexpr,
                      HAS_ZERO: tl.constexpr, SCALE_TOKENS: tl.constexpr, CH_PER_SCALE: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """_centred_keys for D a power of two >= 32: whole bytes / words / scales per load."""
    words = tl.load(sign_base + idx[:, None] * s_sign + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=0)
    bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    sign = tl.reshape(bits, [BLOCK, D]).to(tl.float32) * 2.0 - 1.0
    if KBITS == 3:
        q = _unpack_row(mag_base, idx, ok, s_mag, 0, 2, BLOCK, D) | (
            _unpack_row(mag_base, idx, ok, s_mag, D // 4, 1, BLOCK, D) << 2
        )
    else:
        q = _unpack_row(mag_base, idx, ok, s_mag, 0, KBITS, BLOCK, D)
    level, srow = _level_and_scale_row(q, idx, scale_offset, scale_rows, MIDRISE, SCALE_TOKENS)
    mag = level * _spread(scale_base, srow, ok, s_scale, CH_PER_SCALE, BLOCK, D)
    if HAS_ZERO:
        mag += _spread(zero_base, srow, ok, s_scale, CH_PER_SCALE, BLOCK, D)
    return sign * mag * alpha[None, :]


@triton.jit
def _keys_any(sign_base, mag_base, scale_base, zero_base, idx, ok, c, cmask, alpha, s_sign, s_mag, s_sc,
              scale_offset, scale_rows, D: tl.constexpr, DP: tl.constexpr, KBITS: tl.constexpr,
              MIDRISE: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_TOKENS: tl.constexpr,
              CH_PER_SCALE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    if D == DP and D >= 32:
        return _centred_keys_vec(sign_base, mag_base, scale_base, zero_base, idx, ok, alpha, s_sign, s_mag,
                                 s_sc, scale_offset, scale_rows, D, KBITS, MIDRISE, HAS_ZERO, SCALE_TOKENS,
                                 CH_PER_SCALE, BLOCK)  # fmt: skip
    else:
        return _centred_keys(sign_base, mag_base, scale_base, zero_base, idx, ok, c, cmask, alpha, s_sign, s_mag,
                             s_sc, scale_offset, scale_rows, D, KBITS, MIDRISE, HAS_ZERO, SCALE_TOKENS,
                             CH_PER_SCALE)  # fmt: skip


@triton.jit
def _values_any(v_base, vs_base, vz_base, idx, ok, c, cmask, s_v, s_vs, D: tl.constexpr, DP: tl.constexpr,
                VBITS: tl.constexpr, VGROUP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    if D == DP and D >= 32:
        q = _unpack_row(v_base, idx, ok, s_v, 0, VBITS, BLOCK, D).to(tl.float32)
        return q * _spread(vs_base, idx, ok, s_vs, VGROUP, BLOCK, D) + _spread(vz_base, idx, ok, s_vs, VGROUP,
                                                                               BLOCK, D)  # fmt: skip
    else:
        return _values(v_base, vs_base, vz_base, idx, ok, c, cmask, s_v, s_vs, VBITS, VGROUP)


@triton.jit
def _centred_keys(sign_base, mag_base, scale_base, zero_base, idx, ok, c, cmask, alpha,
                  s_sign, s_mag, s_scale, scale_offset, scale_rows,
                  D: tl.constexpr, KBITS: tl.constexpr, MIDRISE: tl.constexpr, HAS_ZERO: tl.constexpr,
                  SCALE_TOKENS: tl.constexpr, CH_PER_SCALE: tl.constexpr):  # fmt: skip
    """K - mu [BLOCK, DP] float32 of the tokens idx [BLOCK] (int64)."""
    m2 = ok[:, None] & cmask[None, :]
    word = tl.load(sign_base + idx[:, None] * s_sign + (c // 32)[None, :], mask=m2, other=0)
    sign = ((word >> (c % 32)[None, :]) & 1).to(tl.float32) * 2.0 - 1.0
    row_mag = mag_base + idx[:, None] * s_mag
    if KBITS == 3:  # a 2-bit plane of the low bits (d/4 bytes), then a 1-bit plane of the high bits
        low = tl.load(row_mag + (c // 4)[None, :], mask=m2, other=0).to(tl.int32)
        high = tl.load(row_mag + (D // 4 + c // 8)[None, :], mask=m2, other=0).to(tl.int32)
        q = ((low >> ((c % 4) * 2)[None, :]) & 3) | (((high >> (c % 8)[None, :]) & 1) << 2)
    else:
        PER: tl.constexpr = 8 // KBITS
        byte = tl.load(row_mag + (c // PER)[None, :], mask=m2, other=0).to(tl.int32)
        q = (byte >> ((c % PER) * KBITS)[None, :]) & ((1 << KBITS) - 1)
    level, srow = _level_and_scale_row(q, idx, scale_offset, scale_rows, MIDRISE, SCALE_TOKENS)
    s_off = srow[:, None] * s_scale + (c // CH_PER_SCALE)[None, :]
    mag = level * tl.load(scale_base + s_off, mask=m2, other=0.0).to(tl.float32)
    if HAS_ZERO:
        mag += tl.load(zero_base + s_off, mask=m2, other=0.0).to(tl.float32)
    return sign * mag * alpha[None, :]


@triton.jit
def _values(v_base, vs_base, vz_base, idx, ok, c, cmask, s_v, s_vs,
            VBITS: tl.constexpr, VGROUP: tl.constexpr):  # fmt: skip
    m2 = ok[:, None] & cmask[None, :]
    PER: tl.constexpr = 8 // VBITS
    byte = tl.load(v_base + idx[:, None] * s_v + (c // PER)[None, :], mask=m2, other=0).to(tl.int32)
    q = ((byte >> ((c % PER) * VBITS)[None, :]) & ((1 << VBITS) - 1)).to(tl.float32)
    off = idx[:, None] * s_vs + (c // VGROUP)[None, :]
    scale = tl.load(vs_base + off, mask=m2, other=0.0).to(tl.float32)
    zero = tl.load(vz_base + off, mask=m2, other=0.0).to(tl.float32)
    return q * scale + zero


@triton.jit
def _copy_rows(idx, sink_pos, slots, tail_from, tail_first, tail_len, HAS_SINKS: tl.constexpr,
               HAS_TAIL: tl.constexpr):  # fmt: skip
    """Where each listed token idx [BLOCK] is read from a 16-bit copy: (sink slot, tail row) int32, -1 where not.
    In int32 (positions < 2**31), and a sink's slot as a sum over the list (a position is listed at most once):
    the int64 compares and max reduction over the [BLOCK, SP] matches were about a sixth of the re-rank's
    instructions."""
    sink = tl.full(idx.shape, -1, tl.int32)
    tail = tl.full(idx.shape, -1, tl.int32)
    if HAS_SINKS:
        hit = idx.to(tl.int32)[:, None] == sink_pos[None, :]
        sink = tl.sum(tl.where(hit, slots[None, :] + 1, 0), axis=1) - 1
    if HAS_TAIL:
        inside = (idx >= tail_from) & (idx >= tail_first) & (idx - tail_first < tail_len)
        tail = tl.where(inside, (idx - tail_first).to(tl.int32), -1)
    return sink, tail


@triton.jit
def _override(rows, m2, c, sink, tail, sink_base, s_sk, tail_base, s_tk, HAS_SINKS: tl.constexpr,
              HAS_TAIL: tl.constexpr, shift=None):  # fmt: skip
    """rows [BLOCK, DP] with the sink tokens and the query's newest tokens read from their 16-bit copies (sink_base /
    tail_base: this (batch, head)'s [S, d] / [T, d] copies; sink / tail from `_copy_rows`), less `shift` [DP]
    where given (the re-rank's centred keys). One load from either copy, and only in a tile that lists a copied
    token (a few tiles of a row; the branch is uniform over the program): H200, 128K x B4, the re-rank 78.1 -> 68.4
    us and the scored attention 49.0 -> 43.0 us against two masked loads in every tile (B16: 285.1 -> 246.0 and
    167.4 -> 142.5 us); the attention that reads K and V 63.3 -> 63.1 us (B8: 117.0 -> 113.8). A branch around
    the two loads had made that attention slower (172 against 139 us at B8)."""
    if HAS_SINKS or HAS_TAIL:
        copied = (sink >= 0) | (tail >= 0)
        if tl.max(copied.to(tl.int32), axis=0) > 0:
            # a token both sink and tail reads the tail (as `compressed_kv._with_copies`)
            source = tl.where(tail >= 0, tail_base + tl.maximum(tail, 0) * s_tk, sink_base + tl.maximum(sink, 0) * s_sk)
            copy = tl.load(source[:, None] + c[None, :], mask=m2 & copied[:, None], other=0.0).to(tl.float32)
            if shift is not None:
                copy -= shift[None, :]
            rows = tl.where(copied[:, None], copy, rows)
    return rows


@triton.jit
def _key_scores_kernel(
    q_ptr, idx_ptr, out_ptr, sign_ptr, mag_ptr, scale_ptr, zero_ptr, alpha_ptr, mu_ptr,
    sinkpos_ptr, sinkk_ptr, tailk_ptr, tail_from_ptr,
    H, Q, C, scale_offset, scale_rows, num_sinks, tail_first, tail_len,
    sqb, sqh, sqg, sqq, sib, sih, siq, sob, soh, sog, soq,
    s_sign_b, s_sign_h, s_sign, s_mag_b, s_mag_h, s_mag, s_sc_b, s_sc_h, s_sc, s_al_b, s_al_h,
    s_sp_b, s_sp_h, s_sk_b, s_sk_h, s_sk, s_tk_b, s_tk_h, s_tk,
    D: tl.constexpr, DP: tl.constexpr, KBITS: tl.constexpr, MIDRISE: tl.constexpr, HAS_ZERO: tl.constexpr,
    SCALE_TOKENS: tl.constexpr, CH_PER_SCALE: tl.constexpr, SP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_TAIL: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    cb, r = chunk_and_row()
    qi = r % Q
    h = (r // Q) % H
    b = r // (Q * H)
    c = tl.arange(0, DP)
    cmask = c < D
    offs = cb * BLOCK + tl.arange(0, BLOCK)
    ok = offs < C
    b64, h64, q64 = b.to(tl.int64), h.to(tl.int64), qi.to(tl.int64)
    idx = tl.load(idx_ptr + b64 * sib + h64 * sih + q64 * siq + offs, mask=ok, other=0).to(tl.int64)
    alpha = tl.load(alpha_ptr + b64 * s_al_b + h64 * s_al_h + c, mask=cmask, other=0.0)
    keys = _keys_any(
        sign_ptr + b64 * s_sign_b + h64 * s_sign_h, mag_ptr + b64 * s_mag_b + h64 * s_mag_h,
        scale_ptr + b64 * s_sc_b + h64 * s_sc_h, zero_ptr + b64 * s_sc_b + h64 * s_sc_h,
        idx, ok, c, cmask, alpha, s_sign, s_mag, s_sc, scale_offset, scale_rows,
        D, DP, KBITS, MIDRISE, HAS_ZERO, SCALE_TOKENS, CH_PER_SCALE, BLOCK,
    )  # fmt: skip
    if HAS_SINKS or HAS_TAIL:
        slots = tl.arange(0, SP)
        sink_pos = tl.load(sinkpos_ptr + b64 * s_sp_b + h64 * s_sp_h + slots, mask=slots < num_sinks, other=-1)
        mu = tl.load(mu_ptr + b64 * s_al_b + h64 * s_al_h + c, mask=cmask, other=0.0)
        m2 = ok[:, None] & cmask[None, :]
        sink, tail = _copy_rows(idx, sink_pos, slots, tl.load(tail_from_ptr + qi), tail_first, tail_len, HAS_SINKS,
                                HAS_TAIL)  # fmt: skip
        keys = _override(keys, m2, c, sink, tail, sinkk_ptr + b64 * s_sk_b + h64 * s_sk_h, s_sk,
                         tailk_ptr + b64 * s_tk_b + h64 * s_tk_h, s_tk, HAS_SINKS, HAS_TAIL, mu)  # fmt: skip
    # the keys are dequantized once for the G queries of the row (the query heads of a GQA group, or its sum)
    for g in tl.static_range(G):
        query = tl.load(q_ptr + b64 * sqb + h64 * sqh + g * sqg + q64 * sqq + c, mask=cmask, other=0.0)
        score = tl.sum(keys * query.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + b64 * sob + h64 * soh + g * sog + q64 * soq + offs, score, mask=ok)


def _key_layout(kv):
    d = kv.head_dim
    channel_axis = kv.k_scale_tokens > 1
    return {
        "D": d,
        "DP": next_pow2(d),
        "KBITS": kv.k_bits,
        "MIDRISE": kv.midrise,
        "HAS_ZERO": kv.k_zero is not None,
        "SCALE_TOKENS": kv.k_scale_tokens,
        "CH_PER_SCALE": 1 if channel_axis else d // kv.k_scale.shape[-1],
    }


def _check_rows(kv):
    for name in ("sign_bits", "k_mag", "k_scale", "v", "v_scale", "v_zero"):
        if getattr(kv, name).stride(-1) != 1:
            raise ValueError(f"CompressedKV.{name} needs unit stride in its last dimension")


def _copies(kv, fallback, tail_from):
    """Kernel arguments of the 16-bit copies (fallback tensors stand in for absent ones)."""
    has_sinks = kv.sink_positions is not None and kv.sink_keys is not None
    has_tail = kv.tail_keys is not None and kv.tail_keys.shape[2] > 0
    num_sinks = kv.sink_positions.shape[-1] if has_sinks else 0
    # an absent copy's pointer stands in with the other copy's (`_override` selects between them: one dtype)
    keys = kv.sink_keys if has_sinks else kv.tail_keys if has_tail else fallback
    values = kv.sink_values if has_sinks else kv.tail_values if has_tail else fallback
    return {
        "sinkpos": kv.sink_positions if has_sinks else fallback,
        "sink_k": keys,
        "sink_v": values,
        "tail_k": kv.tail_keys if has_tail else keys,
        "tail_v": kv.tail_values if has_tail else values,
        "tail_from": tail_from.to(device=fallback.device, dtype=torch.int64),
        "num_sinks": num_sinks,
        "tail_len": kv.tail_keys.shape[2] if has_tail else 0,
        "meta": {"SP": next_pow2(max(num_sinks, 1)), "HAS_SINKS": has_sinks, "HAS_TAIL": has_tail},
    }


def compressed_key_scores_triton(query, kv, index, tail_from):
    _check_rows(kv)
    b, h, q, cnum = index.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    # [B, H, G, Q, d]: each query head of a kv head's group; a [B, H, Q, d] query is the group of one
    heads = query if query.dim() == 5 else query.unsqueeze(2)
    g = heads.shape[2]
    out = torch.empty(b, h, g, q, cnum, dtype=torch.float32, device=index.device)
    block = KEYS_TUNE["block"]
    zero = kv.k_zero if kv.k_zero is not None else kv.k_scale
    cp = _copies(kv, query, tail_from)
    _key_scores_kernel[row_grid("compressed_key_scores", index.shape, triton.cdiv(cnum, block), b * h * q)](
        heads, index, out, kv.sign_bits, kv.k_mag, kv.k_scale, zero, kv.alpha, kv.mu,
        cp["sinkpos"], cp["sink_k"], cp["tail_k"], cp["tail_from"],
        h, q, cnum, kv.k_scale_offset, kv.k_scale.shape[2], cp["num_sinks"], kv.tail_first, cp["tail_len"],
        *heads.stride()[:4], *index.stride()[:3], *out.stride()[:4],
        *kv.sign_bits.stride()[:3], *kv.k_mag.stride()[:3], *kv.k_scale.stride()[:3], *kv.alpha.stride()[:2],
        *cp["sinkpos"].stride()[:2], *cp["sink_k"].stride()[:3], *cp["tail_k"].stride()[:3],
        BLOCK=block, G=g, num_warps=KEYS_TUNE["num_warps"], **cp["meta"], **_key_layout(kv),
        **register_cap(index.device, KEYS_TUNE["max_registers"]),
    )  # fmt: skip
    return out if query.dim() == 5 else out.squeeze(2)


@triton.jit
def _attention_kernel(
    q_ptr, idx_ptr, valid_ptr, tail_from_ptr, o_ptr, lse_ptr,
    sign_ptr, mag_ptr, scale_ptr, zero_ptr, alpha_ptr, mu_ptr, v_ptr, vs_ptr, vz_ptr,
    sinkpos_ptr, sinkk_ptr, sinkv_ptr, tailk_ptr, tailv_ptr,
    H, Q, K, HQ, split_len, num_splits, qk_scale, scale_offset, scale_rows, num_sinks, tail_first, tail_len,
    sqb, sqh, sqq, sib, sih, siq, svlb, svlh, svlq,
    s_sign_b, s_sign_h, s_sign, s_mag_b, s_mag_h, s_mag, s_sc_b, s_sc_h, s_sc, s_al_b, s_al_h,
    s_v_b, s_v_h, s_v, s_vs_b, s_vs_h, s_vs,
    s_sp_b, s_sp_h, s_sk_b, s_sk_h, s_sk, s_tk_b, s_tk_h, s_tk,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, KBITS: tl.constexpr,
    MIDRISE: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_TOKENS: tl.constexpr, CH_PER_SCALE: tl.constexpr,
    VBITS: tl.constexpr, VGROUP: tl.constexpr, SP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_TAIL: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    sp, r = chunk_and_row()
    qi = r % Q
    h = (r // Q) % H
    b = r // (Q * H)
    b64, h64, q64 = b.to(tl.int64), h.to(tl.int64), qi.to(tl.int64)
    heads = tl.arange(0, GP)
    hmask = heads < G
    c = tl.arange(0, DP)
    cmask = c < D
    query = tl.load(q_ptr + b64 * sqb + (h * G + heads[:, None]).to(tl.int64) * sqh + q64 * sqq + c[None, :],
                    mask=hmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
    alpha = tl.load(alpha_ptr + b64 * s_al_b + h64 * s_al_h + c, mask=cmask, other=0.0)
    mu = tl.load(mu_ptr + b64 * s_al_b + h64 * s_al_h + c, mask=cmask, other=0.0)
    sign_base = sign_ptr + b64 * s_sign_b + h64 * s_sign_h
    mag_base = mag_ptr + b64 * s_mag_b + h64 * s_mag_h
    scale_base = scale_ptr + b64 * s_sc_b + h64 * s_sc_h
    zero_base = zero_ptr + b64 * s_sc_b + h64 * s_sc_h
    v_base = v_ptr + b64 * s_v_b + h64 * s_v_h
    vs_base = vs_ptr + b64 * s_vs_b + h64 * s_vs_h
    vz_base = vz_ptr + b64 * s_vs_b + h64 * s_vs_h
    i_base = idx_ptr + b64 * sib + h64 * sih + q64 * siq
    vl_base = valid_ptr + b64 * svlb + h64 * svlh + q64 * svlq
    slots = tl.arange(0, SP)
    sink_pos = tl.load(sinkpos_ptr + b64 * s_sp_b + h64 * s_sp_h + slots, mask=slots < num_sinks, other=-1)
    tail_from = tl.load(tail_from_ptr + qi)
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, K)
    for j in range(start, end, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        jm = offs < end
        ok = jm & (tl.load(vl_base + offs, mask=jm, other=0) != 0)
        idx = tl.load(i_base + offs, mask=jm, other=0).to(tl.int64)
        keys = mu[None, :] + _keys_any(
            sign_base, mag_base, scale_base, zero_base, idx, ok, c, cmask, alpha, s_sign, s_mag, s_sc,
            scale_offset, scale_rows, D, DP, KBITS, MIDRISE, HAS_ZERO, SCALE_TOKENS, CH_PER_SCALE, BLOCK,
        )  # fmt: skip
        values = _values_any(v_base, vs_base, vz_base, idx, ok, c, cmask, s_v, s_vs, D, DP, VBITS, VGROUP, BLOCK)
        m2 = ok[:, None] & cmask[None, :]
        sink_k, tail_k = sinkk_ptr + b64 * s_sk_b + h64 * s_sk_h, tailk_ptr + b64 * s_tk_b + h64 * s_tk_h
        sink_v, tail_v = sinkv_ptr + b64 * s_sk_b + h64 * s_sk_h, tailv_ptr + b64 * s_tk_b + h64 * s_tk_h
        sink, tail = _copy_rows(idx, sink_pos, slots, tail_from, tail_first, tail_len, HAS_SINKS, HAS_TAIL)
        keys = _override(keys, m2, c, sink, tail, sink_k, s_sk, tail_k, s_tk, HAS_SINKS, HAS_TAIL)
        values = _override(values, m2, c, sink, tail, sink_v, s_sk, tail_v, s_tk, HAS_SINKS, HAS_TAIL)
        sc = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * qk_scale  # [GP, BLOCK], log2 domain
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_i, corr, p, l_i = online_softmax_block(m_i, l_i, sc)
        acc = acc * corr[:, None] + tl.dot(p, values, input_precision=PRECISION)
    row = (b64 * HQ + h * G + heads) * Q + qi  # [GP] rows of the (B, Hq, Q) output
    store_split_partial(o_ptr, lse_ptr, row, sp, num_splits, acc, l_i, m_i, c, D, hmask, cmask)


def _precision(dtype: torch.dtype, tf32: bool) -> str:
    if interpreting():
        return "ieee"
    if ATTN_TUNE["precision"] != "auto":
        return ATTN_TUNE["precision"]
    return "tf32x3" if dtype == torch.float32 and not tf32 else "tf32"


def compressed_attention_triton(query, kv, indices, valid, scaling, tail_from, tf32=False):
    _check_rows(kv)
    b, hq, q, d = query.shape
    h, kk = indices.shape[1], indices.shape[3]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    block = ATTN_TUNE["block"]
    rows = b * h * q
    splits, split_len = _splits(kk, rows, query.device)
    o_part = torch.empty(b * hq * q, splits, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(b * hq * q, splits, dtype=torch.float32, device=query.device)
    zero = kv.k_zero if kv.k_zero is not None else kv.k_scale
    cp = _copies(kv, query, tail_from)
    _attention_kernel[row_grid("compressed_attention", query.shape, splits, rows)](
        query, indices, valid, cp["tail_from"], o_part, lse,
        kv.sign_bits, kv.k_mag, kv.k_scale, zero, kv.alpha, kv.mu, kv.v, kv.v_scale, kv.v_zero,
        cp["sinkpos"], cp["sink_k"], cp["sink_v"], cp["tail_k"], cp["tail_v"],
        h, q, kk, hq, split_len, splits, scaling * 1.4426950408889634, kv.k_scale_offset, kv.k_scale.shape[2],
        cp["num_sinks"], kv.tail_first, cp["tail_len"],
        *query.stride()[:3], *indices.stride()[:3], *valid.stride()[:3],
        *kv.sign_bits.stride()[:3], *kv.k_mag.stride()[:3], *kv.k_scale.stride()[:3], *kv.alpha.stride()[:2],
        *kv.v.stride()[:3], *kv.v_scale.stride()[:3],
        *cp["sinkpos"].stride()[:2], *cp["sink_k"].stride()[:3], *cp["tail_k"].stride()[:3],
        G=hq // h, GP=max(16, next_pow2(hq // h)), VBITS=kv.v_bits, VGROUP=d // kv.v_scale.shape[-1],
        BLOCK=block, PRECISION=_precision(query.dtype, tf32),
        num_warps=ATTN_TUNE["num_warps"], **cp["meta"], **_key_layout(kv),
    )  # fmt: skip
    out = torch.empty(b, hq, q, d, dtype=query.dtype, device=query.device)
    _combine_kernel[check_grid("compressed_attention", query.shape, (b * hq * q,))](
        o_part, lse, out, splits, D=d, DP=next_pow2(d), SP=next_pow2(splits)
    )
    return out


@triton.jit
def _scored_attention_kernel(
    s_ptr, pick_ptr, idx_ptr, valid_ptr, tail_from_ptr, o_ptr, lse_ptr, v_ptr, vs_ptr, vz_ptr,
    sinkpos_ptr, sinkv_ptr, tailv_ptr,
    H, Q, K, HQ, split_len, num_splits, qk_scale, num_sinks, tail_first, tail_len,
    ssb, ssh, ssg, ssq, spb, sph, spq, sib, sih, siq, svlb, svlh, svlq,
    s_v_b, s_v_h, s_v, s_vs_b, s_vs_h, s_vs, s_sp_b, s_sp_h, s_sk_b, s_sk_h, s_sk, s_tk_b, s_tk_h, s_tk,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, VBITS: tl.constexpr,
    VGROUP: tl.constexpr, SP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """`_attention_kernel` with the logits read from the re-rank's scores (scores[g, pick[j]]) instead of computed
    from dequantized keys: only V is gathered. P @ V runs on the FMA units in float32, one head of the GQA group at a
    time: a tensor-core dot would pad the group to 16 rows for a [G, BLOCK] x [BLOCK, D] product."""
    sp, r = chunk_and_row()
    qi = r % Q
    h = (r // Q) % H
    b = r // (Q * H)
    b64, h64, q64 = b.to(tl.int64), h.to(tl.int64), qi.to(tl.int64)
    heads = tl.arange(0, GP)
    hmask = heads < G
    c = tl.arange(0, DP)
    cmask = c < D
    s_base = s_ptr + b64 * ssb + h64 * ssh + q64 * ssq + heads[:, None].to(tl.int64) * ssg
    p_base = pick_ptr + b64 * spb + h64 * sph + q64 * spq
    i_base = idx_ptr + b64 * sib + h64 * sih + q64 * siq
    vl_base = valid_ptr + b64 * svlb + h64 * svlh + q64 * svlq
    v_base = v_ptr + b64 * s_v_b + h64 * s_v_h
    vs_base = vs_ptr + b64 * s_vs_b + h64 * s_vs_h
    vz_base = vz_ptr + b64 * s_vs_b + h64 * s_vs_h
    sink_v, tail_v = sinkv_ptr + b64 * s_sk_b + h64 * s_sk_h, tailv_ptr + b64 * s_tk_b + h64 * s_tk_h
    slots = tl.arange(0, SP)
    sink_pos = tl.load(sinkpos_ptr + b64 * s_sp_b + h64 * s_sp_h + slots, mask=slots < num_sinks, other=-1)
    tail_from = tl.load(tail_from_ptr + qi)
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, K)
    for j in range(start, end, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        jm = offs < end
        ok = jm & (tl.load(vl_base + offs, mask=jm, other=0) != 0)
        idx = tl.load(i_base + offs, mask=jm, other=0).to(tl.int64)
        cand = tl.load(p_base + offs, mask=jm, other=0).to(tl.int64)
        sc = tl.load(s_base + cand[None, :], mask=hmask[:, None] & ok[None, :], other=0.0) * qk_scale
        sc = tl.where(hmask[:, None] & ok[None, :], sc, float("-inf"))  # [GP, BLOCK], log2 domain
        values = _values_any(v_base, vs_base, vz_base, idx, ok, c, cmask, s_v, s_vs, D, DP, VBITS, VGROUP, BLOCK)
        sink, tail = _copy_rows(idx, sink_pos, slots, tail_from, tail_first, tail_len, HAS_SINKS, HAS_TAIL)
        values = _override(values, ok[:, None] & cmask[None, :], c, sink, tail, sink_v, s_sk, tail_v, s_tk,
                           HAS_SINKS, HAS_TAIL)  # fmt: skip
        m_i, corr, p, l_i = online_softmax_block(m_i, l_i, sc)
        acc = acc * corr[:, None]
        for g in tl.static_range(G):
            p_g = tl.sum(tl.where(heads[:, None] == g, p, 0.0), axis=0)  # [BLOCK]: head g's probabilities
            acc += tl.where(heads[:, None] == g, tl.sum(p_g[:, None] * values, axis=0)[None, :], 0.0)
    row = (b64 * HQ + h * G + heads) * Q + qi  # [GP] rows of the (B, Hq, Q) output
    store_split_partial(o_ptr, lse_ptr, row, sp, num_splits, acc, l_i, m_i, c, D, hmask, cmask)


def _splits(kk: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(splits, tokens per split) of a split-K launch over `rows` rows of kk listed tokens (`ATTN_TUNE`)."""
    block = ATTN_TUNE["block"]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = max(triton.cdiv(kk, ATTN_TUNE["split_keys"]), triton.cdiv(ATTN_TUNE["min_programs_per_sm"] * sms, rows))
    splits = max(1, min(wanted, triton.cdiv(kk, block)))
    split_len = triton.cdiv(triton.cdiv(kk, splits), block) * block
    return max(1, triton.cdiv(kk, split_len)), split_len


def scored_attention_triton(scores, pick, kv, indices, valid, scaling, tail_from, dtype):
    _check_rows(kv)
    b, h, g, q, _ = scores.shape
    d, kk = kv.head_dim, indices.shape[3]
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    rows = b * h * q
    splits, split_len = _splits(kk, rows, scores.device)
    o_part = torch.empty(b * h * g * q, splits, d, dtype=torch.float32, device=scores.device)
    lse = torch.empty(b * h * g * q, splits, dtype=torch.float32, device=scores.device)
    cp = _copies(kv, scores, tail_from)
    _scored_attention_kernel[row_grid("scored_attention", scores.shape, splits, rows)](
        scores, pick, indices, valid, cp["tail_from"], o_part, lse, kv.v, kv.v_scale, kv.v_zero,
        cp["sinkpos"], cp["sink_v"], cp["tail_v"],
        h, q, kk, h * g, split_len, splits, scaling * 1.4426950408889634, cp["num_sinks"], kv.tail_first,
        cp["tail_len"], scores.stride(0), scores.stride(1), scores.stride(2), scores.stride(3), *pick.stride()[:3],
        *indices.stride()[:3], *valid.stride()[:3], *kv.v.stride()[:3], *kv.v_scale.stride()[:3],
        *cp["sinkpos"].stride()[:2], *cp["sink_v"].stride()[:3], *cp["tail_v"].stride()[:3],
        G=g, GP=next_pow2(g), D=d, DP=next_pow2(d), VBITS=kv.v_bits, VGROUP=d // kv.v_scale.shape[-1],
        BLOCK=ATTN_TUNE["block"], num_warps=SCORED_WARPS,
        SP=cp["meta"]["SP"], HAS_SINKS=cp["meta"]["HAS_SINKS"], HAS_TAIL=cp["meta"]["HAS_TAIL"],
    )  # fmt: skip
    out = torch.empty(b, h * g, q, d, dtype=dtype, device=scores.device)
    _combine_kernel[check_grid("scored_attention", scores.shape, (b * h * g * q,))](
        o_part, lse, out, splits, D=d, DP=next_pow2(d), SP=next_pow2(splits)
    )
    return out
