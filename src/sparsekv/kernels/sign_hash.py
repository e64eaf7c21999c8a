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


def _fused_shapes(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None) -> bool:
    bits = (w2 if w2 is not None else w1).shape[-1]
    dims = (x.shape[-1], w1.shape[-1], bits)
    pow2 = all(n >= 16 and n & (n - 1) == 0 for n in dims)  # tl.arange / tl.dot tile constraints
    return pow2 and bits >= 32 and x.dtype in (w1.dtype, torch.bfloat16, torch.float16)


def sign_hash(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    wr: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op `sparsekv::sign_hash`: packed sign codes of a linear or MLP hash (see the reference for shapes); one
    kernel on CUDA, the reference elsewhere."""
    return _sign_hash_op(x, w1, w2, b1, wr, b2)


def _code_words(w1: torch.Tensor, w2: torch.Tensor | None) -> int:
    return ((w2 if w2 is not None else w1).shape[-1] + 31) // 32


@torch.library.custom_op("sparsekv::sign_hash", mutates_args=())
def _sign_hash_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None,
    b1: torch.Tensor | None,
    wr: torch.Tensor | None,
    b2: torch.Tensor | None,
) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return sign_hash_reference(x, w1, w2, b1, wr, b2)


@_sign_hash_op.register_kernel("cuda")
def _sign_hash_cuda(x, w1, w2, b1, wr, b2):
    from sparsekv.kernels._triton import kernel, use_triton

    if use_triton(x, w1) and _fused_shapes(x, w1, w2):
        impl = kernel("_sign_hash_triton", "sign_hash_triton")
        if impl is not None:
            return impl(x, w1, w2, b1, wr, b2)
    return sign_hash_reference(x, w1, w2, b1, wr, b2)


@_sign_hash_op.register_fake
def _sign_hash_fake(x, w1, w2, b1, wr, b2):
    return x.new_empty((*x.shape[:-1], _code_words(w1, w2)), dtype=torch.int32)


# rows of one kv head (its group's queries + the new keys) that one program of the pair kernel takes
PAIR_MAX_ROWS = 64


def sign_hash_pair_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    key_out: torch.Tensor,
    key_mean: torch.Tensor,
    key_scale: torch.Tensor,
    query_scale: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    wr: torch.Tensor | None = None,
    key_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, Q, d] and keys [B, Hkv, T, d] through one hash with per-role normalisation: queries
    x / query_scale, keys (x - key_mean) / key_scale (key_mean [Hkv, d], scales [Hkv], float32). Writes the
    keys' codes into key_out [B, Hkv, T, bits/32] (a view into a code buffer may be passed), or with key_slots
    (int64 [T]) into rows key_slots of a code buffer key_out [B, Hkv, N, bits/32]; returns the queries' codes
    [B, Hq, Q, bits/32]."""
    group = query.shape[1] // keys.shape[1]
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    qn = query.to(dtype) / query_scale.to(dtype).repeat_interleave(group)[None, :, None, None]
    kn = (keys.to(dtype) - key_mean.to(dtype)[None, :, None, :]) / key_scale.to(dtype)[None, :, None, None]
    weights = [None if t is None else t.to(dtype) for t in (w1, w2, b1, wr)]
    key_codes = sign_hash_reference(kn, *weights)
    if key_slots is None:
        key_out.copy_(key_codes)
    else:
        key_out.index_copy_(-2, key_slots, key_codes)
    return sign_hash_reference(qn, *weights)


def sign_hash_pair(
    query: torch.Tensor,
    keys: torch.Tensor,
    key_out: torch.Tensor,
    key_mean: torch.Tensor,
    key_scale: torch.Tensor,
    query_scale: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    wr: torch.Tensor | None = None,
    key_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op `sparsekv::sign_hash_pair`: a decode step's query codes and its new keys' codes (written into
    key_out, at key_slots if given) in one kernel on CUDA, the reference elsewhere (see the reference)."""
    if key_slots is not None and (key_slots.dtype != torch.int64 or key_slots.shape != keys.shape[2:3]):
        raise ValueError(f"key_slots must be an int64 tensor of the {keys.shape[2]} new keys' rows")
    return _sign_hash_pair_op(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2, b1, wr, key_slots)


@torch.library.custom_op("sparsekv::sign_hash_pair", mutates_args=("key_out",))
def _sign_hash_pair_op(
    query: torch.Tensor,
    keys: torch.Tensor,
    key_out: torch.Tensor,
    key_mean: torch.Tensor,
    key_scale: torch.Tensor,
    query_scale: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor | None,
    b1: torch.Tensor | None,
    wr: torch.Tensor | None,
    key_slots: torch.Tensor | None,
) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return sign_hash_pair_reference(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2, b1, wr, key_slots)


@_sign_hash_pair_op.register_kernel("cuda")
def _sign_hash_pair_cuda(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2, b1, wr, key_slots):
    from sparsekv.kernels._triton import kernel, use_triton

    rows = query.shape[1] // keys.shape[1] * query.shape[2] + keys.shape[2]
    fits = rows <= PAIR_MAX_ROWS and key_out.stride(-1) == 1 and w1.dtype == torch.float32
    if use_triton(query, keys, w1) and fits and _fused_shapes(query, w1, w2) and keys.dtype == query.dtype:
        impl = kernel("_sign_hash_triton", "sign_hash_pair_triton")
        if impl is not None:
            return impl(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2, b1, wr, key_slots)
    return sign_hash_pair_reference(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2, b1, wr, key_slots)


@_sign_hash_pair_op.register_fake
def _sign_hash_pair_fake(query, keys, key_out, key_mean, key_scale, query_scale, w1, w2, b1, wr, key_slots):
    return query.new_empty((*query.shape[:-1], _code_words(w1, w2)), dtype=torch.int32)
