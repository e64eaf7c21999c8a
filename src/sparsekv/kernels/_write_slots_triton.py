"""One launch writes a step's new keys and values into their buffers at device slots (`write_slots`)."""

from __future__ import annotations

import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import pdl_enter
from sparsekv.kernels._triton import check_grid, next_pow2, pdl_launch


@triton.jit
def _write_slots_kernel(key_buffer, value_buffer, slots, keys, values, H, N, skb, skh, skn, svb, svh, svn, snkb,
                        snkh, snkn, snvb, snvh, snvn, D: tl.constexpr, DP: tl.constexpr,
                        USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(USE_PDL)
    program = tl.program_id(0)  # (b * H + h) * N + token
    token = program % N
    h = (program // N) % H
    b = (program // N) // H
    slot = tl.load(slots + token).to(tl.int64)
    d = tl.arange(0, DP)
    inside = d < D
    b, h, token = b.to(tl.int64), h.to(tl.int64), token.to(tl.int64)
    key = tl.load(keys + b * snkb + h * snkh + token * snkn + d, mask=inside)
    value = tl.load(values + b * snvb + h * snvh + token * snvn + d, mask=inside)
    tl.store(key_buffer + b * skb + h * skh + slot * skn + d, key, mask=inside)
    tl.store(value_buffer + b * svb + h * svh + slot * svn + d, value, mask=inside)


def write_slots_triton(key_buffer, value_buffer, slots, keys, values) -> None:
    """`write_slots.write_slots` on the device (arguments checked there)."""
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    batch, heads, new, dim = keys.shape
    grid = check_grid("write_slots", keys.shape, (batch * heads * new,))
    _write_slots_kernel[grid](
        key_buffer, value_buffer, slots, keys, values, heads, new, *key_buffer.stride()[:3],
        *value_buffer.stride()[:3], *keys.stride()[:3], *values.stride()[:3], D=dim, DP=next_pow2(dim),
        **pdl_launch(keys.device),
    )  # fmt: skip
