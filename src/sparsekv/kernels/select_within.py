"""Each row's own budget of its best candidates: the last stage of a two-stage selection (a few thousand candidates
per row, a budget per row), exact and without a sort on the GPU."""

from __future__ import annotations

import torch

MAX_KERNEL_CANDIDATES = 16384  # candidates per row that the kernel holds in registers (more: the reference)


def select_within_reference(values: torch.Tensor, budgets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rule of `select_within`: a stable sort ranks each row (ties to the lower index), the first
    min(budget, k) finite ones are kept, and their indices come out in ascending order."""
    c = values.shape[-1]
    index = torch.arange(c, device=values.device)
    order = torch.sort(values.float(), dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, index.expand_as(order))
    kept = (ranks < budgets.clamp(max=k)[..., None]) & (values > float("-inf"))
    slots = torch.where(kept, index, c + index).sort(dim=-1).values[..., :k]
    if slots.shape[-1] < k:  # fewer candidates than k: the rest of the slots are empty
        slots = torch.cat([slots, slots.new_full((*slots.shape[:-1], k - c), 2 * c)], dim=-1)
    valid = slots < c
    return torch.where(valid, slots, 0), valid


def select_within(values: torch.Tensor, budgets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., C] float (-inf: never kept), budgets [...] int64 -> (index [..., k] int64, valid [..., k]
    bool): each row's min(budget, k) largest values, equal values to the lower index, their indices ascending in
    the first slots (the other slots index 0, not valid).

    The op `sparsekv::select_within`: on CUDA one program per row finds the exact threshold by a 4-bit radix
    search in registers and writes the kept indices compacted (rows of at most MAX_KERNEL_CANDIDATES; longer
    rows take the reference); the reference elsewhere."""
    if budgets.shape != values.shape[:-1]:
        raise ValueError(f"budgets {tuple(budgets.shape)} must have the rows' shape {tuple(values.shape[:-1])}")
    if not values.is_floating_point() or budgets.dtype != torch.int64:
        raise ValueError(f"values must be floating point and budgets int64, got {values.dtype} / {budgets.dtype}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return _select_within_op(values, budgets, int(k))


@torch.library.custom_op("sparsekv::select_within", mutates_args=())
def _select_within_op(values: torch.Tensor, budgets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return select_within_reference(values, budgets, k)


@_select_within_op.register_kernel("cuda")
def _select_within_cuda(values, budgets, k):
    from sparsekv.kernels._triton import kernel, use_triton

    if use_triton(values, budgets) and 0 < values.shape[-1] <= MAX_KERNEL_CANDIDATES and k > 0:
        impl = kernel("_select_within_triton", "select_within_triton")
        if impl is not None:
            return impl(values, budgets, k)
    return select_within_reference(values, budgets, k)


@_select_within_op.register_fake
def _select_within_fake(values, budgets, k):
    shape = (*values.shape[:-1], k)
    return values.new_empty(shape, dtype=torch.int64), values.new_empty(shape, dtype=torch.bool)
