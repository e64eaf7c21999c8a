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
def pdl_enter(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and newer): wait until the previous kernel's writes are visible, then let the
    next kernel's launch start. Called first in a kernel, so nothing is read or written before the wait; what
    overlaps is the next kernel's launch and scheduling latency."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
