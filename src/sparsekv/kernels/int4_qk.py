"""INT4 keys (per-token asymmetric, two values per byte) and the q.K estimate over candidate indices (Twilight)."""

from __future__ import annotations

import torch


def quantize_int4(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [B, Hkv, N, d] (d even) -> (packed uint8 [B, Hkv, N, d/2], scale [B, Hkv, N] fp32, zero [B, Hkv, N] fp32).

    Per token and kv head: zero = min over d, scale = (max - min) / 15, code = round((k - zero) / scale) in 0..15;
    element 2i sits in the low nibble of byte i, element 2i+1 in the high nibble. k ~= code * scale + zero.
    """
    if keys.shape[-1] % 2:
        raise ValueError("head_dim must be even to pack two INT4 values per byte")
    k = keys.float()
    lo = k.amin(-1)
    hi = k.amax(-1)
    scale = (hi - lo) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((k - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale, lo


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_int4 up to rounding: fp32 [..., d]."""
    low = (packed & 0xF).float()
    high = (packed >> 4).float()
    codes = torch.stack((low, high), dim=-1).flatten(-2)
    return codes * scale[..., None] + zero[..., None]


def int4_qk_reference(
    query: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """query [B, Hq, Q, d]; packed [B, Hkv, N, d/2] uint8; scale/zero [B, Hkv, N]; indices [B, S, Q, K] int64
    with S = Hkv (shared by the GQA group) or Hq -> estimated q.k [B, Hq, Q, K] fp32 (no softmax scaling)."""
    b, hq, q, d = query.shape
    hkv = packed.shape[1]
    s, kk = indices.shape[1], indices.shape[3]
    idx = indices.repeat_interleave(hq // s, dim=1) if s != hq else indices  # [B, Hq, Q, K]
    kv_of_head = torch.arange(hq, device=query.device) // (hq // hkv)
    flat = idx.reshape(b, hq, q * kk)
    pk = packed[:, kv_of_head]  # [B, Hq, N, d/2] (views of the kv heads' codes)
    gathered = torch.gather(pk, 2, flat[..., None].expand(b, hq, q * kk, d // 2))
    sc = torch.gather(scale[:, kv_of_head], 2, flat)
    zr = torch.gather(zero[:, kv_of_head], 2, flat)
    k = dequantize_int4(gathered, sc, zr).reshape(b, hq, q, kk, d)
    return torch.einsum("bhqd,bhqkd->bhqk", query.float(), k)


def int4_qk(
    query: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """The op `sparsekv::int4_qk`: estimated q.k over candidate indices from INT4 keys, [B, Hq, Q, K] fp32; the
    Triton kernel on CUDA, the reference elsewhere."""
    return _int4_qk_op(query, packed, scale, zero, indices)


@torch.library.custom_op("sparsekv::int4_qk", mutates_args=())
def _int4_qk_op(
    query: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return int4_qk_reference(query, packed, scale, zero, indices)


@_int4_qk_op.register_kernel("cuda")
def _int4_qk_cuda(query, packed, scale, zero, indices):
    from sparsekv.kernels._triton import kernel, use_triton

    half = query.shape[-1] // 2
    if use_triton(query, packed, indices) and indices.shape[-1] > 0 and half >= 16 and half & (half - 1) == 0:
        impl = kernel("_int4_triton", "int4_qk_triton")
        if impl is not None:
            return impl(query, packed, scale, zero, indices)
    return int4_qk_reference(query, packed, scale, zero, indices)


@_int4_qk_op.register_fake
def _int4_qk_fake(query, packed, scale, zero, indices):
    return query.new_empty((*query.shape[:-1], indices.shape[-1]), dtype=torch.float32)
