"""The fixed orthogonal rotation R of a layer (`k_rotate`, `v_rotate`): R = diag(signs) x base, the signs a seeded
+-1 vector per layer, the base the normalised Hadamard matrix (a seeded QR rotation when head_dim is not a power of
two). Nothing of it is stored per token: a layer holds its d signs, the base is a constant regenerated from d."""

from __future__ import annotations

import math

import torch

V_ROTATE_SEED = 0x5E1F  # layer l's random signs come from torch.Generator().manual_seed(V_ROTATE_SEED + l)

_ROTATION_BASE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def rotation_base(
    d: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[d, d] orthogonal matrix shared by every layer: the Sylvester Hadamard matrix / sqrt(d) when d is a power of
    two, else the Q factor (columns sign-fixed by R's diagonal) of the QR of a Gaussian seeded with V_ROTATE_SEED.
    Built in float64, cached per (d, dtype, device): a constant of the code (like _BITREV4), not per-cache state."""
    device = torch.device(device)
    key = (d, dtype, device)
    if key not in _ROTATION_BASE:
        with torch.inference_mode(False):  # kept across calls: a constant usable outside inference mode too
            _ROTATION_BASE[key] = _make_rotation_base(d).to(dtype=dtype, device=device)
    return _ROTATION_BASE[key]


def _make_rotation_base(d: int) -> torch.Tensor:
    """`rotation_base` in float64 on the CPU."""
    if d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(d)
    gen = torch.Generator().manual_seed(V_ROTATE_SEED)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)


def rotation_signs(
    d: int, layer_idx: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[d] fixed +-1 of layer `layer_idx` (seed V_ROTATE_SEED + layer_idx)."""
    gen = torch.Generator().manual_seed(V_ROTATE_SEED + layer_idx)
    signs = torch.randint(0, 2, (d,), generator=gen).to(torch.float64) * 2 - 1
    return signs.to(dtype=dtype, device=device)


def value_rotation(
    d: int, layer_idx: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """R = diag(signs) x base [d, d] (orthogonal): the cache stores V' = V R; attention over V' gives out' = out R,
    and out = out' R^T."""
    return rotation_signs(d, layer_idx, dtype, device)[:, None] * rotation_base(d, dtype, device)
