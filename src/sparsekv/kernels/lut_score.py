"""Self-index LUT scoring: keys are stored as the sign bits of their centred values; each group of 4 channels has
a 4-bit sign pattern and 16 centroids; score = sum over groups of (q . centroid[group, pattern]).

The table is quantized per row (`quantized_lut`): integer entries whose sums stay within +-LUT_SCORE_LIMIT, so a
key's score is an exact integer sum, the same in any order, on any device. `lut_scores` returns those sums in
the query's units (x the row's step); `lut_topk_fixed` ranks them with the sort-free histogram select in the
same pass as the scoring (fixed-shape decode steps)."""

from __future__ import annotations

import torch

from sparsekv.kernels.bits import pack_sign_bits  # noqa: F401  (codes come from pack_sign_bits(keys - mean))

# `lut_topk_fixed`'s int16 ranks: 0 an empty slot; 1 + LUT_SCORE_LIMIT + score for a key (1 .. LUT_SCORE_RANK_MAX);
# LUT_RANK_TOP - 1 - i for the i-th listed forced position (i < MAX_LISTED); LUT_RANK_TOP for the sink/local keys
MAX_LISTED = 256
LUT_RANK_TOP = 2**15 - 1
LUT_SCORE_LIMIT = (LUT_RANK_TOP - MAX_LISTED - 2) // 2  # |integer score| bound (16254)
LUT_SCORE_RANK_MAX = 1 + 2 * LUT_SCORE_LIMIT
SENTINEL = 2**31 - 1  # an unused slot of `forced` (never a key position)


