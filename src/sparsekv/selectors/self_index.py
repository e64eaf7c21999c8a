"""Self-Indexing KV cache: the compressed keys are their own retrieval index.

Per layer and kv-head, at the prefill:

* by default (`k_rotate`) keys are rotated first, K R with the layer's fixed orthogonal R (random +-1 signs x the
  normalised Hadamard matrix, the same R as V's below), and every query is rotated by R before scoring and
  attention: q . k is unchanged, but everything below sees keys whose energy is spread over all channels rather
  than piled in a few RoPE channels (the LUT alone then keeps 86% of the attention mass instead of 66%; decode
  perplexity at 10% 1.028x dense instead of 1.046x over 9 windows x 3 seeds, with `v_clip`);
* keys are centred per channel (mu = mean over the prompt) so that every sign bit carries ~1 bit of entropy;
* each key is split into groups of 4 channels; the sign pattern of a group is a 4-bit code (first channel of the
  group = most significant bit, +1 -> 1, -1/0 -> 0);
* the codebook is built in one pass: per group, the 16 centroids are the means of the centred prompt keys having
  that sign pattern (an empty pattern falls back to the pattern's signs times the group's mean magnitudes);
* scoring a query is a table lookup: table[g, c] = q_g . centroid[g, c], score(key) = sum_g table[g, code_g(key)];
  the top-k of these scores (GQA "group": the group's queries are summed first, which is exact by linearity) is
  the selection, with the method's sink tokens always in front;
* second stage (`rescore`, default 3; 0 = the paper's LUT-only top-k): the LUT's best 3 x budget tokens of a row
  are re-ranked by q . K as that row's query reads K in attention (`read_keys`: compressed tokens dequantized,
  sinks and the query's residual block from their 16-bit copies) and the best `budget` kept. Measured on SmolLM2
  (2K window, 10%): the LUT alone keeps 65% of the exact attention mass (81% with token 0 forced), the re-ranked
  selection 87-89%, the oracle 93%; the LUT's centroids cannot tell an outlier key from an ordinary one with the
  same sign pattern, and those outliers carry the attention;
* storage: the sign bits are the index *and* the sign of the stored key (1 bit per element). The magnitudes
  |K - mu| / alpha (alpha = per-channel abs max over the prompt) are quantized to `k_bits` (3 by default, the
  paper uses 2) bits, scale only (levels q x scale, q = 0..2^k_bits - 1, zero fixed at 0: magnitudes are >= 0).
  By default (`k_axis="auto"` -> "channel", KIVI-style) one float16 scale per channel per block of `k_group`
  (32) tokens, so an outlier channel no longer coarsens the other channels of its token (`k_axis="token"`: one
  scale per 32 channels of one token, the layout before). The values V are quantized token-wise to `kv_bits` (2)
  bits with a float16 scale and zero per 64 elements (the paper: 32), the range of each group clipped to the
  least squared error (`v_clip`). Same bytes per token as the paper's layout.
  By default (`v_rotate`) V is stored rotated, V R with a fixed orthogonal R per layer (random +-1 signs x the
  normalised Hadamard matrix), so that one outlier channel no longer sets the 2-bit range of its whole group; the
  16-bit copies (sinks, residual block) are rotated too, and `attend` un-rotates the attention output (exact:
  softmax . (V R) = (softmax . V) R). Offline, this halves the attention-output error of 2-bit V (0.218 -> 0.116).
  `dequantize_keys` / `dequantize` are the formulas of the gathered K / V rows. Nothing else of a compressed
  token is kept; attention gathers the selected tokens and dequantizes only those.
* `sink_tokens` (32; the paper: 64) tokens per kv-head are chosen SnapKV-style at the prefill (attention of the
  last 32 prompt queries, summed over the group, avg-pooled with kernel 5) and kept at 16-bit precision; the
  selection includes them first (inside the budget, ranked by their SnapKV weight), at most `sink_share` (1/4) of
  a query's budget.

Decode tokens (decision): every new token's sign bits (its code) and V are compressed as soon as it is stored,
with the prompt's mu/alpha and codebook (codebooks are not updated, so nothing depends on future tokens). The
tokens of the current *residual block* stay readable at 16-bit: blocks of `residual` tokens are counted from the
first decode position, and a query at position p reads the tokens of its own block (positions block_start(p)..p)
at 16-bit and every older token compressed. That is exactly what token-by-token decoding does when a block's
16-bit copy is dropped once the block is full, so chunked decoding gives the same result; at rest the 16-bit copy
holds < `residual` tokens. With `k_axis="channel"` a token's |K| codes need its whole K block, so K is compressed
a block at a time when the block fills: the prompt's blocks end at the prompt's end (the first block may be
short; token t's scale row is (t + pad) // k_group, pad = (-prompt_len) mod k_group), decode blocks are every
k_group tokens from the first decode position, and `residual` must be a multiple of k_group, so a block is always
full (and compressed, from the tokens' 16-bit copies) before any query reads it compressed. Block scales leave out
padding and the 16-bit sinks.

`kv_bits=16` keeps K/V in the input precision and uses only the 1-bit index (the paper's "16,16,1" row); it then
reproduces dense attention when the budget covers the context.

Memory: `SelfIndexSelector.memory_breakdown()` and `cache_memory(cache)` measure the bytes of the tensors actually
held (buffer capacity included), and `sparsekv cache-memory` prints them per token against a bf16 dense cache.

GQA "group" scoring goes through `kernels.lut_score` (Triton on CUDA); `lut_scores` below is the torch reference
used for gqa="head" and float64. On CUDA the re-rank and the dequantizing attention run on the kernels
(`_self_index_device`, `kernels.compressed_kv`) over the stored bytes; the torch code here is their reference.
`kernels.bits.pack_sign_bits` packs the sign bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from sparsekv.cache import cache_memory, tensor_nbytes
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.kernels.bits import pack_sign_bits
from sparsekv.kernels.lut_score import lut_scores as kernel_lut_scores
from sparsekv.kernels.sparse_attention import sparse_attention
from sparsekv.selectors import _self_index_device
from sparsekv.selectors.base import DecodeStep, Selection, TokenSelector, _force, to_selection_heads

if TYPE_CHECKING:  # CLI option types (resolved at runtime by `register`)
    from sparsekv.cli import DenseLayersOpt, DeviceOpt, DtypeOpt, ModelOpt, OptionOpt, OutputOpt

GROUP_DIMS = 4  # channels per sign-pattern group (16 centroids per group)
QUANT_GROUP = 32  # elements per (scale, zero) pair
SNAP_WINDOW = 32  # prompt queries that vote for the sink tokens
SNAP_KERNEL = 5  # avg-pooling width of the SnapKV votes
KV_BITS = (2, 4, 16)
FP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "input": None}
_SINK_BASE = 1.0e7  # sink scores: _SINK_BASE + (sinks - rank), exact in float32 and above any LUT score
_SENTINEL = 2**31 - 1  # sink position of an unused sink slot (sorts last, never matches a key)

# 4-bit value with channel i of the group in bit i  ->  code with channel 0 as the most significant bit
_BITREV4 = torch.tensor([int(f"{i:04b}"[::-1], 2) for i in range(16)], dtype=torch.uint8)
# sign of each channel of a code's pattern: [16, 4], +1 where the bit is set
_PATTERN_SIGNS = torch.tensor([[1.0 if (c >> (3 - i)) & 1 else -1.0 for i in range(4)] for c in range(16)])


# ----------------------------------------------------------------------------------------------------------------
# sign codes, codebook, LUT scores
# ----------------------------------------------------------------------------------------------------------------


def sign_codes(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] (d % 4 == 0) -> uint8 [..., d/4]: Code = sum_i [x_i > 0] * 2^(3-i) per group of 4 channels."""
    bits = (x > 0).to(torch.uint8).unflatten(-1, (-1, GROUP_DIMS))
    # built on the device (no host-to-device copy: decode steps must be capturable in a CUDA graph)
    weights = (1 << torch.arange(GROUP_DIMS - 1, -1, -1, device=x.device)).to(torch.uint8)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def codes_from_sign_bits(words: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int32 [..., W] packed by `pack_sign_bits` -> uint8 [..., head_dim/4] codes (same as `sign_codes`)."""
    groups = head_dim // GROUP_DIMS
    g = torch.arange(groups, device=words.device)
    word = words[..., g // 8]
    nibble = (word >> (4 * (g % 8)).to(torch.int32)) & 0xF
    return _bitrev4(words.device)[nibble.long()]


_BITREV4_ON: dict[torch.device, torch.Tensor] = {}


def _bitrev4(device: torch.device) -> torch.Tensor:
    """_BITREV4 on `device`, copied once (a host-to-device copy per step would also break CUDA graph capture)."""
    if device not in _BITREV4_ON:
        _BITREV4_ON[device] = _BITREV4.to(device)
    return _BITREV4_ON[device]


def one_pass_centroids(
    centred: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Codebook [B, H, G, 16, 4]: mean of the (centred) key groups having each sign pattern.

    centred [B, H, N, d], codes [B, H, N, G], mask [B, N] bool (padding = False) or None. A pattern no key has
    gets its signs times the group's mean absolute values (where a key with that pattern would most likely sit).
    """
    b, h, n, d = centred.shape
    groups = d // GROUP_DIMS
    x = centred.unflatten(-1, (groups, GROUP_DIMS)).permute(0, 1, 3, 2, 4)  # [B, H, G, N, 4]
    weight = torch.ones(b, 1, 1, n, 1, dtype=x.dtype, device=x.device)
    if mask is not None:
        weight = mask.to(x.dtype).view(b, 1, 1, n, 1)
    index = codes.long().permute(0, 1, 3, 2)[..., None]  # [B, H, G, N, 1]
    sums = torch.zeros(b, h, groups, 16, GROUP_DIMS, dtype=x.dtype, device=x.device)
    sums.scatter_add_(3, index.expand(-1, -1, -1, -1, GROUP_DIMS), x * weight)
    counts = torch.zeros(b, h, groups, 16, 1, dtype=x.dtype, device=x.device)
    counts.scatter_add_(3, index, weight.expand(-1, h, groups, -1, -1).contiguous())
    total = weight.sum(3, keepdim=True).clamp(min=1)  # [B, 1, 1, 1, 1]
    fallback = (x.abs() * weight).sum(3, keepdim=True) / total * _PATTERN_SIGNS.to(x)  # [B, H, G, 16, 4]
    return torch.where(counts > 0, sums / counts.clamp(min=1), fallback)


def lut_scores(
    query: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor, max_elements: int = 1 << 25
) -> torch.Tensor:
    """Compressed-domain q.k: query [B, S, Q, d] (S a multiple of the kv heads), centroids [B, Hkv, G, 16, 4],
    codes [B, Hkv, N, G] -> [B, S, Q, N] = sum_g (q_g . centroid[g, code_g]) in the centroids' dtype.

    Reference implementation (table then gather + sum over groups, in a fixed order, so a query's scores do not
    depend on how many queries are scored together).
    """
    b, s, q, _ = query.shape
    hkv, n, groups = codes.shape[1], codes.shape[2], codes.shape[3]
    rep = s // hkv
    cents = centroids.repeat_interleave(rep, dim=1) if rep > 1 else centroids
    table = torch.einsum(
        "bsqgi,bsgci->bsqgc", query.to(centroids.dtype).unflatten(-1, (groups, GROUP_DIMS)), cents
    )
    table = table.flatten(-2)  # [B, S, Q, G*16]
    offsets = torch.arange(groups, device=codes.device) * 16
    flat = (codes.long() + offsets).flatten(-2)  # [B, Hkv, N*G]
    if rep > 1:
        flat = flat.repeat_interleave(rep, dim=1)
    out = torch.empty(b, s, q, n, dtype=table.dtype, device=table.device)
    step = max(1, max_elements // max(1, b * s * n * groups))
    for lo in range(0, q, step):
        hi = min(q, lo + step)
        picked = table[:, :, lo:hi].gather(-1, flat[:, :, None].expand(-1, -1, hi - lo, -1))
        out[:, :, lo:hi] = picked.view(b, s, hi - lo, n, groups).sum(-1)
    return out


# ----------------------------------------------------------------------------------------------------------------
# value rotation (v_rotate)
# ----------------------------------------------------------------------------------------------------------------

V_ROTATE_SEED = 0x5E1F  # layer l's random signs come from torch.Generator().manual_seed(V_ROTATE_SEED + l)

_ROTATION_BASE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def rotation_base(
    d: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[d, d] orthogonal matrix shared by every layer: the Sylvester Hadamard matrix / sqrt(d) when d is a power of
    two, else the Q factor (columns sign-fixed by R's diagonal) of the QR of a Gaussian seeded with V_ROTATE_SEED.
    Built in float64, cached per (d, dtype, device): a constant of the code (like _BITREV4), not per-cache state."""
    device = torch.device(device)
    key = (d, dtype, device)
    if key not in _ROTATION_BASE:
        if d & (d - 1) == 0:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < d:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            base = h / math.sqrt(d)
        else:
            gen = torch.Generator().manual_seed(V_ROTATE_SEED)
            q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
            base = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
        _ROTATION_BASE[key] = base.to(dtype=dtype, device=device)
    return _ROTATION_BASE[key]


def rotation_signs(
    d: int, layer_idx: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[d] fixed +-1 of layer `layer_idx` (seed V_ROTATE_SEED + layer_idx)."""
    gen = torch.Generator().manual_seed(V_ROTATE_SEED + layer_idx)
    signs = torch.randint(0, 2, (d,), generator=gen).to(torch.float64) * 2 - 1
    return signs.to(dtype=dtype, device=device)


def value_rotation(
    d: int, layer_idx: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """R = diag(signs) x base [d, d] (orthogonal): the cache stores V' = V R; attention over V' gives out' = out R,
    and out = out' R^T."""
    return rotation_signs(d, layer_idx, dtype, device)[:, None] * rotation_base(d, dtype, device)


# ----------------------------------------------------------------------------------------------------------------
# token-wise low-bit quantization
# ----------------------------------------------------------------------------------------------------------------


def quant_group_size(head_dim: int, preferred: int = QUANT_GROUP) -> int:
    """`preferred` elements per (scale, zero) pair, or the largest of 32/16/8/4 dividing head_dim below it."""
    for size in (preferred, 32, 16, 8, 4):
        if size <= preferred and head_dim % size == 0:
            return size
    raise ConfigError(f"self-index needs a head_dim divisible by 4, got {head_dim}")


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


#: range ratios tried per group by `quantize(clip=True)` (the V rows; least squared error): 1, 0.95, ..., 0.6
V_CLIP_RATIOS = tuple(1 - 0.05 * i for i in range(9))
#: groups quantized at once: bounds the [groups, ratios, group] temporaries of a long prefill
_QUANT_CHUNK = 1 << 18


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
    g = x.unflatten(-1, (-1, group))
    rows = g.reshape(-1, group)
    ratios = len(V_CLIP_RATIOS) if clip and with_zero else 1
    parts = [_quantize_rows(part, bits, with_zero, ratios) for part in rows.split(_QUANT_CHUNK)]
    q, scale, zero = (torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts))
    q, scale, zero = q.view(g.shape), scale.view(g.shape[:-1]), zero.view(g.shape[:-1])
    return pack_bits(q.flatten(-2), bits), scale, zero if with_zero else None


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


#: clip ratios tried per group by `magnitude_codes(clip=True)` (scale = ratio x max / 2^bits, least squared error)
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def magnitude_codes(
    g: torch.Tensor, bits: int, midrise: bool, clip: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale-only quantization of magnitudes g >= 0 along the last axis (one group): -> (codes uint8 [..., n] in
    [0, 2^bits), scale fp16 [...]).

    midrise: level q reads (q + 1/2) x scale with scale = max / 2^bits, q = min(floor(x / scale), 2^bits - 1)
    (level 0 is not 0: the sign is stored apart, so an exact 0 is not needed); |x - read| <= scale / 2.
    Otherwise (mid-tread): level q reads q x scale, scale = max / (2^bits - 1), q = round(x / scale).
    The fp16 scale is rounded up where needed so that the levels still cover the group's max.
    clip: the scale is the one of CLIP_RATIOS x max with the least squared error of the group (values above the
    top level are clamped to it); the read formula does not change.
    """
    levels = 1 << bits if midrise else (1 << bits) - 1
    hi = g.amax(-1)
    best_q = best_scale = best_err = None
    for ratio in CLIP_RATIOS if clip else (1.0,):
        top = hi * ratio
        scale = (top / levels).to(torch.float16)
        scale = torch.where(
            scale.to(g.dtype) * levels < top,
            torch.nextafter(scale, torch.full_like(scale, math.inf)),  # full_like: no host copy (graph capture)
            scale,
        )
        s = scale.to(g.dtype)
        safe = torch.where(scale > 0, s, torch.ones_like(s))[..., None]
        if midrise:
            q = torch.floor(g / safe).clamp(0, levels - 1)
            read = (q + 0.5) * s[..., None]
        else:
            q = torch.round(g / safe).clamp(0, levels)
            read = q * s[..., None]
        if best_q is None:
            best_q, best_scale = q, scale
            if clip:
                best_err = (read - g).square().sum(-1)
            continue
        err = (read - g).square().sum(-1)
        better = err < best_err
        best_q = torch.where(better[..., None], q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    return best_q.to(torch.uint8), best_scale


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
        m[c] = (q[c] + 1/2) x scale[c // r]                  (midrise)
        m[c] = q[c] x scale[c // r] (+ zero[c // r] if any)  (mid-tread; the paper's layout has zeros)

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


# ----------------------------------------------------------------------------------------------------------------
# SnapKV-style sink choice
# ----------------------------------------------------------------------------------------------------------------


def snap_sinks(
    keys: torch.Tensor, query: torch.Tensor, count: int, scaling: float, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` prompt tokens per kv-head most attended by the last SNAP_WINDOW real prompt queries (softmax
    weights summed over the window and the group's heads, avg-pooled over SNAP_KERNEL neighbours).

    Returns (positions [B, Hkv, count] int64 sorted ascending, unused slots = a sentinel; rank [B, Hkv, count]
    int64, 0 = most attended, in the same order).
    """
    b, hkv, n, _ = keys.shape
    hq = query.shape[1]
    mask = torch.ones(b, n, dtype=torch.bool, device=keys.device) if key_mask is None else key_mask.bool()
    real = mask.sum(-1)  # left padding: the real tokens are the last `real` ones
    window = min(SNAP_WINDOW, n)
    pos = torch.arange(n - window, n, device=keys.device)
    q = query[:, :, query.shape[2] - window :].float()  # the prompt's last queries (only those may be given)
    k = keys.float().repeat_interleave(hq // hkv, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hq, W, N]
    allowed = (torch.arange(n, device=keys.device)[None, :] <= pos[:, None])[None] & mask[:, None, :]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    in_window = (pos[None, :] >= n - torch.clamp(real, max=SNAP_WINDOW)[:, None]) & mask[:, n - window :]
    weights = weights * in_window[:, None, :, None]
    votes = weights.sum(2).view(b, hkv, hq // hkv, n).sum(2)  # [B, Hkv, N]
    votes = F.avg_pool1d(votes, SNAP_KERNEL, stride=1, padding=SNAP_KERNEL // 2, count_include_pad=True)
    votes = votes.masked_fill(~mask[:, None], float("-inf"))
    k_top = min(count, n)
    top = votes.sort(dim=-1, descending=True, stable=True)
    chosen, chosen_votes = top.indices[..., :k_top], top.values[..., :k_top]
    used = chosen_votes > float("-inf")
    rank = torch.arange(k_top, device=keys.device).expand_as(chosen)
    positions = torch.where(used, chosen, torch.full_like(chosen, _SENTINEL))
    positions, order = positions.sort(dim=-1)
    return positions, rank.gather(-1, order)


# ----------------------------------------------------------------------------------------------------------------
# growable storage with measured bytes
# ----------------------------------------------------------------------------------------------------------------


class _Buffers:
    """Named [B, H, capacity, c] tensors grown together along dim 2 by a fixed step (64 tokens: the slack stays
    small next to 4K+ tokens and appending stays cheap)."""

    def __init__(self, reserve: int = 0, step: int = 64) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.length = 0
        self.reserve, self.step = reserve, step

    def append(self, **new: torch.Tensor) -> None:
        count = next(iter(new.values())).shape[2]
        needed = self.length + count
        for name, value in new.items():
            buf = self.tensors.get(name)
            if buf is None or buf.shape[2] < needed:
                capacity = max(needed, self.reserve) if buf is None else needed + self.step
                grown = value.new_empty(*value.shape[:2], capacity, *value.shape[3:])
                if buf is not None:
                    grown[:, :, : self.length] = buf[:, :, : self.length]
                self.tensors[name] = grown
            self.tensors[name][:, :, self.length : needed] = value
        self.length = needed

    def view(self, name: str) -> torch.Tensor:
        return self.tensors[name][:, :, : self.length]

    def nbytes(self) -> dict[str, int]:
        return {name: t.numel() * t.element_size() for name, t in self.tensors.items()}


# ----------------------------------------------------------------------------------------------------------------
# the selector
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class SelfIndexSelector(TokenSelector):
    """Self-Indexing KV cache (1-bit sign VQ index + token-wise low-bit K/V). Options:

    kv_bits: 2 (default) or 4 = compressed V (and K magnitudes, see k_bits); 16 = full-precision K/V, only the
        1-bit index (the paper's "16,16,1").
    sink_tokens: prompt tokens per kv-head kept at 16-bit and selected first, inside the budget (SnapKV-style
        choice; 0 = none; the paper: 64). 32 by default: their bytes pay for a 64-token residual block, which
        measured better at 4K (ppl 27.10 vs 27.57 with 64 sinks and a 32-token block).
    sink_share: at most this share of a query's budget goes to forced sinks (best SnapKV rank first; 1 = all,
        the paper). 64 sinks would otherwise take most of a 10% budget below ~2K tokens.
    residual: decode tokens of the current block read at 16-bit (block size, 64; 0 = read every token compressed).
    fp_dtype: storage of the 16-bit parts of a compressed cache ("bfloat16", "float16" or "input").
    rescore: candidates per budget token that the LUT passes to a second stage ranking them by q.K as attention
        reads K (sign bits x dequantized |K|, 16-bit sinks and residual block); 0 = the paper's LUT-only top-k.
    k_bits: bits of the |K| magnitudes (2, 3, 4; 0 = auto: 3 when kv_bits=2, else kv_bits).
    k_axis: "channel": one fp16 |K| scale per channel per block of k_group tokens (KIVI-style; K is compressed
        when its block fills, so `residual` must be a positive multiple of k_group); "token": one fp16 scale (and
        zero with k_zero) per k_group channels of one token (the paper's axis); "auto" (default): "channel" when
        residual is a positive multiple of k_group and k_zero is false (the defaults), else "token". The
        selector's `k_axis` attribute holds the resolved axis.
    k_group: tokens per scale row (k_axis="channel", 32) or channels per scale (k_axis="token").
    v_group: elements (channels of one token) per fp16 scale and zero of V (64).
    k_zero: store a zero point for the K magnitudes too (k_axis="token" only; the paper's layout).
    k_midrise: read |K| level q as (q + 1/2) x scale with scale = max / 2^k_bits instead of q x scale with
        scale = max / (2^k_bits - 1) (no exact zero; measured worse: magnitudes are concentrated near 0).
    k_clip: |K| scale per group chosen among CLIP_RATIOS x max by least squared error (measured worse: it clips
        the outliers that carry the attention).
    v_clip: V range per group shrunk to the least squared error among V_CLIP_RATIOS (same format). On by default
        since it was measured with k_rotate over nine 4K windows x three rotation seeds (alone it had been judged
        on one window, where it does not help).
    v_rotate: store V' = V R with a fixed orthogonal R per layer (`value_rotation`: +-1 signs seeded by the layer
        index times the normalised Hadamard matrix; a seeded QR rotation when head_dim is not a power of two), so
        that an outlier channel no longer sets the 2-bit range of its whole group. Every stored V row is in the
        rotated domain (quantized rows, 16-bit sinks and residual block, and kv_bits=16's full V); `attend`
        un-rotates the attention output (out = out' R^T, exact since softmax . (V R) = (softmax . V) R), on both the
        torch and the kernel path. No bytes: the layer holds its d signs (counted), the base matrix is a shared
        constant regenerated from head_dim. `gather_dequantized` returns V in the stored (rotated) domain.
    k_rotate: store keys as K R (the same R as V's) and rotate each query by R before scoring and attention: q . k
        and so attention are unchanged, but the sign index, mu / alpha and the |K| scales all see rotated keys,
        whose energy is spread over the channels. Measured better both for the index (kv_bits=16) and for the
        compressed cache (results/self_index.md). Every stored K row (sign bits, |K| codes, sinks, residual
        block, kv_bits=16's full K) is in the rotated domain; `read_keys` / `gather_dequantized` return it so.

    The paper's configuration is rescore=0, sink_share=1, k_bits=2, k_axis="token", k_group=32, v_group=32,
    k_zero=true, v_clip=false, v_rotate=false, k_rotate=false; the defaults keep the same bytes per token (24.8% of
    bf16 at 4K) and were chosen by decode-faithful perplexity (results/self_index.md).
    """

    name = "self-index"
    stores_kv = True
    #: a 2-bit cache cannot reproduce dense logits tightly (kv_bits=16 can)
    lossy: ClassVar[bool] = True

    kv_bits: int = 2
    sink_tokens: int = 32
    residual: int = 64
    fp_dtype: str = "bfloat16"
    rescore: int = 3
    k_bits: int = 0
    k_group: int = 32
    v_group: int = 64
    k_zero: bool = False
    sink_share: float = 0.25
    k_axis: str = "auto"
    k_midrise: bool = False
    k_clip: bool = False
    v_clip: bool = True
    v_rotate: bool = True
    k_rotate: bool = True

    @classmethod
    def check_config(cls, config: SparseConfig) -> None:
        options = config.options
        bits = options.get("kv_bits", 2)
        if isinstance(bits, bool) or bits not in KV_BITS:
            raise ConfigError(f"self-index kv_bits must be one of {KV_BITS}, got {bits!r}")
        k_bits = options.get("k_bits", 0)
        if isinstance(k_bits, bool) or k_bits not in (0, 2, 3, 4):
            raise ConfigError(f"self-index k_bits must be 0 (= kv_bits), 2, 3 or 4, got {k_bits!r}")
        for name in ("k_group", "v_group"):
            value = options.get(name, QUANT_GROUP)
            if isinstance(value, bool) or value not in (4, 8, 16, 32, 64, 128):
                raise ConfigError(f"self-index {name} must be one of 4, 8, 16, 32, 64, 128, got {value!r}")
        share = options.get("sink_share", 0.25)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"self-index sink_share must be a number in (0, 1], got {share!r}")
        for name in ("k_zero", "k_midrise", "k_clip", "v_clip", "v_rotate", "k_rotate"):
            if not isinstance(options.get(name, False), bool):
                raise ConfigError(f"self-index {name} must be true or false, got {options[name]!r}")
        if options.get("k_zero", False) and (options.get("k_midrise", False) or options.get("k_clip", False)):
            raise ConfigError("self-index k_midrise / k_clip apply to scale-only magnitudes: set k_zero=false")
        axis = options.get("k_axis", "auto")
        if axis not in ("auto", "token", "channel"):
            raise ConfigError(f"self-index k_axis must be 'auto', 'token' or 'channel', got {axis!r}")
        if axis == "channel":
            if options.get("k_zero", False):
                raise ConfigError("self-index k_axis=channel stores no zero points: set k_zero=false")
            group, residual = options.get("k_group", QUANT_GROUP), options.get("residual", 64)
            if isinstance(residual, int) and not isinstance(residual, bool) and (
                residual <= 0 or residual % group
            ):
                raise ConfigError(
                    "self-index k_axis=channel compresses K a block of k_group tokens at a time once the block is "
                    f"full, so residual must be a positive multiple of k_group; got residual={residual}, "
                    f"k_group={group}"
                )
        for name in ("sink_tokens", "residual", "rescore"):
            value = options.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"self-index {name} must be an int >= 0, got {value!r}")
        if options.get("fp_dtype", "bfloat16") not in FP_DTYPES:
            raise ConfigError(f"self-index fp_dtype must be one of {', '.join(FP_DTYPES)}")
        if config.top_p is not None:
            raise ConfigError(
                "self-index keeps its own compressed K/V, which the top-p pruner cannot read; leave top_p unset"
            )

    def __post_init__(self) -> None:
        d = self.layer.head_dim
        if d % GROUP_DIMS:
            raise ConfigError(f"self-index needs a head_dim divisible by {GROUP_DIMS}, got {d}")
        if self.k_axis == "auto":  # channel wherever it can be (scale-only |K|, full blocks read compressed)
            fits = self.residual > 0 and self.residual % self.k_group == 0
            self.k_axis = "channel" if fits and not self.k_zero else "token"
        if self.k_axis == "token":
            self.k_group = quant_group_size(d, self.k_group)
        self.v_group = quant_group_size(d, self.v_group)
        if (
            self.k_bits == 0
        ):  # auto: the 2-bit cache spends the bytes saved on V's and K's zeros on a 3rd K bit
            self.k_bits = 3 if self.kv_bits == 2 else self.kv_bits
        if self.compressed and self.k_bits == 3 and d % 8:
            raise ConfigError(f"self-index k_bits=3 needs a head_dim divisible by 8, got {d}")
        self._prefilled = False
        self._store = _Buffers()  # sign bits (+ quantized K/V, or full K/V when kv_bits=16)
        self._tail = _Buffers(
            reserve=self.residual, step=self.residual
        )  # 16-bit copy of the current block(s)
        self._tail_start = 0
        self.decode_start = 0
        # k_axis="channel": one fp16 scale row [d] per block of k_group tokens; blocks end at the prompt's end and
        # then every k_group decode tokens, so token t is in block row (t + _k_pad) // k_group
        self._k_blocks = _Buffers(step=8)
        self._k_pad = 0
        self._k_done = 0  # tokens [0, _k_done) have their compressed |K|; later ones are read from the tail
        self.mu = self.alpha = self.centroids = None
        self.sink_positions = self.sink_rank = self.sink_keys = self.sink_values = None
        # R = diag(signs) x _rot_base, set at the prefill: v_signs with v_rotate, k_signs with k_rotate (one tensor)
        self.v_signs = self.k_signs = self._rot_base = None
        self._rotated_for: tuple[torch.Tensor, torch.Tensor] | None = None  # (query, query R) of the last step

    # --- storage hook -------------------------------------------------------------------------------------------

    @property
    def compressed(self) -> bool:
        return self.kv_bits < 16

    def _work_dtype(self, like: torch.Tensor) -> torch.dtype:
        return torch.float64 if like.dtype == torch.float64 else torch.float32

    def _fp_dtype(self, like: torch.Tensor) -> torch.dtype:
        return FP_DTYPES[self.fp_dtype] or like.dtype

    def _rotate_values(self, values: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """V [..., d] -> V R in `work` (V itself without v_rotate)."""
        v = values.to(work)
        if self.v_signs is None:
            return v
        return torch.matmul(v * self.v_signs.to(work), self._rot_base.to(work))

    def unrotate_values(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] in the stored V domain (an attention output, or rows of `gather_dequantized`) -> x R^T, in the
        input's dtype, computed in the cache's work dtype (x itself without v_rotate)."""
        if self.v_signs is None:
            return x
        work = self.v_signs.dtype
        return (torch.matmul(x.to(work), self._rot_base.T) * self.v_signs).to(x.dtype)

    def _rotate_keys(self, x: torch.Tensor) -> torch.Tensor:
        """k_rotate: keys or queries [..., d] -> x R in their dtype (computed in the work dtype); x itself without.
        q . k is unchanged, so attention is too; what changes is what the sign index and the |K| scales see."""
        if self.k_signs is None:
            return x
        work = self.k_signs.dtype
        return torch.matmul(x.to(work) * self.k_signs, self._rot_base).to(x.dtype)

    def _rotated_query(self, step: DecodeStep) -> DecodeStep:
        """The step with its query rotated (k_rotate), once per step: select and attend see the same query."""
        if self.k_signs is None:
            return step
        if self._rotated_for is None or self._rotated_for[0] is not step.query:
            self._rotated_for = (step.query, self._rotate_keys(step.query))
        return step.replace(query=self._rotated_for[1])

    def store(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._prefilled:
            return key_states, value_states  # the dense prefill needs them; prefill() compresses
        self._append(self._rotate_keys(key_states), value_states)
        stand_in = self._stand_in(key_states)
        return stand_in, stand_in

    def _stand_in(self, like: torch.Tensor) -> torch.Tensor:
        """What the cache layer holds as its keys / values once this selector keeps the tokens: [B, Hkv, N, 1] with
        N the cached length, one element expanded (no memory per token; `attend` reads the selector's storage).
        Not empty, so that code reading the length off the keys (transformers' layers do) sees N, not 0."""
        b, h = like.shape[:2]
        return like.new_zeros(1, 1, 1, 1).expand(b, h, self._store.length, 1)

    def prompt_query_window(self) -> int | None:
        return SNAP_WINDOW if self.sink_tokens > 0 else 0  # the sinks are the tokens these queries attend most

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        """Builds mu/alpha/codebook/sinks from the prompt and compresses it. `key_mask` [B, N] (False = padding)
        keeps left padding out of the statistics; without it every prompt position counts."""
        work = self._work_dtype(keys)
        b, _, n, d = keys.shape
        if self.v_rotate or self.k_rotate:  # built here, outside any CUDA graph capture of the decode steps
            signs = rotation_signs(d, self.layer.layer_idx, work, keys.device)
            self._rot_base = rotation_base(d, work, keys.device)
            self.v_signs = signs if self.v_rotate else None
            self.k_signs = signs if self.k_rotate else None
        sink_query, sink_keys = query, keys  # (q . k is rotation invariant: the sinks are chosen unrotated)
        keys = self._rotate_keys(keys)
        k = keys.to(work)
        weight = torch.ones(b, n, dtype=work, device=k.device) if key_mask is None else key_mask.to(work)
        wsum = weight.sum(-1).clamp(min=1)[:, None, None, None]
        self.mu = (k * weight[:, None, :, None]).sum(2, keepdim=True) / wsum  # [B, H, 1, d]
        centred = k - self.mu
        masked_abs = centred.abs() * weight[:, None, :, None]
        self.alpha = masked_abs.amax(2, keepdim=True).clamp(min=torch.finfo(work).tiny ** 0.5)
        codes = sign_codes(centred)
        centroids = one_pass_centroids(centred, codes, None if key_mask is None else key_mask.bool())
        # stored at 16-bit (float64 runs keep float64 so that tests compare exactly)
        self.centroids = centroids if work == torch.float64 else centroids.to(torch.float16)
        if self.sink_tokens > 0:
            positions, rank = snap_sinks(sink_keys, sink_query, self.sink_tokens, self.layer.scaling, key_mask)
            self.sink_positions, self.sink_rank = positions.to(torch.int32), rank.to(torch.int16)
            if self.compressed:
                idx = positions.clamp(max=n - 1)[..., None].expand(-1, -1, -1, d)
                fp = self._fp_dtype(keys)
                self.sink_keys = keys.gather(2, idx).to(fp)
                self.sink_values = self._rotate_values(values.gather(2, idx), work).to(fp)
        self._prefilled = True
        exclude = None  # tokens left out of the channel-axis block scales: padding, and sinks (read at 16-bit)
        if self.compressed and self.k_axis == "channel":
            self._k_pad = (-n) % self.k_group
            exclude = torch.zeros(b, k.shape[1], n + 1, dtype=torch.bool, device=k.device)
            if self.sink_keys is not None:
                exclude.scatter_(-1, self.sink_positions.long().clamp(max=n), True)
            exclude = exclude[..., :n]
            if key_mask is not None:
                exclude = exclude | ~key_mask.bool()[:, None]
        self._append(keys, values, prompt=True, exclude=exclude)
        self.decode_start = n
        self._tail_start = n

    def _append(
        self, keys: torch.Tensor, values: torch.Tensor, prompt: bool = False, exclude: torch.Tensor | None = None
    ) -> None:
        work = self._work_dtype(keys)
        centred = keys.to(work) - self.mu
        rotated = self._rotate_values(values, work)  # V (v_rotate: V R) in the work dtype
        parts = {"sign_bits": pack_sign_bits(centred)}
        channel = self.compressed and self.k_axis == "channel"
        if self.compressed:
            if channel:  # filled in by _compress_k_blocks once the token's block is full
                b, h, t, d = keys.shape
                parts["k_mag"] = keys.new_zeros(b, h, t, d * self.k_bits // 8, dtype=torch.uint8)
            elif self.k_zero:  # the paper's layout: asymmetric, scale and zero per k_group channels
                mag, mag_scale, mag_zero = quantize(centred.abs() / self.alpha, self.k_bits, self.k_group)
                parts.update(k_mag=mag, k_scale=mag_scale, k_zero=mag_zero)
            else:
                groups = (centred.abs() / self.alpha).unflatten(-1, (-1, self.k_group))
                codes, mag_scale = magnitude_codes(groups, self.k_bits, self.k_midrise, self.k_clip)
                parts.update(k_mag=pack_bits(codes.flatten(-2), self.k_bits), k_scale=mag_scale)
            val, val_scale, val_zero = quantize(rotated, self.kv_bits, self.v_group, clip=self.v_clip)
            parts.update(v=val, v_scale=val_scale, v_zero=val_zero)
        else:
            parts.update(k_full=keys, v_full=values if self.v_signs is None else rotated.to(values.dtype))
        self._store.append(**parts)
        if channel and prompt:
            self._compress_k_blocks(centred, 0, exclude)
            self._k_done = self._store.length
        elif channel:
            # the blocks completed by these tokens, from the 16-bit copies (the tail holds every token from
            # _k_done on; new tokens are rounded to the tail's dtype first, so chunked == token-by-token)
            new = keys.to(self._fp_dtype(keys)).to(work) - self.mu
            held = self._k_done - self._tail_start
            if self._tail.length > held:
                new = torch.cat([self._tail.view("k")[:, :, held:].to(work) - self.mu, new], dim=2)
            count = new.shape[2] // self.k_group * self.k_group
            if count:
                self._compress_k_blocks(new[:, :, :count], self._k_done)
                self._k_done += count
        if prompt or not self.compressed or self.residual == 0:
            return
        # 16-bit copy of the decode tokens from the block of the first new token on (older blocks are full)
        first = self._store.length - keys.shape[2]
        block = self.decode_start + (first - self.decode_start) // self.residual * self.residual
        if block > self._tail_start:
            kept = self._tail.length - (block - self._tail_start)
            old = {name: self._tail.view(name)[:, :, -kept:] if kept > 0 else None for name in ("k", "v")}
            self._tail = _Buffers(reserve=self.residual, step=self.residual)
            if old["k"] is not None:
                self._tail.append(k=old["k"], v=old["v"])
            self._tail_start = block
        fp = self._fp_dtype(keys)
        self._tail.append(k=keys.to(fp), v=values.to(fp) if self.v_signs is None else rotated.to(fp))

    def _compress_k_blocks(self, centred: torch.Tensor, start: int, exclude: torch.Tensor | None = None) -> None:
        """k_axis="channel": |K - mu| / alpha of the tokens [start, start + T) (centred [B, H, T, d]; full blocks,
        except that the prompt's first block may be short) -> one fp16 scale per channel and block (scale rows
        appended to _k_blocks) and per-token codes (written into the store's k_mag rows). `exclude` [B, H, T]
        tokens (padding, 16-bit sinks) do not count towards their block's scales (their codes are never read)."""
        g = self.k_group
        x = centred.abs() / self.alpha
        if exclude is not None:
            x = x.masked_fill(exclude[..., None], 0)
        pad = (-x.shape[2]) % g  # only the prompt's first block can be short: pad it at the front
        if pad:
            x = F.pad(x, (0, 0, pad, 0))
        b, h, t, d = x.shape
        blocks = x.view(b, h, t // g, g, d).transpose(-1, -2)  # [B, H, NB, d, G]
        codes, scale = magnitude_codes(blocks, self.k_bits, self.k_midrise, self.k_clip)
        codes = codes.transpose(-1, -2).reshape(b, h, t, d)[:, :, pad:]
        self._store.tensors["k_mag"][:, :, start : start + t - pad] = pack_bits(codes, self.k_bits)
        self._k_blocks.append(k_scale=scale)

    # --- selection ----------------------------------------------------------------------------------------------

    def codes(self) -> torch.Tensor:
        """[B, Hkv, N, G] uint8 sign-pattern codes of every cached token (decoded from the stored sign bits)."""
        return codes_from_sign_bits(self._store.view("sign_bits"), self.layer.head_dim)

    def score(self, step: DecodeStep) -> torch.Tensor:
        layer = step.layer
        if step.gqa == "group" and step.query.dtype != torch.float64:
            # the kernels' op (group-summed, Triton on CUDA) indexes centroids by the raw nibble of the packed bits
            by_nibble = self.centroids.index_select(3, _bitrev4(self.centroids.device).long())
            scores = kernel_lut_scores(step.query, by_nibble, self._store.view("sign_bits"))
        else:
            work = torch.float64 if self.centroids.dtype == torch.float64 else torch.float32
            query = step.query.to(work)
            if step.gqa == "group" and layer.group_size > 1:
                b, _, q, d = query.shape
                query = query.view(b, layer.num_kv_heads, layer.group_size, q, d).sum(2)
            scores = lut_scores(query, self.centroids.to(work), self.codes())
        scores = scores.float()
        if self.sink_positions is not None:
            scores = self._boost_sinks(scores, step.budgets)
        return scores

    def _boost_sinks(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """Puts the sinks first, best SnapKV rank first; a row forces at most sink_share x its budget of them (the
        others keep their LUT score), so short contexts keep room for the query's own top-k."""
        heads = scores.shape[1]
        rep = heads // self.sink_positions.shape[1]
        positions = self.sink_positions.long().repeat_interleave(rep, dim=1)
        rank = self.sink_rank.long().repeat_interleave(rep, dim=1)
        cap = torch.floor(budgets.to(torch.float64) * self.sink_share).long()  # [B, Q]
        used = (positions < _SENTINEL)[:, :, None] & (
            rank[:, :, None] < cap[:, None, :, None]
        )  # [B, S, Q, K]
        boost = (_SINK_BASE + (positions.shape[-1] - rank)).to(scores.dtype)
        index = positions.clamp(max=scores.shape[-1] - 1)[:, :, None].expand(-1, -1, scores.shape[2], -1)
        current = scores.gather(-1, index)
        # in place: the scores are this step's own tensor (a copy of [B, H, Q, N] costs more than the LUT)
        return scores.scatter_(-1, index, torch.where(used, boost[:, :, None].expand_as(current), current))

    def select(self, step: DecodeStep) -> Selection:
        """Top-budget by LUT score with sinks first; a stable sort breaks ties by position, so a row's selection
        does not depend on the other rows or on the row length (chunked == token-by-token)."""
        step = self._rotated_query(step)
        scores = to_selection_heads(self.score(step), step).float()
        k_max = step.max_budget()
        if step.uniform and scores.device.type != "cpu":
            # every key visible, forced keys are two index ranges: set in place, no [B, H, Q, N] masks
            forced = _force(scores, step.hints.sink, step.hints.local, float("inf"))
            return self._select_uniform_device(step, forced, k_max)
        visible = step.visible[:, None]
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(step.forced[:, None], float("inf"))
        if self.rescore > 0:
            scores = self._rescored(step, scores, k_max)
        ranked = scores.sort(dim=-1, descending=True, stable=True)
        values, indices = ranked.values[..., :k_max], ranked.indices[..., :k_max]
        ranks = torch.arange(k_max, device=scores.device)
        valid = (ranks < step.budgets[:, None, :, None]) & (values > float("-inf"))
        return Selection(indices=indices, valid=valid)

    def _select_uniform_device(self, step: DecodeStep, scores: torch.Tensor, k_max: int) -> Selection:
        """`select` on a uniform device step (every row keeps k_max of all N keys): top-k instead of a full stable
        sort of the N scores (twice with the re-rank), and the re-rank ranks its candidate list directly. The set
        equals the CPU rule's up to how torch.topk orders equal scores; no host sync, so the step can be captured
        in a CUDA graph."""
        if self.rescore > 0:
            first, index = scores.topk(min(scores.shape[-1], self.rescore * k_max), dim=-1, sorted=False)
            fine = self._candidate_scores(step, index)
            second = torch.where(first >= _SINK_BASE, first, fine).masked_fill(
                first == float("-inf"), float("-inf")
            )
            values, pick = second.topk(k_max, dim=-1, sorted=False)
            indices = index.gather(-1, pick)
        else:
            values, indices = scores.topk(k_max, dim=-1, sorted=False)
        return Selection(indices=indices, valid=values > float("-inf"))

    def _rescored(self, step: DecodeStep, scores: torch.Tensor, k_max: int) -> torch.Tensor:
        """Second stage: the LUT's best `rescore` x budget tokens of each row are re-ranked by q . K read from the
        cache itself (sign bits x 2-bit magnitudes, or the 16-bit keys); every other token drops out. The 1-bit
        LUT alone loses the magnitudes, so it misses outlier keys that carry most of the attention mass.

        Forced and sink tokens keep their first-stage priority. A row's result depends only on its own scores
        and budget (chunked == token-by-token)."""
        c_max = min(scores.shape[-1], self.rescore * k_max)
        ranked = scores.sort(dim=-1, descending=True, stable=True)
        first, index = ranked.values[..., :c_max], ranked.indices[..., :c_max]
        ranks = torch.arange(c_max, device=scores.device)
        keep = (ranks < self.rescore * step.budgets[:, None, :, None]) & (first > float("-inf"))
        fine = self._candidate_scores(step, index)
        priority = first >= _SINK_BASE  # forced (+inf) and sinks
        second = torch.where(priority, first, fine).masked_fill(~keep, float("-inf"))
        return torch.full_like(scores, float("-inf")).scatter(-1, index, second)

    def _candidate_scores(self, step: DecodeStep, index: torch.Tensor) -> torch.Tensor:
        """q . (K - mu) for the tokens `index` [B, S, Q, C] of each row, with the keys as the row's query reads them
        in attention (`read_keys`: compressed tokens dequantized, sinks and the query's residual block at 16-bit).
        The query is summed over the group for gqa="group" (exact by linearity); q . mu is the same for every key
        of a row and is left out."""
        if (on_kernels := _self_index_device.candidate_scores(self, step, index)) is not None:
            return on_kernels
        layer = step.layer
        work = self.mu.dtype
        query = step.query.to(work)
        b, _, q_len, d = query.shape
        if step.gqa == "group" and layer.group_size > 1:
            query = query.view(b, layer.num_kv_heads, layer.group_size, q_len, d).sum(2)
        s, c = index.shape[1], index.shape[-1]
        out = torch.empty(index.shape, dtype=work, device=index.device)
        chunk = max(1, (1 << 22) // max(1, b * s * c * d))
        n = self._store.length
        for lo in range(0, q_len, chunk):
            hi = min(q_len, lo + chunk)
            positions = torch.arange(n - q_len + lo, n - q_len + hi, device=index.device)
            keys = self.read_keys(index[:, :, lo:hi], positions)  # [B, S, q, C, d]
            out[:, :, lo:hi] = torch.einsum("bsqd,bsqcd->bsqc", query[:, :, lo:hi], keys)
        return out.float()

    def _gather(self, buffers: _Buffers, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` [B, S, Q, K] of buffers[name] [B, Hkv, N, c] (S = kv heads or query heads) ->
        [B, S, Q, K, c]."""
        b, s, q, k = indices.shape
        rep = s // self.layer.num_kv_heads
        src = buffers.view(name)
        src = src.repeat_interleave(rep, dim=1) if rep > 1 else src
        flat = indices.reshape(b, s, q * k, 1).expand(-1, -1, -1, src.shape[-1])
        return src.gather(2, flat).view(b, s, q, k, src.shape[-1])

    def _per_sel_head(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        rep = heads // self.layer.num_kv_heads
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t

    def read_keys(self, indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """K - mu as read by the queries at `positions` [Q] for the tokens `indices` [B, S, Q, K] ->
        [B, S, Q, K, d]: compressed tokens through `dequantize_keys`, sinks and each query's residual block from
        their 16-bit copies."""
        s = indices.shape[1]
        work = self.mu.dtype
        mu = self._per_sel_head(self.mu, s)[:, :, None]  # [B, S, 1, 1, d]
        if not self.compressed:
            return self._gather(self._store, "k_full", indices).to(work) - mu
        if self.k_axis == "channel":
            blocks = self._k_blocks.length
            rows = ((indices + self._k_pad) // self.k_group).clamp(max=blocks - 1)  # later tokens: tail copies
            scale = self._gather(self._k_blocks, "k_scale", rows)
        else:
            scale = self._gather(self._store, "k_scale", indices)
        keys = dequantize_keys(
            self._gather(self._store, "sign_bits", indices),
            self._gather(self._store, "k_mag", indices),
            scale,
            self._gather(self._store, "k_zero", indices) if self.k_zero else None,
            mu,
            self._per_sel_head(self.alpha, s)[:, :, None],
            self.k_bits,
            self.k_midrise,
            work,
        )
        return self._override_fp(indices, positions, keys, "k") - mu

    def _override_fp(
        self, indices: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, which: str
    ) -> torch.Tensor:
        """rows [B, S, Q, K, d] (K or V, without mu) with the sinks and each query's residual block replaced by
        their 16-bit copies (`which` = "k" or "v")."""
        b, s, q, k = indices.shape
        d = self.layer.head_dim
        work = rows.dtype
        if which == "k":
            rows = rows + self._per_sel_head(self.mu, s)[:, :, None]
        if self.sink_positions is not None and self.sink_keys is not None:
            sink_pos = self._per_sel_head(self.sink_positions.long(), s)
            flat_idx = indices.reshape(b, s, q * k).contiguous()
            slot = torch.searchsorted(sink_pos.contiguous(), flat_idx).clamp(max=sink_pos.shape[-1] - 1)
            is_sink = (sink_pos.gather(-1, slot) == flat_idx).view(b, s, q, k, 1)
            flat = slot[..., None].expand(-1, -1, -1, d)
            src = self.sink_keys if which == "k" else self.sink_values
            sink = self._per_sel_head(src, s).to(work).gather(2, flat).view(b, s, q, k, d)
            rows = torch.where(is_sink, sink, rows)
        if self.residual > 0 and self._tail.length > 0:
            block = (
                self.decode_start + (positions - self.decode_start) // self.residual * self.residual
            )  # [Q]
            in_block = (indices >= block[None, None, :, None]) & (indices >= self._tail_start)
            local = (indices - self._tail_start).clamp(0, self._tail.length - 1)
            tail = self._gather(self._tail, which, local).to(work)
            rows = torch.where(in_block[..., None], tail, rows)
        return rows

    # --- attention over the gathered tokens -------------------------------------------------------------------

    def attend(self, step: DecodeStep, selection: Selection, scaling: float) -> torch.Tensor:
        """Attention of step.query over the selected tokens. The stored V is V R with v_rotate: both paths attend
        over it and the output is un-rotated here (out = out' R^T)."""
        step = self._rotated_query(step)
        if (on_kernels := _self_index_device.attend(self, step, selection, scaling)) is not None:
            return self.unrotate_values(on_kernels)  # dequantizes only the selected tokens' bytes, in registers
        if not self.compressed:
            keys, values = self._store.view("k_full"), self._store.view("v_full")
            out = sparse_attention(step.query, keys, values, selection.indices, selection.valid, scaling,
                                   tickets=self.attention_tickets(selection, step.query.device))  # fmt: skip
            return self.unrotate_values(out)
        query = step.query
        b, hq, q_len, d = query.shape
        s = selection.indices.shape[1]
        k_sel = selection.indices.shape[-1]
        chunk = max(1, (1 << 22) // max(1, b * s * k_sel * d))
        # with v_rotate the rotated output stays in the work dtype until it is un-rotated
        out = query.new_empty(b, hq, q_len, d, dtype=query.dtype if self.v_signs is None else self.mu.dtype)
        n = self._store.length
        for lo in range(0, q_len, chunk):
            hi = min(q_len, lo + chunk)
            positions = torch.arange(n - q_len + lo, n - q_len + hi, device=query.device)
            out[:, :, lo:hi] = self._attend_chunk(
                query[:, :, lo:hi],
                selection.indices[:, :, lo:hi],
                selection.valid[:, :, lo:hi],
                positions,
                scaling,
            )
        return out if self.v_signs is None else self.unrotate_values(out).to(query.dtype)

    def gather_dequantized(
        self, indices: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """indices [B, S, Q, K] (S = kv heads or query heads), positions [Q] of the queries ->
        K, V [B, S, Q, K, d] as read by those queries (sinks and the query's residual block at 16-bit). V is in
        the stored domain: V R with v_rotate (`unrotate_values` maps it back)."""
        work = self.mu.dtype
        keys = self._per_sel_head(self.mu, indices.shape[1])[:, :, None] + self.read_keys(indices, positions)
        values = dequantize(
            self._gather(self._store, "v", indices),
            self._gather(self._store, "v_scale", indices),
            self._gather(self._store, "v_zero", indices),
            self.kv_bits,
            work,
        )
        return keys, self._override_fp(indices, positions, values, "v")

    def _attend_chunk(self, query, indices, valid, positions, scaling) -> torch.Tensor:
        b, hq, q, d = query.shape
        s = indices.shape[1]
        keys, values = self.gather_dequantized(indices, positions)
        work = keys.dtype
        qh = query.to(work).view(b, s, hq // s, q, d)
        logits = torch.einsum("bsgqd,bsqkd->bsgqk", qh, keys) * scaling
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        out = torch.einsum("bsgqk,bsqkd->bsgqd", weights, values)
        return out.reshape(b, hq, q, d).to(query.dtype if self.v_signs is None else work)

    # --- memory ---------------------------------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of every tensor this layer holds (buffer capacity included), by component."""
        store = self._store.nbytes()
        out = {
            "sign_bits": store.get("sign_bits", 0),
            "k_quant": store.get("k_mag", 0),
            "k_scale_zero": store.get("k_scale", 0)
            + store.get("k_zero", 0)
            + sum(self._k_blocks.nbytes().values()),
            "v_quant": store.get("v", 0),
            "v_scale_zero": store.get("v_scale", 0) + store.get("v_zero", 0),
            "kv_full": store.get("k_full", 0) + store.get("v_full", 0),
            "sinks_fp": tensor_nbytes(self.sink_keys) + tensor_nbytes(self.sink_values),
            "sink_positions": tensor_nbytes(self.sink_positions) + tensor_nbytes(self.sink_rank),
            "residual_fp": sum(self._tail.nbytes().values()),
            "codebook": tensor_nbytes(self.centroids),
            "mu_alpha": tensor_nbytes(self.mu) + tensor_nbytes(self.alpha),
            # v_rotate / k_rotate: the layer's d signs (one tensor for both); the [d, d] base (rotation_base) is
            # one constant shared by every layer
            "rotation": tensor_nbytes(self.v_signs if self.v_signs is not None else self.k_signs),
        }
        return out

    @property
    def num_tokens(self) -> int:
        return self._store.length


# ----------------------------------------------------------------------------------------------------------------
# memory report
# ----------------------------------------------------------------------------------------------------------------


def measure_cache_memory(
    model, tokenizer, config: SparseConfig, context: int, decode_tokens: int = 8
) -> dict:
    """Prefill `context` haystack tokens, decode `decode_tokens` greedily, then measure the cache."""
    import sparsekv
    from sparsekv.assets import haystack_text
    from sparsekv.cache import SparseCache
    from sparsekv.hf_compat import cache_kwargs

    ids = tokenizer.encode(haystack_text(), add_special_tokens=False)[:context]
    if len(ids) < context:
        raise ConfigError(f"the haystack has only {len(ids)} tokens")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    cache = SparseCache.for_model(model, config)
    with torch.inference_mode(), sparsekv.enabled(model, config):
        logits = model(input_ids=input_ids, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        for _ in range(decode_tokens):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    report = cache_memory(cache)
    report.update(
        method=config.method,
        options=config.options,
        context=context,
        decode_tokens=decode_tokens,
        dense_layers_config=list(config.dense_layers),
    )
    return report


def register(app) -> None:
    from typing import Annotated

    import typer

    from sparsekv import cli

    # this module uses postponed annotations: typer resolves them in the module globals, so put the names there
    globals().update(
        Annotated=Annotated,
        typer=typer,
        ModelOpt=cli.ModelOpt,
        DenseLayersOpt=cli.DenseLayersOpt,
        OptionOpt=cli.OptionOpt,
        DeviceOpt=cli.DeviceOpt,
        DtypeOpt=cli.DtypeOpt,
        OutputOpt=cli.OutputOpt,
    )
    build_config, console, load, write_json = cli.build_config, cli.console, cli.load, cli.write_json

    @app.command("cache-memory")
    def cache_memory_command(
        model: ModelOpt = "default",
        context: Annotated[int, typer.Option(help="prompt tokens (haystack text)")] = 4096,
        method: Annotated[str, typer.Option("--method", "-m")] = "self-index",
        dense_layers: DenseLayersOpt = "0,1",
        option: OptionOpt = None,
        decode_tokens: Annotated[int, typer.Option(help="decode steps after the prefill")] = 8,
        device: DeviceOpt = "cpu",
        dtype: DtypeOpt = "float32",
        output: OutputOpt = None,
    ) -> None:
        """Bytes the KV cache actually holds per token, by component, vs a bf16 dense cache."""
        from rich.table import Table

        config = build_config(method, "0.1", None, dense_layers, 0, 0, "group", option)
        loaded, tokenizer = load(model, device, dtype)
        report = measure_cache_memory(loaded, tokenizer, config, context, decode_tokens)
        per = report["components_bytes_per_token_per_kv_head_per_layer"]
        table = Table("component", "bytes / token / kv-head / layer", "total MiB")
        for name, value in report["components"].items():
            if value:
                table.add_row(name, f"{per[name]:.2f}", f"{value / 2**20:.2f}")
        console.print(table)
        ratio = report["compressed_layers_ratio_vs_bf16"]
        console.print(
            f"{report['tokens']} tokens: {report['bytes_per_token']:.0f} B/token held vs "
            f"{report['dense_bf16_bytes_per_token']} B/token for a bf16 dense cache "
            f"({100 * report['ratio_vs_bf16']:.1f}% overall"
            + (
                f"; {100 * ratio:.1f}% on the {report['compressed_layers']} compressed layers"
                if ratio
                else ""
            )
            + f"; {report['dense_layers']} dense layers at {dtype})"
        )
        write_json(output, report)
