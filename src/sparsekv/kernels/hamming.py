"""Hamming similarity of packed sign codes (XNOR + popcount), summed over each kv-head's GQA group."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from sparsekv.kernels.bits import check_code_shapes, popcount32


def _check_bits(words: int, bits: int) -> None:
    if not 0 < bits <= 32 * words:
        raise ValueError(f"bits={bits} does not fit in {words} int32 words")


def _word_masks(words: int, bits: int, device: torch.device) -> torch.Tensor:
    """int32 [words]: the valid bits of each word (padding bits beyond `bits` never count as matches)."""
    _check_bits(words, bits)
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
    """int32 codes [..., W] -> float32 [..., bits] in {-1, +1} (bit i of word w is sign w * 32 + i)."""
    if sys.byteorder == "little":
        # one table lookup per byte (bit k of byte j of a word is bit 8j + k): a pass over the codes' bytes and
        # one over the output, where unpacking by shifts makes four passes over the output
        table = _SIGN_TABLE.get(codes.device)
        if table is None:
            with torch.inference_mode(False):  # a constant kept across calls: usable outside inference mode too
                table = _SIGN_TABLE[codes.device] = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).float().mul_(
                    2).sub_(1).to(codes.device)  # fmt: skip
        as_bytes = codes.contiguous().view(torch.uint8).to(torch.int32)  # [..., 4W]
        return F.embedding(as_bytes, table).flatten(-2)[..., :bits]
    shifts = torch.arange(32, dtype=torch.int32, device=codes.device)
    unpacked = (codes[..., None] >> shifts) & 1
    return unpacked.flatten(-2)[..., :bits].to(torch.float32) * 2 - 1


_SIGN_TABLE: dict[torch.device, torch.Tensor] = {}  # [256, 8] float32 signs of each byte's bits, per device


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
    """Matching bits per (kv head, query, key), summed over the GQA group: [B, Hkv, Q, N] int32.

    The op `sparsekv::hamming_scores`: the Triton scorer on CUDA, the sign matmul on CPU, the reference elsewhere."""
    check_code_shapes(query_codes, key_codes)
    _check_bits(query_codes.shape[-1], bits)
    return _hamming_scores_op(query_codes, key_codes, int(bits))


@torch.library.custom_op("sparsekv::hamming_scores", mutates_args=())
def _hamming_scores_op(query_codes: torch.Tensor, key_codes: torch.Tensor, bits: int) -> torch.Tensor:
    if query_codes.device.type == "cpu":
        return hamming_scores_matmul(query_codes, key_codes, bits=bits)
    return hamming_scores_reference(query_codes, key_codes, bits=bits)


@_hamming_scores_op.register_kernel("cuda")
def _hamming_scores_cuda(query_codes, key_codes, bits):
    from sparsekv.kernels._triton import use_triton

    if use_triton(query_codes, key_codes):
        from sparsekv.kernels._hamming_triton import hamming_scores_triton

        return hamming_scores_triton(query_codes, key_codes, bits=bits)
    return hamming_scores_reference(query_codes, key_codes, bits=bits)


@_hamming_scores_op.register_fake
def _hamming_scores_fake(query_codes, key_codes, bits):
    b, _, q, _ = query_codes.shape
    return query_codes.new_empty(b, key_codes.shape[1], q, key_codes.shape[2], dtype=torch.int32)


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
    threshold_hint: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices [B, Hkv, Q, min(k, N)] int64 (unordered) of the k keys with the most matching bits per kv head.

    Equal scores go to the lower position (`recent_first`: the higher one); the first `sink` and the last `local`
    keys are always in (sink + local <= k). The op `sparsekv::hamming_topk`: on CUDA scoring and the histogram pass
    are one kernel (int16 scores), then threshold + compaction, no sort; the reference elsewhere.

    threshold_hint: int32 [B * Hkv * Q] contiguous, on the codes' device, each row's threshold score of the
    previous call (any contents are valid; zeros at first). The CUDA kernel reads it to skip a radix pass and
    writes the new thresholds; the result never depends on it.
    """
    if sink < 0 or local < 0 or sink + local > k:
        raise ValueError(f"sink ({sink}) + local ({local}) must be non-negative and fit in k ({k})")
    check_code_shapes(query_codes, key_codes)
    _check_bits(query_codes.shape[-1], bits)
    _check_hint(threshold_hint, query_codes, key_codes)
    return _hamming_topk_op(
        query_codes, key_codes, int(k), int(bits), bool(recent_first), int(sink), int(local), threshold_hint
    )


