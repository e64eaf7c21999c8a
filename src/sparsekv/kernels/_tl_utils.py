"""Triton device helpers shared by the kernels. Imported only by kernel modules, so that the decision between
the compiler and the CPU interpreter (TRITON_INTERPRET, read when a function is decorated) is the same for all."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None


@triton.jit
def popcount32_tl(x):
    # SWAR with arithmetic shifts: every mask clears the sign-extended top bits, and the final
    # byte sum avoids the 32-bit multiply (signed overflow)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def popcount_tl(x, USE_POPC: tl.constexpr):
    if USE_POPC:
        return libdevice.popc(x)
    else:
        return popcount32_tl(x)


@triton.jit
def chunk_and_row():
    """(chunk, row) of this program in a `_triton.row_grid` launch: the chunk on grid axis x, the row (over
    batch x heads x queries) on axes y and z, row = y + z * (programs on axis y)."""
    return tl.program_id(0), tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and newer): wait until the previous kernel's writes are visible, then let the
    next kernel's launch start. Called first in a kernel, so nothing is read or written before the wait; what
    overlaps is the next kernel's launch and scheduling latency."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def scatter_store_i64(ptr, value, mask, INLINE: tl.constexpr):
    """Masked store of int64 values at data-dependent addresses. tl.store gives pointers of unknown contiguity a
    layout of their own (one element per thread, cyclic), and moving 64-bit addresses and masks into it is a
    shared-memory round trip with barriers on every call. INLINE (GPU only; the interpreter runs no PTX) stores
    each element from the thread that already holds it."""
    if INLINE:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,l,r",
            [ptr, value, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptr, value, mask=mask)
