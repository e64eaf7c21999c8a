"""Shared dispatch helpers: whether a Triton kernel may run for some tensors, PDL, and the launch limits."""

from __future__ import annotations

import functools
import os

import torch

try:  # triton is an optional dependency (extra "gpu"); without it every op runs its torch reference
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Kernels run on CUDA tensors; under TRITON_INTERPRET=1 also on CPU tensors (tests)."""
    if not HAS_TRITON or os.environ.get("SPARSEKV_DISABLE_TRITON", "0") == "1":
        return False
    if interpreting():
        return True
    return all(t.is_cuda for t in tensors)


# programmatic dependent launch for the decode-step kernels (SPARSEKV_PDL=0 turns it off, e.g. to measure it)
PDL = {"on": os.environ.get("SPARSEKV_PDL", "1") != "0"}


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch(device: torch.device) -> dict:
    """Launch arguments of a kernel that starts with `pdl_enter`: PDL on CUDA devices of compute capability >= 9
    (never in the interpreter)."""
    on = PDL["on"] and device.type == "cuda" and not interpreting()
    on = on and _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9
    return {"USE_PDL": True, "launch_pdl": True} if on else {}


def register_cap(device: torch.device, registers: int) -> dict:
    """Launch arguments that cap a kernel's registers a thread (PTX .maxnreg) on CUDA; none in the interpreter."""
    return {"maxnreg": registers} if device.type == "cuda" and not interpreting() else {}


# CUDA's grid limits: programs per launch along axis x, y, z. A launch beyond them fails with the bare
# "Triton Error [CUDA]: invalid argument" (2 x 32 heads x 16K queries = 1M rows on axis y did, on an H100).
MAX_GRID = (2**31 - 1, 65535, 65535)
# Triton's limit on the elements of one block-level tensor (e.g. a [GC, SP, DP] tile): compilation fails above
MAX_TENSOR_NUMEL = 1 << 20


class LaunchLimitError(ValueError):
    """A kernel launch that would exceed a CUDA / Triton launch limit (the launchers split what they can)."""


def check_grid(op: str, shape, grid: tuple[int, ...]) -> tuple[int, ...]:
    """`grid` itself, or LaunchLimitError naming the op, the shape and the limit where an axis is too long."""
    for axis, (programs, limit) in enumerate(zip(grid, MAX_GRID)):
        if programs > limit:
            raise LaunchLimitError(
                f"{op}: shape {tuple(shape)} needs {programs} programs on grid axis {'xyz'[axis]}, "
                f"above CUDA's limit of {limit}"
            )
    return grid


@functools.lru_cache(maxsize=256)
def split_rows(rows: int, max_y: int, max_z: int) -> tuple[int, int] | None:
    """(y, z) with y * z == rows exactly, y <= max_y and z <= max_z, with the fewest z; None where none exists
    (a prime factor above max_y, or more than max_y * max_z rows)."""
    if rows <= max_y:
        return rows, 1
    for z in range(-(-rows // max_y), min(rows, max_z) + 1):
        if rows % z == 0:
            return rows // z, z
    return None


def row_grid(op: str, shape, per_row: int, rows: int) -> tuple[int, int, int]:
    """Grid (per_row, y, z) of a kernel with `per_row` programs (chunks, splits, blocks) for each of `rows`
    rows (batch x heads x queries); the kernel's row is y + z * Y (`_tl_utils.chunk_and_row`). Rows beyond
    axis y's 65535 continue on axis z, in a split with y * z == rows: no program past the last row (the
    kernels have no bounds check for it), and the program order of a (per_row, rows) grid. (Axis x alone
    would take every program, but the division per program cost the attention kernel 11 registers.)"""
    yz = split_rows(rows, MAX_GRID[1], MAX_GRID[2]) if rows <= MAX_GRID[0] else None  # rows index in int32
    if yz is None:
        raise LaunchLimitError(
            f"{op}: shape {tuple(shape)} has {rows} rows (batch x heads x queries), which no grid of at most "
            f"{MAX_GRID[1]} x {MAX_GRID[2]} programs covers exactly; pass fewer queries per call"
        )
    return check_grid(op, shape, (per_row, *yz))


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def kernel(module: str, name: str):
    """The Triton implementation `name` of sparsekv.kernels.<module>, or None where that module is absent."""
    import importlib

    try:
        mod = importlib.import_module(f"sparsekv.kernels.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != f"sparsekv.kernels.{module}":
            raise
        return None
    return getattr(mod, name)
