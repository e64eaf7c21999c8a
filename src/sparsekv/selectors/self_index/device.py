"""The self-index decode step's reads of the compressed cache, through the ops of `kernels.compressed_kv`: the
re-rank's q . K over candidate rows and the attention over the selected rows (or, after a re-rank, over the
picked candidates with their re-rank scores as logits: V alone) read only the listed tokens' bytes
(the Triton kernels on CUDA, the ops' references elsewhere: `compressed_kv.dequantized_rows`, the one definition
of such a read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsekv.kernels.compressed_kv import compressed_attention, compressed_key_scores, scored_attention
from sparsekv.kernels.lut_score import group_query

if TYPE_CHECKING:
    from sparsekv.selectors.self_index.store import CompressedStore
    from sparsekv.step import DecodeStep, Selection

#: elements of the largest [B, S, Q, K, d] rows a call of a reference dequantizes at once (queries in slices): the
#: references materialise the rows they read, the kernels do not
REFERENCE_ELEMENTS = 1 << 22


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


def _query_slices(query: torch.Tensor, rows: torch.Tensor, group: int = 1) -> list[slice]:
    """Slices of the queries (dim -2 of query, -2 of rows [B, S, Q, K]) that a reference reads at once; one slice
    where the kernels run."""
    q_len = rows.shape[2]
    if query.is_cuda:
        return [slice(0, q_len)]
    per_query = max(1, rows.shape[0] * rows.shape[1] * rows.shape[3] * query.shape[-1] * group)
    chunk = max(1, REFERENCE_ELEMENTS // per_query)
    return [slice(lo, min(q_len, lo + chunk)) for lo in range(0, q_len, chunk)]


def candidate_scores(
    kv: CompressedStore, step: DecodeStep, index: torch.Tensor, summed: torch.Tensor | None = None,
    per_head: bool = False,
) -> torch.Tensor:
    """q . (K - mu), float32, of the candidate rows `index` [B, S, Q, C] (S = kv heads, or query heads for
    gqa="head"): [B, S, Q, C] for the group-summed query (`summed`: the step's `kernels.lut_score.group_query`,
    where the caller has it already) or the rows' own query heads, or with `per_head` [B, Hkv, G, Q, C], each
    query head of each group (one pass: a key is read once for the G heads)."""
    b, hq, q_len, d = step.query.shape
    view = kv.kernel_view()
    if per_head:
        query = step.query.view(b, kv.num_kv_heads, hq // kv.num_kv_heads, q_len, d)
    elif index.shape[1] == kv.num_kv_heads:
        query = group_query(step.query, kv.num_kv_heads) if summed is None else summed
    else:  # rows of their own per query head
        query, view = step.query, view.per_query_head(hq // kv.num_kv_heads)
    tail_from = _tail_from(kv, step, index.device)
    parts = [compressed_key_scores(query[..., part, :], view, index[:, :, part], tail_from[part])
             for part in _query_slices(query, index, query.shape[2] if per_head else 1)]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def attend(
    kv: CompressedStore, step: DecodeStep, selection: Selection, scaling: float, model_dtype: torch.dtype
) -> torch.Tensor:
    """`SelfIndexSelector.attend` over the compressed cache [B, Hq, Q, d]. With v_rotate it attends over the
    stored V R and returns out R; `SelfIndexSelector.attend` un-rotates it. A 16-bit model's dots run at its
    precision (one TF32 pass) for the float32 query that the rotation makes."""
    hq = step.query.shape[1]
    view, indices = kv.kernel_view(), selection.indices
    if indices.shape[1] != kv.num_kv_heads:  # rows of their own per query head
        view = view.per_query_head(hq // kv.num_kv_heads)
    tail_from = _tail_from(kv, step, step.query.device)
    tf32 = model_dtype != torch.float32
    parts = [compressed_attention(step.query[:, :, part], view, indices[:, :, part], selection.valid[:, :, part],
                                  scaling, tail_from[part], tf32=tf32)
             for part in _query_slices(step.query, indices)]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def attend_scored(
    kv: CompressedStore, step: DecodeStep, selection: Selection, scores: torch.Tensor, pick: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`attend` for a selection of re-ranked candidates: each selected entry's logits are its re-rank scores
    (`candidate_scores` per head [B, Hkv, G, Q, C]; pick [B, Hkv, Q, K] = its candidate), so only V is read."""
    view, indices = kv.kernel_view(), selection.indices
    tail_from = _tail_from(kv, step, step.query.device)
    parts = [scored_attention(scores[:, :, :, part], pick[:, :, part], view, indices[:, :, part],
                              selection.valid[:, :, part], scaling, tail_from[part], step.query.dtype)
             for part in _query_slices(step.query, indices)]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
