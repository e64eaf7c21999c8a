"""The self-index's 1-bit index: sign-pattern codes of the centred keys and the one-pass codebook.

Each key is split into groups of GROUP_DIMS = 4 channels; the sign pattern of a group is a 4-bit code (first channel
of the group = most significant bit, +1 -> 1, -1/0 -> 0). The codebook holds, per group, the 16 centroids: the means
of the centred prompt keys having each sign pattern. The stored form of the codes is the packed sign bits
(`kernels.bits.pack_sign_bits`, channel c in bit c % 32 of word c // 32), which is also the sign of the stored key.
"""

from __future__ import annotations

import torch

GROUP_DIMS = 4  # channels per sign-pattern group (16 centroids per group)

# 4-bit value with channel i of the group in bit i  ->  code with channel 0 as the most significant bit
_BITREV4 = torch.tensor([int(f"{i:04b}"[::-1], 2) for i in range(16)], dtype=torch.uint8)
# sign of each channel of a code's pattern: [16, 4], +1 where the bit is set
_PATTERN_SIGNS = torch.tensor([[1.0 if (c >> (3 - i)) & 1 else -1.0 for i in range(4)] for c in range(16)])
_BITREV4_ON: dict[torch.device, torch.Tensor] = {}


def bitrev4(device: torch.device) -> torch.Tensor:
    """_BITREV4 on `device`, copied once (a host-to-device copy per step would also break CUDA graph capture)."""
    if device not in _BITREV4_ON:
        with torch.inference_mode(False):  # kept across calls: a constant usable outside inference mode too
            _BITREV4_ON[device] = _BITREV4.to(device).clone()
    return _BITREV4_ON[device]


def sign_codes(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] (d % 4 == 0) -> uint8 [..., d/4]: Code = sum_i [x_i > 0] * 2^(3-i) per group of 4 channels."""
    bits = (x > 0).to(torch.uint8).unflatten(-1, (-1, GROUP_DIMS))
    # built on the device (no host-to-device copy: decode steps must be capturable in a CUDA graph)
    weights = (1 << torch.arange(GROUP_DIMS - 1, -1, -1, device=x.device)).to(torch.uint8)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def codes_from_sign_bits(words: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int32 [..., W] packed by `pack_sign_bits` -> uint8 [..., head_dim/4] codes (same as `sign_codes`)."""
    groups = head_dim // GROUP_DIMS
    g = torch.arange(groups, device=words.device)
    word = words[..., g // 8]
    nibble = (word >> (4 * (g % 8)).to(torch.int32)) & 0xF
    return bitrev4(words.device)[nibble.long()]


def one_pass_centroids(
    centred: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Codebook [B, H, G, 16, 4]: mean of the (centred) key groups having each sign pattern.

    centred [B, H, N, d], codes [B, H, N, G], mask [B, N] bool (padding = False) or None. A pattern no key has
    gets its signs times the group's mean absolute values (where a key with that pattern would most likely sit).
    """
    b, h, n, d = centred.shape
    groups = d // GROUP_DIMS
    x = centred.unflatten(-1, (groups, GROUP_DIMS)).permute(0, 1, 3, 2, 4)  # [B, H, G, N, 4]
    weight = torch.ones(b, 1, 1, n, 1, dtype=x.dtype, device=x.device)
    if mask is not None:
        weight = mask.to(x.dtype).view(b, 1, 1, n, 1)
    index = codes.long().permute(0, 1, 3, 2)[..., None]  # [B, H, G, N, 1]
    sums = torch.zeros(b, h, groups, 16, GROUP_DIMS, dtype=x.dtype, device=x.device)
    sums.scatter_add_(3, index.expand(-1, -1, -1, -1, GROUP_DIMS), x * weight)
    counts = torch.zeros(b, h, groups, 16, 1, dtype=x.dtype, device=x.device)
    counts.scatter_add_(3, index, weight.expand(-1, h, groups, -1, -1).contiguous())
    total = weight.sum(3, keepdim=True).clamp(min=1)  # [B, 1, 1, 1, 1]
    fallback = (x.abs() * weight).sum(3, keepdim=True) / total * _PATTERN_SIGNS.to(x)  # [B, H, G, 16, 4]
    return torch.where(counts > 0, sums / counts.clamp(min=1), fallback)
