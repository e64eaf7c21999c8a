"""New tokens' K/V written into preallocated buffers at device slots (a fixed-shape step's cache write)."""

from __future__ import annotations

import torch


def write_slots_reference(key_buffer: torch.Tensor, value_buffer: torch.Tensor, slots: torch.Tensor,
                          keys: torch.Tensor, values: torch.Tensor) -> None:  # fmt: skip
    """keys/values [B, H, n, d] into key_buffer/value_buffer [B, H, capacity, d] at slots [n], in place."""
    key_buffer.index_copy_(-2, slots, keys)
    value_buffer.index_copy_(-2, slots, values)


def write_slots(key_buffer: torch.Tensor, value_buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:  # fmt: skip
    """The op `sparsekv::write_slots`: keys and values [B, H, n, d] into the buffers [B, H, capacity, d] at slots
    [n] (int64 on their device), in place. On CUDA one Triton launch writes both: `index_copy_` takes one launch
    for each, and two where a buffer spans more than 2 GiB (TensorIterator's 32-bit offsets), four launches a
    layer per step at Gemma 3 270M's 32K x B128. The reference elsewhere."""
    for name, buffer, new in (("keys", key_buffer, keys), ("values", value_buffer, values)):
        if buffer.dim() != 4 or new.dim() != 4 or new.shape[:2] != buffer.shape[:2] or new.shape[3] != buffer.shape[3]:
            raise ValueError(f"{name} {tuple(new.shape)} do not fit their buffer {tuple(buffer.shape)} ([B, H, n, d])")
        if new.dtype != buffer.dtype or new.device != buffer.device:
            raise ValueError(f"{name} are {new.dtype} on {new.device}, their buffer {buffer.dtype} on {buffer.device}")
        if buffer.stride(-1) != 1:
            raise ValueError(f"the {name}' buffer must be contiguous in its last dimension")
    if not (slots.dim() == 1 and slots.dtype == torch.int64 and slots.numel() == keys.shape[2] == values.shape[2]):
        raise ValueError(f"slots must be int64 [n] for the {keys.shape[2]} new keys and {values.shape[2]} values, "
                         f"got {slots.dtype} {tuple(slots.shape)}")  # fmt: skip
    if slots.device != key_buffer.device:
        raise ValueError(f"slots are on {slots.device}, the buffers on {key_buffer.device}")
    _write_slots_op(key_buffer, value_buffer, slots, keys, values)


@torch.library.custom_op("sparsekv::write_slots", mutates_args=("key_buffer", "value_buffer"))
def _write_slots_op(key_buffer: torch.Tensor, value_buffer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:  # fmt: skip
    """CPU (and any device without its own kernel): the reference."""
    write_slots_reference(key_buffer, value_buffer, slots, keys, values)


@_write_slots_op.register_kernel("cuda")
def _write_slots_cuda(key_buffer, value_buffer, slots, keys, values):
    from sparsekv.kernels._triton import kernel, use_triton

    impl = kernel("_write_slots_triton", "write_slots_triton") if use_triton(key_buffer, slots, keys) else None
    if impl is None:
        write_slots_reference(key_buffer, value_buffer, slots, keys, values)
    else:
        impl(key_buffer, value_buffer, slots, keys, values)


@_write_slots_op.register_fake
def _write_slots_fake(key_buffer, value_buffer, slots, keys, values):
    return None
