"""Quest page scoring: an upper bound of q.k per page from each page's per-channel key min and max."""

from __future__ import annotations

import torch


def quest_page_scores_reference(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, *, group_reduce: str = "sum"
) -> torch.Tensor:
    """query [B, Hq, Q, d]; page_min/page_max [B, Hkv, P, d] -> sum_i max(q_i*max_i, q_i*min_i) as fp32,
    [B, Hkv, Q, P] reduced over each GQA group ("sum" or "max") or [B, Hq, Q, P] with group_reduce="none".

    Computed as two matmuls: for max_i >= min_i, max(q_i max_i, q_i min_i) = q_i c_i + |q_i| r_i with the centre
    c = (max + min) / 2 and the radius r = (max - min) / 2, so no [Q, P, d] product is ever formed. A page that
    holds no token yet (max -inf, min inf) has no finite score."""
    b, hq, q, d = query.shape
    hkv = page_min.shape[1]
    g = hq // hkv
    centre = (page_max.float() + page_min.float()) / 2
    radius = (page_max.float() - page_min.float()) / 2
    qg = query.float().reshape(b, hkv, g * q, d)  # the GQA group's query heads next to each other
    s = (qg @ centre.transpose(-1, -2) + qg.abs() @ radius.transpose(-1, -2)).reshape(b, hkv, g, q, -1)
    if group_reduce == "sum":
        return s.sum(2)
    if group_reduce == "max":
        return s.amax(2)
    if group_reduce == "none":
        return s.reshape(b, hq, q, -1)
    raise ValueError(f"group_reduce must be 'sum', 'max' or 'none', got {group_reduce!r}")


GROUP_REDUCTIONS = ("sum", "max", "none")


def quest_page_scores(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, *, group_reduce: str = "sum"
) -> torch.Tensor:
    """The op `sparsekv::quest_page_scores`: Quest upper-bound page scores (see the reference for shapes); the
    Triton kernel on CUDA, the reference elsewhere."""
    if group_reduce not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduce must be 'sum', 'max' or 'none', got {group_reduce!r}")
    return _quest_page_scores_op(query, page_min, page_max, group_reduce)


@torch.library.custom_op("sparsekv::quest_page_scores", mutates_args=())
def _quest_page_scores_op(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, group_reduce: str
) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return quest_page_scores_reference(query, page_min, page_max, group_reduce=group_reduce)


@_quest_page_scores_op.register_kernel("cuda")
def _quest_page_scores_cuda(query, page_min, page_max, group_reduce):
    from sparsekv.kernels._triton import kernel, use_triton

    if use_triton(query, page_min, page_max) and group_reduce in GROUP_REDUCTIONS:
        impl = kernel("_quest_triton", "quest_page_scores_triton")
        if impl is not None:
            return impl(query, page_min, page_max, group_reduce=group_reduce)
    return quest_page_scores_reference(query, page_min, page_max, group_reduce=group_reduce)


@_quest_page_scores_op.register_fake
def _quest_page_scores_fake(query, page_min, page_max, group_reduce):
    heads = query.shape[1] if group_reduce == "none" else page_min.shape[1]
    return query.new_empty((query.shape[0], heads, query.shape[2], page_min.shape[2]), dtype=torch.float32)
