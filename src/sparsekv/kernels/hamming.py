"""Hamming similarity of packed sign codes (XNOR + popcount), summed over each kv-head's GQA group."""

from __future__ import annotations

import torch

from sparsekv.kernels.bits import check_code_shapes, popcount32


def _word_masks(words: int, bits: int, device: torch.device) -> torch.Tensor:
    """int32 [words]: the valid bits of each word (padding bits beyond `bits` never count as matches)."""
    if not 0 < bits <= 32 * words:
        raise ValueError(f"bits={bits} does not fit in {words} int32 words")
    masks = []
    for w in range(words):
        n = min(32, bits - 32 * w)
        m = 0 if n <= 0 else (1 << n) - 1
        masks.append(m - 2**32 if m >= 2**31 else m)
    return torch.tensor(masks, dtype=torch.int32, device=device)


def hamming_scores_reference(
    query_codes: torch.Tensor, key_codes: torch.Tensor, *, bits: int, chunk: int = 4096
) -> torch.Tensor:
    """query_codes [B, Hq, Q, W], key_codes [B, Hkv, N, W] int32 -> [B, Hkv, Q, N] int32 matching bits,
    summed over the query heads of each kv-head's group (query head h belongs to kv head h // g)."""
    hkv, g = check_code_shapes(query_codes, key_codes)
    b, _, q, w = query_codes.shape
    n = key_codes.shape[2]
    masks = _word_masks(w, bits, query_codes.device)
    qc = query_codes.reshape(b, hkv, g, q, 1, w)
    out = torch.empty(b, hkv, q, n, dtype=torch.int32, device=query_codes.device)
    # chunk over keys: the xor tensor is g*Q*W times larger than the key codes
    for start in range(0, n, chunk):
        kc = key_codes[:, :, None, None, start : start + chunk, :]
        diff = popcount32((qc ^ kc) & masks).sum(dim=(2, 5), dtype=torch.int32)
        out[..., start : start + chunk] = g * bits - diff
    return out


def _signs(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes [..., W] -> float32 [..., bits] in {-1, +1}."""
    shifts = torch.arange(32, dtype=torch.int32, device=codes.device)
    unpacked = (codes[..., None] >> shifts) & 1
    return unpacked.flatten(-2)[..., :bits].to(torch.float32) * 2 - 1


def hamming_scores_matmul(query_codes: torch.Tensor, key_codes: torch.Tensor, *, bits: int) -> torch.Tensor:
    """Same result as the reference through one matmul of unpacked signs: matches = (bits + s_q . s_k) / 2.

    The CPU path: BLAS beats bitwise popcount here by an order of magnitude, and the sums are small integers,
    exact in float32."""
    hkv, g = check_code_shapes(query_codes, key_codes)
    _word_masks(query_codes.shape[-1], bits, query_codes.device)  # validates bits
    b, _, q, _ = query_codes.shape
    query_signs = _signs(query_codes, bits).view(b, hkv, g * q, bits)
    dots = torch.matmul(query_signs, _signs(key_codes, bits).transpose(-1, -2))
    matches = dots.view(b, hkv, g, q, -1).sum(2) + g * bits
    return (matches / 2).to(torch.int32)


def hamming_scores(query_codes: torch.Tensor, key_codes: torch.Tensor, *, bits: int) -> torch.Tensor:
    """Matching bits per (kv head, query, key), summed over the GQA group: [B, Hkv, Q, N] int32."""
    from sparsekv.kernels._triton import use_triton

    if use_triton(query_codes, key_codes):
        from sparsekv.kernels._hamming_triton import hamming_scores_triton

        return hamming_scores_triton(query_codes, key_codes, bits=bits)
    if query_codes.device.type == "cpu":
        return hamming_scores_matmul(query_codes, key_codes, bits=bits)
    return hamming_scores_reference(query_codes, key_codes, bits=bits)


def hamming_topk_reference(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    *,
    bits: int,
    recent_first: bool = False,
    sink: int = 0,
    local: int = 0,
) -> torch.Tensor:
    """The exact rule of `hamming_topk`: the k keys of highest score, equal scores to the lower position (the
    higher one with `recent_first`), the first `sink` and last `local` keys always in."""
    scores = hamming_scores_reference(query_codes, key_codes, bits=bits).to(torch.int64)
    n = scores.shape[-1]
    k = min(int(k), n)
    position = torch.arange(n, device=scores.device)
    forced = (position < sink) | (position >= n - local)
    scores = torch.where(forced, scores.new_tensor(bits * 1_000_000), scores)  # above any group sum
    tie = position if recent_first else (n - 1) - position
    return torch.topk(scores * (n + 1) + tie, k, dim=-1, sorted=False).indices


def hamming_topk(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    *,
    bits: int,
    recent_first: bool = False,
    sink: int = 0,
    local: int = 0,
) -> torch.Tensor:
    """Indices [B, Hkv, Q, min(k, N)] int64 (unordered) of the k keys with the most matching bits per kv head.

    Equal scores go to the lower position (`recent_first`: the higher one); the first `sink` and the last `local`
    keys are always in (sink + local <= k). On CUDA scoring and the histogram pass are one kernel (int16 scores),
    then threshold + compaction: no sort.
    """
    from sparsekv.kernels._triton import use_triton

    if sink < 0 or local < 0 or sink + local > k:
        raise ValueError(f"sink ({sink}) + local ({local}) must be non-negative and fit in k ({k})")
    if use_triton(query_codes, key_codes) and 0 < k < key_codes.shape[2]:
        from sparsekv.kernels._hamming_triton import hamming_topk_triton

        return hamming_topk_triton(
            query_codes, key_codes, int(k), bits=bits, recent_first=recent_first, sink=sink, local=local
        )
    return hamming_topk_reference(
        query_codes, key_codes, k, bits=bits, recent_first=recent_first, sink=sink, local=local
    )
