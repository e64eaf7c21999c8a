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
    indices: torch.Tensor | None,
    valid: torch.Tensor | None,
    scaling: float,
    *,
    tickets: torch.Tensor | None = None,
    limit: torch.Tensor | None = None,
    causal: bool = False,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, Q, d]; keys/values [B, Hkv, N, d]; indices/valid [B, S, Q, K] with S = Hkv or Hq
    (valid None: every index is valid). tickets, limit, causal, start: see `sparse_attention` (tickets do not
    change the result; the entries of an index list from `limit` on count as invalid, with `causal` query i's
    from limit - Q + i + 1 on, and with `start` those before it).

    Returns [B, Hq, Q, d]. Every row must have at least one valid index. indices None: entry j is slot j of every
    row (K = N, S = valid's, or Hkv without it).
    """
    if indices is None:
        rows = valid.shape[1] if valid is not None else keys.shape[1]
        slots = torch.arange(keys.shape[2], device=keys.device)
        indices = slots.view(1, 1, 1, -1).expand(query.shape[0], rows, query.shape[2], -1)
    if valid is None:
        valid = torch.ones(indices.shape, dtype=torch.bool, device=indices.device)
    if limit is not None:
        entries = torch.arange(indices.shape[-1], device=indices.device)
        ends = limit.view(1)
        if causal:  # [Q, 1]: one past each query's own entry
            ends = limit.view(1, 1) - query.shape[2] + 1 + torch.arange(query.shape[2], device=indices.device)[:, None]
        valid = valid & (entries < ends)
        if start is not None:  # one first entry for every query, or one per (row, query)
            first = start.view(1) if start.numel() == 1 else start[:, None, :, None]
            valid = valid & (entries >= first)
    batch, num_heads, q_len, dim = query.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    mask = selection_mask(indices, valid, num_keys)
    if mask.shape[1] == num_kv_heads:  # one list per GQA group: the same for each of its query heads
        mask = mask[:, :, None].expand(batch, num_kv_heads, group, q_len, num_keys)
    # each kv head's group of query heads as G x Q query rows: no copy of K/V per query head
    rows = group * q_len
    mask = mask.reshape(batch, num_kv_heads, rows, num_keys)
    out = F.scaled_dot_product_attention(query.reshape(batch, num_kv_heads, rows, dim), keys, values,
                                         attn_mask=mask, scale=scaling)  # fmt: skip
    # reshape, not view: with a mask, CUDA's SDPA may return the rows in a layout of its own (torch 2.11, H200)
    return out.reshape(batch, num_heads, q_len, dim)


def sparse_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor | None,
    valid: torch.Tensor | None,
    scaling: float,
    *,
    tickets: torch.Tensor | None = None,
    limit: torch.Tensor | None = None,
    causal: bool = False,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op `sparsekv::sparse_attention`: the split-K Triton kernel on CUDA (any Q, GQA through S), the
    reference elsewhere.

    indices None: every slot of the buffer in order (entry j is slot j), the same for every row and query: the
    kernel then reads K/V rows in order without an index list (a dense read of a preallocated buffer).

    tickets: int32 [B * S * Q] zeros, owned by the caller and zero again after each call (e.g. a selector's
    `RowBuffer`): the split-K kernel then merges each row's partial outputs in the row's last program, one launch
    fewer. One call at a time per buffer (the counters are shared state).
    limit: an integer tensor of one element on the query's device: only the first `limit` entries of each index
    list are read, the others count as invalid. A fixed-shape step lists every slot of its preallocated buffer
    and passes the written ones, a device value: its graph then reads as far as the cache is filled, not the
    buffer's capacity.
    causal (needs `limit`): the entries just below `limit` are the Q queries' own tokens, in order (a forward of Q
    new tokens over a buffer of slots): query i reads none from limit - Q + i + 1 on. `valid` may then be one row
    for every query ([B, S, 1, K] expanded over Q), which the kernel reads once, not once per query.
    start (needs `limit`): an integer tensor of one element, or [B, Q] (each row's and query's own): the entries
    before it are not read either, and the splits of a row share the entries from its queries' least `start` to
    `limit` between them. A sliding-window layer's step over a buffer of slots passes the first slot each query's
    window reaches, so it reads its window, not the whole buffer."""
    if causal and limit is None:
        raise ValueError("causal attention needs `limit`: the entry after the queries' own tokens")
    if start is not None and limit is None:
        raise ValueError("start needs `limit`: the entries from `start` to `limit` are the ones read")
    rows = (query.shape[0], query.shape[2])
    for name, bound in (("limit", limit), ("start", start)):
        if bound is None:
            continue
        shaped = bound.numel() == 1 or (name == "start" and tuple(bound.shape) == rows)
        if not shaped or bound.dtype not in (torch.int32, torch.int64):
            allowed = "of one element" if name == "limit" else f"of one element or of shape {rows} (batch, queries)"
            raise ValueError(f"{name} must be an integer tensor {allowed}, got {bound.dtype} {tuple(bound.shape)}")
        if bound.device != query.device:
            raise ValueError(f"{name} is on {bound.device}, the query on {query.device}")
    if indices is None and valid is not None and valid.shape[-1] != keys.shape[2]:
        raise ValueError(f"without indices, valid lists every slot: {keys.shape[2]} entries, got {valid.shape[-1]}")
    if tickets is not None:
        lists = valid.shape[1] if indices is None and valid is not None else keys.shape[1]
        rows = query.shape[0] * query.shape[2] * (indices.shape[1] if indices is not None else lists)
        if tickets.dtype != torch.int32 or tickets.numel() < rows or not tickets.is_contiguous():
            raise ValueError(f"tickets must be a contiguous int32 tensor of at least {rows} zeros")
        if tickets.device != query.device:
            raise ValueError(f"tickets are on {tickets.device}, the query on {query.device}")
    return _sparse_attention_op(query, keys, values, indices, valid, float(scaling), tickets, limit, causal, start)


@torch.library.custom_op("sparsekv::sparse_attention", mutates_args=("tickets",))
def _sparse_attention_op(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor | None,
    valid: torch.Tensor | None,
    scaling: float,
    tickets: torch.Tensor | None,
    limit: torch.Tensor | None = None,
    causal: bool = False,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return sparse_attention_reference(query, keys, values, indices, valid, scaling, limit=limit, causal=causal,
                                      start=start)  # fmt: skip


@_sparse_attention_op.register_kernel("cuda")
def _sparse_attention_cuda(query, keys, values, indices, valid, scaling, tickets, limit=None, causal=False,
                           start=None):  # fmt: skip
    from sparsekv.kernels._triton import use_triton

    entries = keys.shape[2] if indices is None else indices.shape[-1]
    if (
        use_triton(query, keys, values, *([] if indices is None else [indices]))
        and entries > 0
        and keys.dtype == values.dtype == query.dtype
        and query.shape[-1] <= 256
    ):
        from sparsekv.kernels._sparse_attention_triton import sparse_attention_triton

        return sparse_attention_triton(query, keys, values, indices, valid, scaling, tickets=tickets, limit=limit,
                                       causal=causal, start=start)  # fmt: skip
    return sparse_attention_reference(query, keys, values, indices, valid, scaling, limit=limit, causal=causal,
                                      start=start)  # fmt: skip


@_sparse_attention_op.register_fake
def _sparse_attention_fake(query, keys, values, indices, valid, scaling, tickets, limit=None, causal=False,
                           start=None):  # fmt: skip
    return torch.empty_like(query)
