"""The self-index decode step on the kernels: the re-rank and the attention read only the listed tokens' bytes of
the compressed cache (`kernels.compressed_kv`), instead of gathering and dequantizing them into float32 tensors
in torch (`CompressedStore.read_keys` / `gather_dequantized`). Same results (tests compare them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsekv.kernels.compressed_kv import compressed_attention, compressed_key_scores
from sparsekv.kernels.lut_score import group_query

if TYPE_CHECKING:
    from sparsekv.selectors.self_index.store import CompressedStore
    from sparsekv.step import DecodeStep, Selection


def applies(kv: CompressedStore, step: DecodeStep) -> bool:
    """Compressed float32 state, rows per kv head (GQA "group"), and a device the kernels run on."""
    from sparsekv.kernels._triton import use_triton

    return (
        kv.compressed
        and kv.mu is not None
        and kv.mu.dtype == torch.float32
        and (step.gqa == "group" or step.query.shape[1] == kv.num_kv_heads)  # per-head rows: no GQA group
        and use_triton(step.query, kv.mu)
    )


def _tail_from(kv: CompressedStore, step: DecodeStep, device: torch.device) -> torch.Tensor:
    """`CompressedStore.tail_from` of the step's query positions. In a fixed-shape step the layers whose tails
    start alike share one (`StepHints.shared`): a few small kernels fewer per layer and step."""
    q_len = step.query.shape[2]
    hints = step.hints
    if hints is None or not hints.fixed or hints.shared is None or kv.fixed_position is None:
        return kv.tail_from(kv.query_positions(q_len, device))
    key = ("self-index tail from", kv.decode_start, kv.tail_start, kv.residual, kv.rows.view_length)
    if key not in hints.shared:
        hints.shared[key] = kv.tail_from(kv.query_positions(q_len, device))
    return hints.shared[key]


def candidate_scores(
    kv: CompressedStore, step: DecodeStep, index: torch.Tensor, summed: torch.Tensor | None = None,
    per_head: bool = False,
) -> torch.Tensor | None:
    """q . (K - mu) of `SelfIndexSelector._candidate_scores` on the kernels, or None where they do not apply:
    [B, Hkv, Q, C] for the group-summed query (`summed`: the step's `kernels.lut_score.group_query`, where the
    caller has it already), or with `per_head` [B, Hkv, G, Q, C], each query head of each group (one pass: a
    key is read once for the G heads)."""
    if not applies(kv, step):
        return None
    if per_head:
        b, hq, q_len, d = step.query.shape
        query = step.query.view(b, kv.num_kv_heads, hq // kv.num_kv_heads, q_len, d)
    else:
        query = group_query(step.query, kv.num_kv_heads) if summed is None else summed
    return compressed_key_scores(query, kv.kernel_view(), index, _tail_from(kv, step, index.device))


def attend(
    kv: CompressedStore, step: DecodeStep, selection: Selection, scaling: float, model_dtype: torch.dtype
) -> torch.Tensor | None:
    """`SelfIndexSelector.attend` on the kernels, or None where they do not apply. With v_rotate the kernels attend
    over the stored V R and return out R; `SelfIndexSelector.attend` un-rotates it. A 16-bit model's dots run at
    its precision (one TF32 pass) for the float32 query that the rotation makes."""
    if not applies(kv, step) or selection.indices.shape[1] != kv.num_kv_heads:
        return None
    return compressed_attention(step.query, kv.kernel_view(), selection.indices, selection.valid, scaling,
                                _tail_from(kv, step, step.query.device), tf32=model_dtype != torch.float32)  # fmt: skip
