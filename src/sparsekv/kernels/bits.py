"""Sign-bit packing of hash codes (32 bits per int32 word) and a 32-bit popcount."""

from __future__ import annotations

import torch

_M1, _M2, _M4 = 0x55555555, 0x33333333, 0x0F0F0F0F


def pack_sign_bits(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int32 [..., ceil(D/32)]: bit i of word w is (x[..., 32*w + i] > 0); missing bits are 0."""
    d = x.shape[-1]
    words = (d + 31) // 32
    bits = (x > 0).to(torch.int64)
    if words * 32 != d:
        bits = torch.nn.functional.pad(bits, (0, words * 32 - d))
    bits = bits.reshape(*x.shape[:-1], words, 32)
    weights = torch.ones(32, dtype=torch.int64, device=x.device) << torch.arange(32, device=x.device)
    packed = (bits * weights).sum(-1)
    # bit 31 set means a negative int32: wrap the unsigned value explicitly (int64 -> int32 casts saturate nowhere,
    # but being explicit keeps the meaning independent of backend cast rules)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def popcount32(x: torch.Tensor) -> torch.Tensor:
    """Number of set bits of each int32 element (SWAR; the same arithmetic as the Triton helper)."""
    if x.dtype != torch.int32:
        raise TypeError(f"popcount32 expects int32, got {x.dtype}")
    x = x - ((x >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


def check_code_shapes(query_codes: torch.Tensor, key_codes: torch.Tensor) -> tuple[int, int]:
    """Query [B, Hq, Q, W] and key [B, Hkv, N, W] int32 codes of one packing -> (Hkv, query heads per kv head)."""
    if query_codes.dtype != torch.int32 or key_codes.dtype != torch.int32:
        raise TypeError("hamming codes must be int32 (see pack_sign_bits)")
    if query_codes.dim() != 4 or key_codes.dim() != 4:
        raise ValueError("query_codes [B, Hq, Q, W] and key_codes [B, Hkv, N, W] expected")
    b, hq, _, w = query_codes.shape
    bk, hkv, _, wk = key_codes.shape
    if b != bk or w != wk or hq % hkv:
        raise ValueError(
            f"shape mismatch: query_codes {tuple(query_codes.shape)}, key_codes {tuple(key_codes.shape)}"
        )
    return hkv, hq // hkv
