"""Attention of each query over its own selected keys (varlen per row through `valid`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selection_mask(indices: torch.Tensor, valid: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[..., N] bool mask of the valid indices. A max-reduction, so a padding entry that repeats a kept index
    can never clear it (a plain scatter would depend on write order)."""
    mask = torch.zeros(*indices.shape[:-1], num_keys, dtype=torch.uint8, device=indices.device)
    return mask.scatter_reduce_(-1, indices, valid.to(torch.uint8), reduce="amax").bool()


def sparse_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """query [B, Hq, Q, d]; keys/values [B, Hkv, N, d]; indices/valid [B, S, Q, K] with S = Hkv or Hq
    (valid None: every index is valid).

    Returns [B, Hq, Q, d]. Every row must have at least one valid index.
    """
    if valid is None:
        valid = torch.ones(indices.shape, dtype=torch.bool, device=indices.device)
    num_heads = query.shape[1]
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    mask = selection_mask(indices, valid, num_keys)
    if mask.shape[1] != num_heads:
        mask = mask.repeat_interleave(num_heads // mask.shape[1], dim=1)
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)


def sparse_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Dispatch: the split-K Triton kernel on CUDA (any Q, GQA through S), else the reference."""
    from sparsekv.kernels._triton import use_triton

    if (
        use_triton(query, keys, values, indices)
        and indices.shape[-1] > 0
        and keys.dtype == values.dtype == query.dtype
        and query.shape[-1] <= 256
    ):
        from sparsekv.kernels._sparse_attention_triton import sparse_attention_triton

        return sparse_attention_triton(query, keys, values, indices, valid, scaling)
    return sparse_attention_reference(query, keys, values, indices, valid, scaling)
