"""The self-index compressed K/V format in plain PyTorch: bit packing, the low-bit quantizers and the formulas that
read a stored row back. `compressed_kv` (the decode ops and their kernels) and `selectors.self_index` (which
writes the format) both take it from here.

Layout of one token and kv-head (d channels):
* V: token-wise asymmetric, per `group` channels a float16 scale and zero; codes q in [0, 2^bits) packed by
  `pack_bits`; V[c] = q[c] x scale[c // group] + zero[c // group] (`dequantize`).
* K: K - mu = sign x alpha x m, the sign from the packed sign bits (`kernels.bits.pack_sign_bits`), m = |K - mu|
  / alpha quantized scale-only (zero fixed at 0, or with a zero point in the paper's layout) per channel group of
  one token, or per channel over a block of tokens (`dequantize_keys`).
"""

from __future__ import annotations

import math

import torch

#: range ratios tried per group by `quantize(clip=True)` (the V rows; least squared error): 1, 0.95, ..., 0.6
V_CLIP_RATIOS = tuple(1 - 0.05 * i for i in range(9))
#: groups quantized at once: bounds the [groups, ratios, group] temporaries of a long prefill (2**16 groups of 64
#: with the nine clip ratios: about 150 MB a float32 temporary, a few alive at once, next to a nearly full cache)
_QUANT_CHUNK = 1 << 16


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) [..., d] -> uint8 [..., d*bits/8] (element i in the low bits first).

    3 bits are stored as two planes (the low 2 bits, then the high bit), so d must be a multiple of 8."""
    if bits == 3:
        values = values.to(torch.uint8)
        return torch.cat([pack_bits(values & 3, 2), pack_bits(values >> 2, 1)], dim=-1)
    per_byte = 8 // bits
    v = values.to(torch.uint8).unflatten(-1, (-1, per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=values.device)
    return (v << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 3:
        low, high = packed.split([packed.shape[-1] * 2 // 3, packed.shape[-1] // 3], dim=-1)
        return unpack_bits(low, 2) | (unpack_bits(high, 1) << 2)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def quantize_codes(
    x: torch.Tensor, bits: int, group: int, with_zero: bool = True, clip: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`quantize` without the packing: x [..., d] -> (codes uint8 [..., d], scale fp16 [..., d/group], zero fp16
    [..., d/group] or None)."""
    g = x.unflatten(-1, (-1, group))
    rows = g.reshape(-1, group)
    ratios = len(V_CLIP_RATIOS) if clip and with_zero else 1
    parts = [_quantize_rows(part, bits, with_zero, ratios) for part in rows.split(_QUANT_CHUNK)]
    q, scale, zero = (torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts))
    q, scale, zero = q.view(g.shape), scale.view(g.shape[:-1]), zero.view(g.shape[:-1])
    return q.flatten(-2).to(torch.uint8), scale, zero if with_zero else None


