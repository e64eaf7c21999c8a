"""Query/key hashing into packed sign codes: linear (LSH: sign(x R)) or a per-kv-head MLP
(Spotlight-style: sign(W2 silu(W1 x + b1))), fused with the bit packing so one launch yields the codes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekv.kernels.bits import pack_sign_bits


def sign_hash_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    wr: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, H, Q, d]; w1 [Hkv, d, h]; optional w2 [Hkv, h, bits], b1 [Hkv, h], wr [Hkv, d, bits] (with w2),
    b2 [Hkv, bits] -> int32 [B, H, Q, bits/32].

    Head j uses the weights of kv head j // (H / Hkv) (H = Hkv for keys, Hq for queries). The codes are the signs
    of silu(x @ w1 + b1) @ w2 + x @ wr + b2, or of x @ w1 + b2 without w2 (bits = h)."""
    b, heads, q, d = x.shape
    hkv = w1.shape[0]
    g = heads // hkv
    xs = x.reshape(b, hkv, g * q, d).to(w1.dtype)
    y = torch.matmul(xs, w1)
    if w2 is not None:
        if b1 is not None:
            y = y + b1[None, :, None, :]
        y = torch.matmul(F.silu(y.float()).to(w2.dtype), w2)
        if wr is not None:
            y = y + torch.matmul(xs, wr)
    if b2 is not None:
        y = y + b2[None, :, None, :]
    return pack_sign_bits(y).reshape(b, heads, q, -1)


def sign_hash(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    wr: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed sign codes of a linear or MLP hash (see the reference for shapes); one kernel on CUDA."""
    from sparsekv.kernels._triton import kernel, use_triton

    bits = (w2 if w2 is not None else w1).shape[-1]
    dims = (x.shape[-1], w1.shape[-1], bits)
    pow2 = all(n >= 16 and n & (n - 1) == 0 for n in dims)  # tl.arange / tl.dot tile constraints
    if use_triton(x, w1) and pow2 and bits >= 32 and x.dtype in (w1.dtype, torch.bfloat16, torch.float16):
        impl = kernel("_sign_hash_triton", "sign_hash_triton")
        if impl is not None:
            return impl(x, w1, w2, b1, wr, b2)
    return sign_hash_reference(x, w1, w2, b1, wr, b2)