def _check_hint(threshold_hint: torch.Tensor | None, query_codes: torch.Tensor, key_codes: torch.Tensor) -> None:
    if threshold_hint is None:
        return
    rows = query_codes.shape[0] * key_codes.shape[1] * query_codes.shape[2]
    if (
        threshold_hint.dtype != torch.int32
        or threshold_hint.shape != (rows,)
        or not threshold_hint.is_contiguous()
        or threshold_hint.device != key_codes.device
    ):
        raise ValueError(f"threshold_hint must be a contiguous int32 tensor [{rows}] on {key_codes.device}")


@torch.library.custom_op("sparsekv::hamming_topk", mutates_args=("threshold_hint",))
def _hamming_topk_op(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    bits: int,
    recent_first: bool,
    sink: int,
    local: int,
    threshold_hint: torch.Tensor | None,
) -> torch.Tensor:
    return hamming_topk_reference(
        query_codes, key_codes, k, bits=bits, recent_first=recent_first, sink=sink, local=local
    )


@_hamming_topk_op.register_kernel("cuda")
def _hamming_topk_cuda(query_codes, key_codes, k, bits, recent_first, sink, local, threshold_hint):
    from sparsekv.kernels._triton import use_triton

    if use_triton(query_codes, key_codes) and 0 < k < key_codes.shape[2]:
        from sparsekv.kernels._hamming_triton import hamming_topk_triton

        return hamming_topk_triton(
            query_codes, key_codes, k, bits=bits, recent_first=recent_first, sink=sink, local=local,
            threshold_hint=threshold_hint,
        )  # fmt: skip
    return hamming_topk_reference(
        query_codes, key_codes, k, bits=bits, recent_first=recent_first, sink=sink, local=local
    )


@_hamming_topk_op.register_fake
def _hamming_topk_fake(query_codes, key_codes, k, bits, recent_first, sink, local, threshold_hint):
    b, _, q, _ = query_codes.shape
    hkv, n = key_codes.shape[1], key_codes.shape[2]
    return query_codes.new_empty(b, hkv, q, torch.sym_min(k, n), dtype=torch.int64)


def fixed_score_dtype(group: int, bits: int) -> torch.dtype:
    """dtype of `hamming_topk_fixed`'s ranking scores (0 .. group * bits + 2): the fused kernel's score dtype,
    int16 where it holds them."""
    return torch.int16 if group * bits + 2 < 2**15 else torch.int32