def quantize(
    x: torch.Tensor, bits: int, group: int, with_zero: bool = True, clip: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token-wise asymmetric quantization per `group` elements: x [..., d] ->
    (packed uint8 [..., d*bits/8], scale fp16 [..., d/group], zero fp16 [..., d/group]).

    zero = min, scale = (max - min) / (2^bits - 1), both rounded to float16 first (the stored values), so that
    |x - dequantize(...)| <= scale / 2 + float16 rounding of zero holds for the stored parameters.
    `with_zero=False` (x >= 0, e.g. magnitudes) fixes the zero at 0 and returns None for it: half the parameter
    bytes, and the bound becomes scale / 2 with scale = max / (2^bits - 1).
    `clip` (with a zero only): the range [min, max] is shrunk about its middle to V_CLIP_RATIOS x its width, the
    ratio with the least squared error of the group kept (the first on ties; values outside clamp to the end
    levels); same format. All ratios are tried at once (a fixed number of ops: decode steps run it per token).
    """
    q, scale, zero = quantize_codes(x, bits, group, with_zero, clip)
    return pack_bits(q, bits), scale, zero


def _quantize_rows(
    g: torch.Tensor, bits: int, with_zero: bool, ratios: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g [M, group] -> (codes [M, group], scale fp16 [M], zero fp16 [M]) for the first `ratios` V_CLIP_RATIOS."""
    levels = (1 << bits) - 1
    dtype = g.dtype
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    if not with_zero:  # negative inputs would clamp to 0 (no check: it would sync a device every decode step)
        lo = torch.zeros_like(lo)
    # (1 - ratio) / 2 of V_CLIP_RATIOS, built on the device (no host copy: decode steps are graph-captured)
    half_cut = torch.arange(ratios, device=g.device, dtype=dtype) * 0.025
    shrink = (hi - lo) * half_cut  # [M, R]
    top = hi - shrink
    zero = (lo + shrink).to(torch.float16)
    scale = ((top - zero.to(dtype)) / levels).to(torch.float16)
    scale = torch.where(
        (scale.to(dtype) * levels + zero.to(dtype)) < top,
        torch.nextafter(scale, torch.full_like(scale, math.inf)),  # full_like: no host copy (graph capture)
        scale,
    )
    safe = torch.where(scale > 0, scale.to(dtype), torch.ones_like(top))
    q = torch.round((g[:, None] - zero.to(dtype)[..., None]) / safe[..., None]).clamp(0, levels)  # [M, R, G]
    if ratios > 1:
        err = (q * scale.to(dtype)[..., None] + zero.to(dtype)[..., None] - g[:, None]).square().sum(-1)
        best = err.argmin(-1, keepdim=True)  # the first of equal errors
        q = q.gather(1, best[..., None].expand(-1, -1, q.shape[-1]))
        scale, zero = scale.gather(1, best), zero.gather(1, best)
    return q[:, 0], scale[:, 0], zero[:, 0]


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize` (the V rows): x[c] = q[c] * scale[c // group] + zero[c // group], group = d / groups.

    packed uint8 [..., d*bits/8] (`pack_bits` layout), scale / zero fp16 [..., d/group] -> [..., d] in `dtype`."""
    q = unpack_bits(packed, bits).to(dtype).unflatten(-1, (scale.shape[-1], -1))
    out = q * scale.to(dtype)[..., None]
    if zero is not None:
        out = out + zero.to(dtype)[..., None]
    return out.flatten(-2)


def dequantize_keys(
    sign_bits: torch.Tensor,
    k_mag: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor | None,
    mu: torch.Tensor,
    alpha: torch.Tensor,
    bits: int,
    midrise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """K - mu of gathered compressed rows (both K layouts; the caller gathers each token's own scale row):

        K[c] - mu[c] = sign[c] x alpha[c] x m[c],  sign[c] = +1 if bit c of the sign words is set else -1,
        m[c] = q[c] x scale[c // r] (+ zero[c // r] if any)  (mid-tread: what the self-index cache stores)
        m[c] = (q[c] + 1/2) x scale[c // r]                  (midrise: `CompressedKV.midrise`; no writer uses it)

    sign_bits int32 [..., ceil(d/32)] (`pack_sign_bits`: channel c in bit c % 32 of word c // 32); k_mag uint8
    [..., d*bits/8] (`pack_bits`: 2/4 bits: element i in bits (i % per_byte) x bits of byte i // per_byte; 3 bits: the
    low 2 bits of every element as a 2-bit plane of d/4 bytes, then the high bits as a 1-bit plane of d/8 bytes);
    k_scale fp16 [..., d/r]: r = k_group channels per scale ("token" axis) or r = 1 ("channel" axis: the token's
    block row, one scale per channel); mu, alpha float [..., d] (broadcastable: per kv-head). Returns [..., d].
    """
    d = mu.shape[-1]
    ch = torch.arange(d, device=sign_bits.device)
    sign = ((sign_bits[..., ch // 32] >> (ch % 32).to(torch.int32)) & 1).to(dtype) * 2 - 1
    q = unpack_bits(k_mag, bits).to(dtype)
    if midrise:
        q = q + 0.5
    rep = d // k_scale.shape[-1]
    mag = q * k_scale.to(dtype).repeat_interleave(rep, -1)
    if k_zero is not None:
        mag = mag + k_zero.to(dtype).repeat_interleave(rep, -1)
    return sign * mag * alpha.to(dtype)
