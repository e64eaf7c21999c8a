"""The self-index decode step on the kernels: the re-rank and the attention read only the listed tokens' bytes of
the compressed cache (`kernels.compressed_kv`), instead of gathering and dequantizing them into float32 tensors
in torch. Same results as `SelfIndexSelector`'s torch path (tests compare them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsekv.kernels.compressed_kv import CompressedKV, compressed_attention, compressed_key_scores

if TYPE_CHECKING:
    from sparsekv.selectors.base import DecodeStep, Selection
    from sparsekv.selectors.self_index import SelfIndexSelector


def applies(sel: SelfIndexSelector, step: DecodeStep) -> bool:
    """Compressed float32 state, rows per kv head (GQA "group"), and a device the kernels run on."""
    from sparsekv.kernels._triton import use_triton

    return (
        sel.compressed
        and sel.mu is not None
        and sel.mu.dtype == torch.float32
        and (step.gqa == "group" or sel.layer.group_size == 1)
        and use_triton(step.query, sel.mu)
    )


def compressed_view(sel: SelfIndexSelector) -> CompressedKV:
    store = sel._store
    channel = sel.k_axis == "channel"
    tail = sel.residual > 0 and sel._tail.length > 0
    return CompressedKV(
        sign_bits=store.view("sign_bits"),
        k_mag=store.view("k_mag"),
        k_scale=sel._k_blocks.view("k_scale") if channel else store.view("k_scale"),
        k_zero=store.view("k_zero") if sel.k_zero else None,
        v=store.view("v"),
        v_scale=store.view("v_scale"),
        v_zero=store.view("v_zero"),
        mu=sel.mu,
        alpha=sel.alpha,
        k_bits=sel.k_bits,
        v_bits=sel.kv_bits,
        midrise=sel.k_midrise,
        k_scale_tokens=sel.k_group if channel else 1,
        k_scale_offset=sel._k_pad if channel else 0,
        sink_positions=sel.sink_positions,
        sink_keys=sel.sink_keys,
        sink_values=sel.sink_values,
        tail_keys=sel._tail.view("k") if tail else None,
        tail_values=sel._tail.view("v") if tail else None,
        tail_first=sel._tail_start,
    )


def tail_from(sel: SelfIndexSelector, q_len: int, device: torch.device) -> torch.Tensor:
    """[Q]: the first position each query reads from the 16-bit tail (its residual block, within the tail)."""
    n = sel._store.length
    positions = torch.arange(n - q_len, n, device=device)
    if sel.residual <= 0:
        return torch.full_like(positions, n)
    block = sel.decode_start + (positions - sel.decode_start) // sel.residual * sel.residual
    return block.clamp(min=sel._tail_start)


def candidate_scores(sel: SelfIndexSelector, step: DecodeStep, index: torch.Tensor) -> torch.Tensor | None:
    """`SelfIndexSelector._candidate_scores` on the kernels, or None where they do not apply."""
    if not applies(sel, step):
        return None
    b, _, q_len, d = step.query.shape
    query = step.query.float().view(b, sel.layer.num_kv_heads, -1, q_len, d).sum(2)
    return compressed_key_scores(query, compressed_view(sel), index, tail_from(sel, q_len, index.device))


def attend(sel: SelfIndexSelector, step: DecodeStep, selection: Selection, scaling: float) -> torch.Tensor | None:
    """`SelfIndexSelector.attend` on the kernels, or None where they do not apply. With v_rotate the kernels attend
    over the stored V R and return out R; `SelfIndexSelector.attend` un-rotates it."""
    if not applies(sel, step) or selection.indices.shape[1] != sel.layer.num_kv_heads:
        return None
    q_len = step.query.shape[2]
    return compressed_attention(step.query, compressed_view(sel), selection.indices, selection.valid, scaling,
                                tail_from(sel, q_len, step.query.device))  # fmt: skip
