"""The Bradley–Terry ranking loss of Spotlight Attention.

For one query, B = hashed scores of its oracle top-k keys (positives), C = scores of other visible keys
(negatives); the loss is the mean over all valid pairs (i, j) of -log σ(β (B_i - C_j) - α): it only asks every
positive to outrank every negative and spends no capacity on the order inside B or inside C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ranking_loss(
    positive: torch.Tensor,
    positive_valid: torch.Tensor,
    negative: torch.Tensor,
    negative_valid: torch.Tensor,
    beta: float = 1.0,
    alpha: float = 0.0,
) -> torch.Tensor:
    """positive [..., P], negative [..., M] scores with bool validity masks of the same shapes -> scalar loss."""
    z = beta * (positive[..., :, None] - negative[..., None, :]) - alpha
    pair_valid = positive_valid[..., :, None] & negative_valid[..., None, :]
    pairs = pair_valid.sum()
    if pairs == 0:
        return positive.sum() * 0.0
    # -log σ(z) = softplus(-z)
    return (F.softplus(-z) * pair_valid).sum() / pairs
