"""Decode ops over the self-index compressed cache that read only the tokens they need: q . K of candidate rows
(the re-rank), attention over the selected rows, both dequantizing K/V on the fly from the stored bits, and
attention over selected candidates whose q . K the re-rank already computed (V only).

The layout is `SelfIndexSelector`'s (see `compressed_format.dequantize_keys` / `dequantize` for the exact
formulas); the references here gather and dequantize with those torch functions (`dequantized_rows`, the one
definition of a read of the compressed cache), the Triton kernels (`_compressed_kv_triton`) read the same bytes
per selected token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from sparsekv.kernels.compressed_format import dequantize, dequantize_keys


@dataclass
class CompressedKV:
    """One layer's compressed K/V as stored, plus the 16-bit copies that attention reads instead.

    sign_bits int32 [B, H, N, ceil(d/32)]; k_mag uint8 [B, H, N, d*k_bits/8] (`pack_bits` layout); k_scale fp16
    [B, H, N, d/k_group] (token axis) or [B, H, rows, d] (channel axis: token t uses row
    min((t + k_scale_offset) // k_scale_tokens, rows - 1)); k_zero like k_scale or None; v uint8
    [B, H, N, d*v_bits/8], v_scale / v_zero fp16 [B, H, N, d/v_group]; mu / alpha float32 [B, H, 1, d]
    (K = mu + sign * alpha * magnitude).
    sink_positions int32 [B, H, S] (ascending, unused slots hold a value no index equals) with sink_keys /
    sink_values [B, H, S, d]: these tokens are read from the copies. tail_keys / tail_values [B, H, T, d] hold
    tokens tail_first.. at 16-bit; a query reads token t from there when t >= its `tail_from` entry.
    """

    sign_bits: torch.Tensor
    k_mag: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor | None
    v: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    mu: torch.Tensor
    alpha: torch.Tensor
    k_bits: int
    v_bits: int
    midrise: bool = False
    k_scale_tokens: int = 1
    k_scale_offset: int = 0
    sink_positions: torch.Tensor | None = None
    sink_keys: torch.Tensor | None = None
    sink_values: torch.Tensor | None = None
    tail_keys: torch.Tensor | None = None
    tail_values: torch.Tensor | None = None
    tail_first: int = 0

    @property
    def head_dim(self) -> int:
        return self.mu.shape[-1]

    def per_query_head(self, group: int) -> CompressedKV:
        """The view with every head's fields repeated for the `group` query heads that read it (rows of their own
        per query head, GQA "head"): a copy of each per-head tensor, as a gather per query head would make."""
        if group == 1:
            return self
        repeated = {
            field.name: value.repeat_interleave(group, dim=1)
            for field in fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor)
        }
        return replace(self, **repeated)


def _gather(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t [B, H, R, c], rows [B, H, Q, K] -> [B, H, Q, K, c]."""
    b, h, q, k = rows.shape
    flat = rows.reshape(b, h, q * k, 1).expand(-1, -1, -1, t.shape[-1])
    return t.gather(2, flat).view(b, h, q, k, t.shape[-1])


def centred_keys_reference(kv: CompressedKV, index: torch.Tensor) -> torch.Tensor:
    """K - mu [B, H, Q, K, d] of the compressed rows `index` [B, H, Q, K] (no 16-bit copies), in mu's dtype."""
    rows = index
    if kv.k_scale_tokens > 1:
        rows = ((index + kv.k_scale_offset) // kv.k_scale_tokens).clamp(max=kv.k_scale.shape[2] - 1)
    zero = None if kv.k_zero is None else _gather(kv.k_zero, rows)
    return dequantize_keys(
        _gather(kv.sign_bits, index), _gather(kv.k_mag, index), _gather(kv.k_scale, rows), zero,
        kv.mu[:, :, None], kv.alpha[:, :, None], kv.k_bits, kv.midrise, kv.mu.dtype,
    )  # fmt: skip


def dequantized_rows(
    kv: CompressedKV, index: torch.Tensor, tail_from: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, H, Q, K, d] of the rows `index` [B, H, Q, K] as the queries whose residual blocks start at
    `tail_from` [Q] read them: compressed rows dequantized, the sinks and each query's residual block from their
    16-bit copies; in mu's dtype, V in the stored domain (V R with a value rotation). The one definition of a
    read of the compressed cache: both ops' references and a prompt's later chunks read through it."""
    keys = _with_copies(centred_keys_reference(kv, index) + kv.mu[:, :, None], kv, index, tail_from,
                        "sink_keys", "tail_keys")  # fmt: skip
    return keys, dequantized_values(kv, index, tail_from)


def dequantized_values(kv: CompressedKV, index: torch.Tensor, tail_from: torch.Tensor) -> torch.Tensor:
    """The V half of `dequantized_rows`: V [B, H, Q, K, d] of the rows `index`, in mu's dtype."""
    values = dequantize(_gather(kv.v, index), _gather(kv.v_scale, index), _gather(kv.v_zero, index), kv.v_bits,
                        kv.mu.dtype)  # fmt: skip
    return _with_copies(values, kv, index, tail_from, "sink_values", "tail_values")


def compressed_key_scores_reference(
    query: torch.Tensor, kv: CompressedKV, index: torch.Tensor, tail_from: torch.Tensor
) -> torch.Tensor:
    """query [B, H, Q, d] (one query per kv head, e.g. the GQA group's sum) or [B, H, G, Q, d] (each of the G
    query heads of a kv head's group), index [B, H, Q, C], tail_from [Q] -> float32 [B, H, Q, C] (or
    [B, H, G, Q, C]) = query . (K - mu) of the rows as attention reads them (q . mu is the same for every key of a
    row)."""
    keys = _with_copies(centred_keys_reference(kv, index) + kv.mu[:, :, None], kv, index, tail_from,
                        "sink_keys", "tail_keys")  # fmt: skip
    pattern = "bhgqd,bhqcd->bhgqc" if query.dim() == 5 else "bhqd,bhqcd->bhqc"
    return torch.einsum(pattern, query.to(keys.dtype), keys - kv.mu[:, :, None]).float().contiguous()


def compressed_key_scores(
    query: torch.Tensor, kv: CompressedKV, index: torch.Tensor, tail_from: torch.Tensor
) -> torch.Tensor:
    """The op `sparsekv::compressed_key_scores` (see the reference for shapes): the Triton kernel on CUDA, the
    reference elsewhere. The op takes the view's fields, not the view: an op's arguments are tensors and scalars."""
    return _compressed_key_scores_op(query, index, tail_from, *_fields_of(kv))


def _fields_of(kv: CompressedKV) -> tuple:
    """The view's fields in declaration order (`CompressedKV(*fields)` rebuilds it; no copies, unlike astuple)."""
    return tuple(getattr(kv, field.name) for field in fields(CompressedKV))


#: the op schema of a CompressedKV's fields, derived from the dataclass: the ops take the view's fields, not the view
_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "int": "int", "bool": "bool"}
_KV_SCHEMA = ", ".join(f"{_SCHEMA_TYPES[field.type]} {field.name}" for field in fields(CompressedKV))


@torch.library.custom_op(
    "sparsekv::compressed_key_scores", mutates_args=(),
    schema=f"(Tensor query, Tensor index, Tensor tail_from, {_KV_SCHEMA}) -> Tensor",
)  # fmt: skip
def _compressed_key_scores_op(query, index, tail_from, *kv_fields):
    """CPU (and any device without its own kernel): the reference."""
    return compressed_key_scores_reference(query, CompressedKV(*kv_fields), index, tail_from)


@_compressed_key_scores_op.register_kernel("cuda")
def _compressed_key_scores_cuda(query, index, tail_from, *kv_fields):
    from sparsekv.kernels._triton import kernel, use_triton

    kv = CompressedKV(*kv_fields)
    if use_triton(query, kv.sign_bits, index) and index.shape[-1] > 0 and kv.mu.dtype == torch.float32:
        impl = kernel("_compressed_kv_triton", "compressed_key_scores_triton")
        if impl is not None:
            return impl(query, kv, index, tail_from)
    return compressed_key_scores_reference(query, kv, index, tail_from)


@_compressed_key_scores_op.register_fake
def _compressed_key_scores_fake(query, index, tail_from, *kv_fields):
    shape = index.shape if query.dim() == 4 else (*index.shape[:2], query.shape[2], *index.shape[2:])
    return query.new_empty(shape, dtype=torch.float32)


def _with_copies(rows, kv: CompressedKV, index, tail_from, copy_name: str, tail_name: str):
    """rows [B, H, Q, K, d] with the sink tokens and each query's tail tokens read from the 16-bit copies."""
    copies, tail = getattr(kv, copy_name), getattr(kv, tail_name)
    if copies is not None:
        pos = kv.sink_positions.long()
        hit = index[..., None] == pos[:, :, None, None, :]  # [B, H, Q, K, S]
        slot = torch.where(hit, torch.arange(pos.shape[-1], device=index.device), -1).amax(-1)
        picked = _gather(copies.to(rows.dtype), slot.clamp(min=0))
        rows = torch.where((slot >= 0)[..., None], picked, rows)
    if tail is not None and tail.shape[2] > 0:
        in_tail = index >= tail_from.view(1, 1, -1, 1)
        local = (index - kv.tail_first).clamp(0, tail.shape[2] - 1)
        rows = torch.where(in_tail[..., None], _gather(tail.to(rows.dtype), local), rows)
    return rows


def compressed_attention_reference(
    query: torch.Tensor,
    kv: CompressedKV,
    indices: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    tail_from: torch.Tensor,
) -> torch.Tensor:
    """query [B, Hq, Q, d]; indices / valid [B, Hkv, Q, K] (each row shared by its GQA group); tail_from [Q]
    int. Returns [B, Hq, Q, d] in the query's dtype, computed in mu's dtype (float32, or float64) over the
    dequantized rows."""
    b, hq, q, d = query.shape
    h = indices.shape[1]
    keys, values = dequantized_rows(kv, indices, tail_from)
    qh = query.to(keys.dtype).view(b, h, hq // h, q, d)
    logits = torch.einsum("bhgqd,bhqkd->bhgqk", qh, keys)
    return _softmax_rows(logits, values, valid, scaling).to(query.dtype)


def _softmax_rows(logits: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(logits x scaling) over each row's valid entries, times its rows of V: logits [B, H, G, Q, K],
    values [B, H, Q, K, d], valid [B, H, Q, K] -> [B, H x G, Q, d]."""
    logits = (logits.to(values.dtype) * scaling).masked_fill(~valid[:, :, None], float("-inf"))
    out = torch.einsum("bhgqk,bhqkd->bhgqd", torch.softmax(logits, dim=-1), values)
    b, h, g, q, d = out.shape
    return out.reshape(b, h * g, q, d)


def compressed_attention(
    query: torch.Tensor,
    kv: CompressedKV,
    indices: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    tail_from: torch.Tensor,
    tf32: bool = False,
) -> torch.Tensor:
    """The op `sparsekv::compressed_attention` (see the reference for shapes): the split-K Triton kernel on CUDA,
    the reference elsewhere. The op takes the view's fields (see `compressed_key_scores`).

    tf32: the kernel's dots in one TF32 pass whatever the query's dtype: a 16-bit model's precision for the
    float32 query it rotates (3xTF32 took 111 us against 80 at 128K x B4 on the H200, about float32's
    accuracy, which only a float32 model needs). The reference computes in float32 either way."""
    return _compressed_attention_op(query, indices, valid, float(scaling), bool(tf32), tail_from, *_fields_of(kv))


@torch.library.custom_op(
    "sparsekv::compressed_attention", mutates_args=(),
    schema=f"(Tensor query, Tensor indices, Tensor valid, float scaling, bool tf32, Tensor tail_from, {_KV_SCHEMA})"
    " -> Tensor",
)  # fmt: skip
def _compressed_attention_op(query, indices, valid, scaling, tf32, tail_from, *kv_fields):
    """CPU (and any device without its own kernel): the reference."""
    return compressed_attention_reference(query, CompressedKV(*kv_fields), indices, valid, scaling, tail_from)


@_compressed_attention_op.register_kernel("cuda")
def _compressed_attention_cuda(query, indices, valid, scaling, tf32, tail_from, *kv_fields):
    from sparsekv.kernels._triton import kernel, use_triton

    kv = CompressedKV(*kv_fields)
    if (use_triton(query, kv.sign_bits, indices) and indices.shape[-1] > 0 and query.shape[-1] <= 256
            and kv.mu.dtype == torch.float32):  # fmt: skip
        impl = kernel("_compressed_kv_triton", "compressed_attention_triton")
        if impl is not None:
            return impl(query, kv, indices, valid, scaling, tail_from, tf32=tf32)
    return compressed_attention_reference(query, kv, indices, valid, scaling, tail_from)


@_compressed_attention_op.register_fake
def _compressed_attention_fake(query, indices, valid, scaling, tf32, tail_from, *kv_fields):
    return torch.empty_like(query)


def scored_attention_reference(
    scores: torch.Tensor,
    pick: torch.Tensor,
    kv: CompressedKV,
    indices: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    tail_from: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Attention over selected candidates whose logits are already known: scores [B, H, G, Q, C] float32 =
    q . (K - mu) of each row's C candidates for the G query heads of its group (`compressed_key_scores`), pick
    [B, H, Q, K] = each selected entry's candidate (into C), indices [B, H, Q, K] = its cache position (V is read
    there), valid [B, H, Q, K]. Returns [B, H x G, Q, d] in `dtype` (the query's), computed in mu's dtype:
    `compressed_attention`'s output for the query that made the scores (softmax ignores the q . mu that the scores
    leave out), with no key read."""
    b, h, g, q, _ = scores.shape
    logits = scores.gather(-1, pick[:, :, None].expand(b, h, g, q, pick.shape[-1]))
    values = dequantized_values(kv, indices, tail_from)
    return _softmax_rows(logits, values, valid, scaling).to(dtype)


def scored_attention(
    scores: torch.Tensor,
    pick: torch.Tensor,
    kv: CompressedKV,
    indices: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    tail_from: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The op `sparsekv::scored_attention` (see the reference for shapes): a split-K Triton kernel on CUDA that
    reads only V (the re-rank's scores stand in for q . K) and accumulates in float32, the reference elsewhere."""
    return _scored_attention_op(scores, pick, indices, valid, float(scaling), tail_from, dtype, *_fields_of(kv))


@torch.library.custom_op(
    "sparsekv::scored_attention", mutates_args=(),
    schema="(Tensor scores, Tensor pick, Tensor indices, Tensor valid, float scaling, Tensor tail_from, "
    f"ScalarType dtype, {_KV_SCHEMA}) -> Tensor",
)  # fmt: skip
def _scored_attention_op(scores, pick, indices, valid, scaling, tail_from, dtype, *kv_fields):
    """CPU (and any device without its own kernel): the reference."""
    kv = CompressedKV(*kv_fields)
    return scored_attention_reference(scores, pick, kv, indices, valid, scaling, tail_from, dtype)


@_scored_attention_op.register_kernel("cuda")
def _scored_attention_cuda(scores, pick, indices, valid, scaling, tail_from, dtype, *kv_fields):
    from sparsekv.kernels._triton import kernel, use_triton

    kv = CompressedKV(*kv_fields)
    if (use_triton(scores, kv.v, indices) and indices.shape[-1] > 0 and kv.head_dim <= 256
            and scores.dtype == torch.float32):  # fmt: skip
        impl = kernel("_compressed_kv_triton", "scored_attention_triton")
        if impl is not None:
            return impl(scores, pick, kv, indices, valid, scaling, tail_from, dtype)
    return scored_attention_reference(scores, pick, kv, indices, valid, scaling, tail_from, dtype)


@_scored_attention_op.register_fake
def _scored_attention_fake(scores, pick, indices, valid, scaling, tail_from, dtype, *kv_fields):
    b, h, g, q, _ = scores.shape
    return scores.new_empty(b, h * g, q, CompressedKV(*kv_fields).head_dim, dtype=dtype)
