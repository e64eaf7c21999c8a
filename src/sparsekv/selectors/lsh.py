"""Linear LSH (MagicPIG-style): sign random projections of q and k, score = matching bits.

The training-free baseline of the Spotlight paper: R is a random Gaussian matrix (SimHash) or a stack of
random rotations (QR of a Gaussian, first column flipped when det < 0, Spotlight appendix A.5). Keys may be
centred by the prompt's mean key first (MagicPIG), which removes the shared "cone" direction that otherwise
sets most bits alike for every key. Codes are packed 32 bits per int32 word and scored with `kernels.hamming`
(XNOR + popcount, summed over each kv-head's query group), the same path the Spotlight selector uses for its
learned codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.config import ConfigError
from sparsekv.kernels.bits import pack_sign_bits
from sparsekv.kernels.hamming import hamming_scores
from sparsekv.selectors.base import (
    RowBuffer,
    TokenSelector,
    fixed_hamming_selection,
    fixed_int_topk_selection,
    fused_hamming_selection,
    to_selection_heads,
    topk_selection,
)
from sparsekv.step import DecodeStep, Selection

LSH_VARIANTS = ("simhash", "rotation")
MAX_BITS = 4096
HASH_BLOCK = 1024


def unique_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Float ranks (0 = lowest) of each row's scores, ties broken towards later positions.

    Hamming scores are small integers, so ties are the rule; `torch.topk` would then pick among them depending
    on k and tensor shape, which breaks chunked == token-by-token and batch invariance. Exact as float32 below
    2**24 keys per row.
    """
    order = torch.argsort(scores, dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return ranks.float()


def projection_matrix(dim: int, bits: int, variant: str = "simhash", seed: int = 0) -> torch.Tensor:
    """[dim, bits] float32 hash projection (CPU generator, so the same seed gives the same codes on any
    device)."""
    if variant not in LSH_VARIANTS:
        raise ConfigError(f"lsh variant must be one of {', '.join(LSH_VARIANTS)}, got {variant!r}")
    generator = torch.Generator().manual_seed(seed)
    if variant == "simhash":
        return torch.randn(dim, bits, generator=generator, dtype=torch.float64).float()
    blocks = []
    for _ in range((bits + dim - 1) // dim):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        # sign fix makes Q Haar-distributed (QR alone is biased by the sign convention of R's diagonal)
        q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
        if torch.linalg.det(q) < 0:
            q[:, 0] = -q[:, 0]
        blocks.append(q)
    return torch.cat(blocks, dim=1)[:, :bits].float()


def hash_codes(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> packed sign codes int32 [..., ceil(bits/32)]."""
    return pack_sign_bits(torch.matmul(x.float(), projection))


def code_scores(
    query_codes: torch.Tensor, key_codes: torch.Tensor, bits: int, step: DecodeStep
) -> torch.Tensor:
    """Matching bits per selection head: [B, Hkv, Q, N] (group: summed over the group) or [B, Hq, Q, N]."""
    if step.gqa == "group":
        return hamming_scores(query_codes, key_codes, bits=bits)
    return hamming_scores(query_codes, key_codes.repeat_interleave(step.layer.group_size, dim=1), bits=bits)


def code_selection(
    query_codes: torch.Tensor, key_codes: torch.Tensor, bits: int, step: DecodeStep
) -> Selection:
    """Top-budget keys by Hamming similarity, ties broken towards recent keys (deterministic)."""
    scores = to_selection_heads(code_scores(query_codes, key_codes, bits, step), step)
    if step.hints is not None and step.hints.fixed:
        group = step.layer.group_size if step.gqa == "group" else 1
        if (fixed := fixed_int_topk_selection(scores, step, (0, group * bits))) is not None:
            return fixed
    return topk_selection(unique_ranks(scores), step)


class CodeBuffer:
    """Growable [B, H, N, W] int32 code store (doubling, so one appended token is O(1))."""

    def __init__(self) -> None:
        self.codes: torch.Tensor | None = None
        self.length = 0

    def append(self, codes: torch.Tensor) -> None:
        needed = self.length + codes.shape[-2]
        if self.codes is None or needed > self.codes.shape[-2]:
            grown = codes.new_zeros(*codes.shape[:-2], max(needed, 2 * self.length), codes.shape[-1])
            if self.codes is not None:
                grown[..., : self.length, :] = self.codes[..., : self.length, :]
            self.codes = grown
        self.codes[..., self.length : needed, :] = codes
        self.length = needed

    def view(self) -> torch.Tensor:
        return self.codes[..., : self.length, :]


@dataclass
class LSHSelector(TokenSelector):
    """Linear hashing baseline. Options: bits (128, 256, 512, 1024...), variant simhash|rotation,
    center_keys (subtract the prompt's mean key before hashing; a per-query constant shift of q·k, so it
    changes the codes but not the exact ranking), seed (one projection per layer, derived from it)."""

    name = "lsh"
    fixed_shape = True
    slot_state = True
    #: the dense fallback's default (H200, Llama-3-8B shapes, B4, budget 2%: 0.95x at 128K cached tokens over
    #: the batch, 1.005x at 256K, 1.32x at 512K (compiled))
    dense_below = 262_144
    bits: int = 1024
    variant: str = "simhash"
    center_keys: bool = True
    seed: int = 0

    @classmethod
    def check_config(cls, config) -> None:
        bits = config.options.get("bits", cls.bits)
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
            raise ConfigError(
                f"lsh bits must be an int in 1..{MAX_BITS} (e.g. 128, 256, 512, 1024), got {bits!r}"
            )
        variant = config.options.get("variant", cls.variant)
        if variant not in LSH_VARIANTS:
            raise ConfigError(f"lsh variant must be one of {', '.join(LSH_VARIANTS)}, got {variant!r}")
        if not isinstance(config.options.get("center_keys", True), bool):
            raise ConfigError("lsh center_keys must be true or false")
        if not isinstance(config.options.get("seed", 0), int):
            raise ConfigError("lsh seed must be an int")

    def __post_init__(self) -> None:
        self.threshold_hints = RowBuffer()
        self.projection = projection_matrix(
            self.layer.head_dim, self.bits, self.variant, self.seed * 100_003 + self.layer.layer_idx
        )
        self.prompt_length = 0
        self.key_mean: torch.Tensor | None = None
        self.key_codes = CodeBuffer()
        self._fixed = False  # fixed-shape decoding: new codes are written at the step's device position

    def prefill(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        # hashing waits for the first decode step: the centring mean must skip left-padding, and only
        # `step.visible` says which prompt positions are padding
        self.prompt_length = keys.shape[-2]

    def crop(self, length: int) -> None:
        self.key_codes.length = min(self.key_codes.length, length)  # the prompt's mean stays: length >= prompt

    def begin_fixed_shape(self, capacity: int) -> None:
        # the codes are complete: a fixed-shape step always follows at least one ordinary decode step
        codes = self.key_codes
        if codes.codes.shape[-2] < capacity:
            grown = codes.codes.new_zeros(*codes.codes.shape[:-2], capacity, codes.codes.shape[-1])
            grown[..., : codes.length, :] = codes.view()
            codes.codes = grown
        self._fixed = True

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        new = keys.float() if self.key_mean is None else keys.float() - self.key_mean
        self.key_codes.codes.index_copy_(-2, position, hash_codes(new, self.projection))

    def end_fixed_shape(self, length: int) -> None:
        self.key_codes.length = length
        self._fixed = False

    def _codes_view(self, step: DecodeStep) -> torch.Tensor:
        if self._fixed:
            return self.key_codes.codes[..., : step.keys.shape[-2], :]
        self._sync(step)
        return self.key_codes.view()

    def _sync(self, step: DecodeStep) -> None:
        keys = step.keys
        if self.projection.device != keys.device:
            self.projection = self.projection.to(keys.device)
        if self.key_codes.length == 0 and self.center_keys:
            real = step.visible[:, 0, : self.prompt_length].to(torch.float32)[:, None, :, None]  # [B,1,P,1]
            prompt = keys[..., : self.prompt_length, :].float()
            self.key_mean = (prompt * real).sum(2, keepdim=True) / real.sum(2, keepdim=True).clamp(min=1)
        # blocks bound the [tokens, bits] float and int64 temporaries of hashing a long prompt
        for lo in range(self.key_codes.length, keys.shape[-2], HASH_BLOCK):
            new = keys[..., lo : lo + HASH_BLOCK, :].float()
            if self.key_mean is not None:
                new = new - self.key_mean
            self.key_codes.append(hash_codes(new, self.projection))

    def score(self, step: DecodeStep) -> torch.Tensor:
        return code_scores(hash_codes(step.query, self.projection), self._codes_view(step), self.bits, step)

    def select(self, step: DecodeStep) -> Selection:
        codes = self._codes_view(step)
        query_codes = lambda: hash_codes(step.query, self.projection)
        fast = fixed_hamming_selection(query_codes, codes, self.bits, step, self.threshold_hints)
        if fast is not None:
            return fast
        fast = fused_hamming_selection(query_codes, codes, self.bits, step, self.threshold_hints)
        if fast is not None:
            return fast
        return code_selection(query_codes(), codes, self.bits, step)