def group_query(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """query [B, Hq, Q, d] -> [B, Hkv, Q, d] float32 summed over each kv head's GQA group (scores linear in q, as
    the LUT's and q . K, take the group's sum)."""
    b, hq, q, d = query.shape
    return query.float().reshape(b, num_kv_heads, hq // num_kv_heads, q, d).sum(2)


def lut_tables(query: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """query [B, Hq, Q, d], centroids [B, Hkv, d/4, 16, 4] -> LUT [B, Hkv, Q, d/4, 16] fp32, already summed over
    each kv head's GQA group (scores are linear in q, so the group sum commutes with the lookup)."""
    b, _, q, d = query.shape
    hkv = centroids.shape[1]
    qs = group_query(query, hkv).reshape(b, hkv, q, d // 4, 4)
    return torch.einsum("bhqgc,bhgpc->bhqgp", qs, centroids.float())


def quantized_lut(query: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`lut_tables` rounded to integers: (table [B, Hkv, Q, d/4, 16] int32, step [B, Hkv, Q] fp32), table ~ LUT /
    step. Each row's step puts its largest possible score (the sum over groups of the largest |entry|) at
    LUT_SCORE_LIMIT - groups, so with each entry's rounding every score stays within +-LUT_SCORE_LIMIT: about 14
    bits of a row's range, enough for a first stage that a re-rank follows."""
    lut = lut_tables(query, centroids)
    groups = lut.shape[-2]
    bound = lut.abs().amax(-1).sum(-1)  # [B, Hkv, Q]
    step = (bound / (LUT_SCORE_LIMIT - groups)).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(lut / step[..., None, None]).to(torch.int32), step


def _patterns(sign_codes: torch.Tensor, groups: int) -> torch.Tensor:
    """sign_codes [B, Hkv, N, W] int32 -> the 4-bit pattern of each group [B, Hkv, N, G] int64 (bits 4j..4j+3)."""
    b, hkv, n, _ = sign_codes.shape
    shifts = torch.arange(8, device=sign_codes.device, dtype=torch.int32) * 4
    return ((sign_codes[..., None] >> shifts) & 0xF).reshape(b, hkv, n, -1)[..., :groups].long()


def lut_int_scores_reference(table: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    """table [B, Hkv, Q, G, 16] int32, sign_codes [B, Hkv, N, W] -> [B, Hkv, Q, N] int32 sums of table entries."""
    b, hkv, q, groups, _ = table.shape
    n = sign_codes.shape[2]
    pat = _patterns(sign_codes, groups)
    out = torch.empty(b, hkv, q, n, dtype=torch.int32, device=table.device)
    for qi in range(q):
        vals = torch.gather(table[:, :, qi, None].expand(b, hkv, n, groups, 16), -1, pat[..., None])
        out[:, :, qi] = vals.squeeze(-1).sum(-1, dtype=torch.int32)
    return out


def lut_scores_reference(table: torch.Tensor, step: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    """table / step of `quantized_lut`; sign_codes [B, Hkv, N, d/32] int32 (pack_sign_bits of the centred keys: the
    pattern of group j is bits 4j..4j+3) -> scores [B, Hkv, Q, N] fp32: each integer sum x its row's step."""
    return lut_int_scores_reference(table, sign_codes).float() * step[..., None]


def lut_scores(query: torch.Tensor, centroids: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    """Self-index LUT scores per kv head [B, Hkv, Q, N] fp32 (query [B, Hq, Q, d], centroids [B, Hkv, d/4, 16, 4]
    indexed by the 4-bit pattern, sign_codes [B, Hkv, N, d/32]) from the `quantized_lut` table. The op
    `sparsekv::lut_scores`: the Triton kernel on CUDA, the reference elsewhere."""
    table, step = quantized_lut(query, centroids)
    return _lut_scores_op(table, step, sign_codes)


@torch.library.custom_op("sparsekv::lut_scores", mutates_args=())
def _lut_scores_op(table: torch.Tensor, step: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return lut_scores_reference(table, step, sign_codes)


@_lut_scores_op.register_kernel("cuda")
def _lut_scores_cuda(table, step, sign_codes):
    from sparsekv.kernels._triton import kernel, use_triton

    if use_triton(table, sign_codes):
        impl = kernel("_lut_triton", "lut_scores_triton")
        if impl is not None:
            return impl(table, step, sign_codes)
    return lut_scores_reference(table, step, sign_codes)


@_lut_scores_op.register_fake
def _lut_scores_fake(table, step, sign_codes):
    b, hkv, q = table.shape[:3]
    return table.new_empty((b, hkv, q, sign_codes.shape[2]), dtype=torch.float32)


def lut_topk_fixed_reference(
    table: torch.Tensor, sign_codes: torch.Tensor, k: int, written: torch.Tensor, forced: torch.Tensor,
    *, sink: int = 0, local: int = 0, counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rule of `lut_topk_fixed`. Each written slot's rank: LUT_RANK_TOP for the first `sink` and the
    last `local` written slots; LUT_RANK_TOP - 1 - i for the row's forced position i; 1 + LUT_SCORE_LIMIT + its
    integer score for the others; the slots at or beyond `written` 0. The min(k, N) best slots, equal ranks to
    the lower position; with counts, row r's counts[r] best first and position 0 in its other entries."""
    scores = lut_int_scores_reference(table, sign_codes).to(torch.int64)
    n = scores.shape[-1]
    k = min(int(k), n)
    position = torch.arange(n, device=scores.device)
    length = written.reshape(())  # compared as a tensor: no host sync
    match = position[:, None] == forced.long()[:, :, None, None, :]  # [B, Hkv, 1, N, S]
    order = torch.arange(forced.shape[-1], device=scores.device)
    listed = torch.where(match, order, forced.shape[-1]).amin(-1, keepdim=False)  # [B, Hkv, 1, N]
    ranked = torch.where(listed < forced.shape[-1], LUT_RANK_TOP - 1 - listed, scores + 1 + LUT_SCORE_LIMIT)
    hinted = (position < sink) | (position >= length - local)
    ranked = torch.where(position < length, torch.where(hinted, LUT_RANK_TOP, ranked), 0)
    picked = torch.topk(ranked * (n + 1) + (n - 1 - position), k, dim=-1, sorted=counts is not None).indices
    if counts is not None:
        picked = torch.where(torch.arange(k, device=picked.device) < counts.view(*picked.shape[:-1], 1), picked, 0)
    return picked, ranked.gather(-1, picked).to(torch.int16)


def lut_topk_fixed(
    table: torch.Tensor, sign_codes: torch.Tensor, k: int, written: torch.Tensor, forced: torch.Tensor | None = None,
    *, sink: int = 0, local: int = 0, counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best keys by `quantized_lut` score over a fixed-shape buffer whose first `written` slots (int64 [1] on
    the codes' device) hold keys -> (indices [B, Hkv, Q, min(k, N)] int64 unordered, their ranks int16: 0 for an
    empty slot, 1 + LUT_SCORE_LIMIT + score for a key, LUT_RANK_TOP for a forced one).

    forced: [B, Hkv, S] int64 key positions (S <= MAX_LISTED; SENTINEL = unused) ranked above every other key, the
    first before the later ones, below the first `sink` and the last `local` written slots. Equal ranks go to
    the lower position.

    counts: int32 [B * Hkv * Q] on the codes' device, at most k each: row r puts its counts[r] best slots first and
    position 0 (with that slot's rank) in its other entries, each row's own budget where budgets are device values.

    The op `sparsekv::lut_topk_fixed`: on CUDA the scoring writes int16 ranks and the radix select's first histogram in
    one pass over the sign codes, then the sort-free select (`_topk_triton`); the reference elsewhere. No host
    value depends on `written`, so a CUDA graph replays it at every length."""
    if table.dtype != torch.int32 or table.dim() != 5 or table.shape[-1] != 16:
        raise ValueError(f"table must be the int32 [B, Hkv, Q, G, 16] of quantized_lut, got {tuple(table.shape)}")
    b, hkv = table.shape[:2]
    if sign_codes.shape[:2] != (b, hkv):
        raise ValueError(f"sign_codes {tuple(sign_codes.shape)} do not match the table {tuple(table.shape)}")
    if written.dtype != torch.int64 or written.numel() != 1 or written.device != sign_codes.device:
        raise ValueError(f"written must be an int64 tensor of one element on {sign_codes.device}")
    if sink < 0 or local < 0:
        raise ValueError(f"sink ({sink}) and local ({local}) must be non-negative")
    if forced is None:
        forced = torch.full((b, hkv, 1), SENTINEL, dtype=torch.int64, device=sign_codes.device)
    if forced.dim() != 3 or forced.shape[:2] != (b, hkv) or not 0 < forced.shape[2] <= MAX_LISTED:
        raise ValueError(f"forced must be [B, Hkv, S] = [{b}, {hkv}, 1..{MAX_LISTED}], got {tuple(forced.shape)}")
    rows = table.shape[:3].numel()
    if counts is not None and (counts.dtype != torch.int32 or counts.shape != (rows,)
                               or counts.device != sign_codes.device):  # fmt: skip
        raise ValueError(f"counts must be an int32 tensor [{rows}] (B * Hkv * Q) on {sign_codes.device}")
    return _lut_topk_fixed_op(table, sign_codes, int(k), written, forced.long(), int(sink), int(local), counts)


@torch.library.custom_op("sparsekv::lut_topk_fixed", mutates_args=())
def _lut_topk_fixed_op(
    table: torch.Tensor, sign_codes: torch.Tensor, k: int, written: torch.Tensor, forced: torch.Tensor,
    sink: int, local: int, counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return lut_topk_fixed_reference(table, sign_codes, k, written, forced, sink=sink, local=local, counts=counts)


@_lut_topk_fixed_op.register_kernel("cuda")
def _lut_topk_fixed_cuda(table, sign_codes, k, written, forced, sink, local, counts):
    from sparsekv.kernels._triton import kernel, use_triton

    # one query per row (decode) and fewer kept keys than slots: the fused kernel
    if use_triton(table, sign_codes, written) and table.shape[2] == 1 and 0 < k < sign_codes.shape[2]:
        impl = kernel("_lut_triton", "lut_topk_fixed_triton")
        if impl is not None:
            return impl(table, sign_codes, k, written.reshape(1), forced, sink=sink, local=local, counts=counts)
    return lut_topk_fixed_reference(table, sign_codes, k, written, forced, sink=sink, local=local, counts=counts)


@_lut_topk_fixed_op.register_fake
def _lut_topk_fixed_fake(table, sign_codes, k, written, forced, sink, local, counts):
    b, hkv, q = table.shape[:3]
    shape = (b, hkv, q, torch.sym_min(k, sign_codes.shape[2]))
    return table.new_empty(shape, dtype=torch.int64), table.new_empty(shape, dtype=torch.int16)