def hamming_topk_fixed_reference(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    written: torch.Tensor,
    *,
    bits: int,
    sink: int = 0,
    local: int = 0,
    with_scores: bool = True,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rule of `hamming_topk_fixed`. Each slot's ranking score: the first `sink` slots and the last
    `local` written ones g * bits + 2, the other written slots 1 + their group-summed matching bits, the slots
    at or beyond `written` 0. The min(k, N) best slots, equal scores to the higher (more recent) position; with
    `counts`, row r's counts[r] best slots and position 0 in its other entries."""
    _, g = check_code_shapes(query_codes, key_codes)
    scores = hamming_scores_reference(query_codes, key_codes, bits=bits).to(torch.int64)
    n = scores.shape[-1]
    k = min(int(k), n)
    position = torch.arange(n, device=scores.device)
    length = written.reshape(())  # compared as a tensor: no host sync
    held = position < length
    forced = (position < sink) | ((position >= length - local) & held)
    ranked = torch.where(forced, g * bits + 2, torch.where(held, scores + 1, 0))
    picked = torch.topk(ranked * (n + 1) + position, k, dim=-1, sorted=counts is not None).indices
    if counts is not None:  # best first: a row keeps its first counts[r]
        keep = torch.arange(k, device=picked.device) < counts.view(*picked.shape[:-1], 1)
        picked = torch.where(keep, picked, 0)
    picked_scores = ranked.gather(-1, picked) if with_scores else ranked[..., :0]
    return picked, picked_scores.to(fixed_score_dtype(g, bits))


def hamming_topk_fixed(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    written: torch.Tensor,
    *,
    bits: int,
    sink: int = 0,
    local: int = 0,
    threshold_hint: torch.Tensor | None = None,
    with_scores: bool = True,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hamming_topk` (recent_first) over a fixed-shape buffer whose first `written` slots (int64 [1] on the
    codes' device) hold keys -> (indices [B, Hkv, Q, min(k, N)] int64 unordered, their ranking scores
    (`fixed_score_dtype`): 0 for an empty slot, 1 + matching bits for a key, g * bits + 2 for a forced one).
    `with_scores=False`: the scores are not gathered (an empty last dimension), for a caller that keeps every pick.
    counts: int32 [B * Hkv * Q] on the device, at most k each: row r takes its counts[r] best slots into its first
    entries, position 0 into the rest (each row's own budget in a step whose budgets are device values; needs
    with_scores=False).

    No host value depends on `written`, so a CUDA graph replays the op `sparsekv::hamming_topk_fixed` at every
    length. On CUDA scoring, the empty slots and forcing are fused in the Hamming kernel, then the sort-free
    select; the reference elsewhere.

    threshold_hint: as `hamming_topk`'s (each row's threshold of the previous step, rewritten in place; a speed
    hint, the result never depends on it): a buffer that lives across the steps, so that a captured step reads
    what its previous replay wrote."""
    if sink < 0 or local < 0 or sink + local > k:
        raise ValueError(f"sink ({sink}) + local ({local}) must be non-negative and fit in k ({k})")
    check_code_shapes(query_codes, key_codes)
    _check_bits(query_codes.shape[-1], bits)
    if written.dtype != torch.int64 or written.numel() != 1 or written.device != key_codes.device:
        raise ValueError(f"written must be an int64 tensor of one element on {key_codes.device}")
    _check_hint(threshold_hint, query_codes, key_codes)
    if counts is not None:
        rows = query_codes.shape[0] * key_codes.shape[1] * query_codes.shape[2]
        if counts.dtype != torch.int32 or counts.shape != (rows,) or counts.device != key_codes.device:
            raise ValueError(f"counts must be an int32 tensor [{rows}] on {key_codes.device}")
        if with_scores:
            raise ValueError("counts leaves padding entries: ask for with_scores=False")
    return _hamming_topk_fixed_op(
        query_codes, key_codes, int(k), written, int(bits), int(sink), int(local), threshold_hint,
        bool(with_scores), counts,
    )  # fmt: skip


@torch.library.custom_op("sparsekv::hamming_topk_fixed", mutates_args=("threshold_hint",))
def _hamming_topk_fixed_op(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    k: int,
    written: torch.Tensor,
    bits: int,
    sink: int,
    local: int,
    threshold_hint: torch.Tensor | None,
    with_scores: bool,
    counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return hamming_topk_fixed_reference(
        query_codes, key_codes, k, written, bits=bits, sink=sink, local=local, with_scores=with_scores, counts=counts
    )


@_hamming_topk_fixed_op.register_kernel("cuda")
def _hamming_topk_fixed_cuda(query_codes, key_codes, k, written, bits, sink, local, threshold_hint, with_scores,
                             counts):  # fmt: skip
    from sparsekv.kernels._triton import use_triton

    if use_triton(query_codes, key_codes, written) and 0 < k < key_codes.shape[2]:
        from sparsekv.kernels import _hamming_triton as impl

        # the fused kernel keeps rows on one grid axis: one query per row at decode sizes (the reference past it)
        if impl._query_step(query_codes, key_codes) is None:
            return impl.hamming_topk_fixed_triton(
                query_codes, key_codes, k, written.reshape(1), bits=bits, sink=sink, local=local,
                threshold_hint=threshold_hint, with_scores=with_scores, counts=counts,
            )  # fmt: skip
    return hamming_topk_fixed_reference(
        query_codes, key_codes, k, written, bits=bits, sink=sink, local=local, with_scores=with_scores, counts=counts
    )


@_hamming_topk_fixed_op.register_fake
def _hamming_topk_fixed_fake(query_codes, key_codes, k, written, bits, sink, local, threshold_hint, with_scores,
                             counts):  # fmt: skip
    b, hq, q, _ = query_codes.shape
    hkv, n = key_codes.shape[1], key_codes.shape[2]
    shape = (b, hkv, q, torch.sym_min(k, n))
    return (
        query_codes.new_empty(shape, dtype=torch.int64),
        query_codes.new_empty(shape[:-1] + (shape[-1] if with_scores else 0,), dtype=fixed_score_dtype(hq // hkv, bits)),
    )
