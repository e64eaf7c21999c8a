"""Shared dispatch helpers: whether a Triton kernel may run for some tensors, and the SWAR popcount."""

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
