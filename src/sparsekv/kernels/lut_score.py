"""Self-index LUT scoring: keys are stored as the sign bits of their centred values; each group of 4 channels has
a 4-bit sign pattern and 16 centroids; score = sum over groups of (q . centroid[group, pattern])."""

from __future__ import annotations

import torch

from sparsekv.kernels.bits import pack_sign_bits  # noqa: F401  (codes come from pack_sign_bits(keys - mean))


def lut_tables(query: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """query [B, Hq, Q, d], centroids [B, Hkv, d/4, 16, 4] -> LUT [B, Hkv, Q, d/4, 16] fp32, already summed over
    each kv head's GQA group (scores are linear in q, so the group sum commutes with the lookup)."""
    b, hq, q, d = query.shape
    hkv = centroids.shape[1]
    qs = query.float().reshape(b, hkv, hq // hkv, q, d).sum(2).reshape(b, hkv, q, d // 4, 4)
    return torch.einsum("bhqgc,bhgpc->bhqgp", qs, centroids.float())


def lut_scores_reference(
    query: torch.Tensor, centroids: torch.Tensor, sign_codes: torch.Tensor
) -> torch.Tensor:
    """query [B, Hq, Q, d]; centroids [B, Hkv, d/4, 16, 4]; sign_codes [B, Hkv, N, d/32] int32 (pack_sign_bits of
    the centred keys: the pattern of group j is bits 4j..4j+3) -> scores [B, Hkv, Q, N] fp32 summed over the group."""
    lut = lut_tables(query, centroids)  # [B, Hkv, Q, G, 16]
    b, hkv, q, groups, _ = lut.shape
    n = sign_codes.shape[2]
    shifts = torch.arange(8, device=sign_codes.device, dtype=torch.int32) * 4
    pat = (
        ((sign_codes[..., None] >> shifts) & 0xF).reshape(b, hkv, n, -1)[..., :groups].long()
    )  # [B, Hkv, N, G]
    out = torch.empty(b, hkv, q, n, dtype=torch.float32, device=query.device)
    for qi in range(q):
        vals = torch.gather(lut[:, :, qi, None].expand(b, hkv, n, groups, 16), -1, pat[..., None])
        out[:, :, qi] = vals.squeeze(-1).sum(-1)
    return out


def lut_scores(query: torch.Tensor, centroids: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    """The op `sparsekv::lut_scores`: self-index LUT scores per kv head [B, Hkv, Q, N] fp32 (see the reference for
    shapes); the Triton kernel on CUDA, the reference elsewhere."""
    return _lut_scores_op(query, centroids, sign_codes)


@torch.library.custom_op("sparsekv::lut_scores", mutates_args=())
def _lut_scores_op(query: torch.Tensor, centroids: torch.Tensor, sign_codes: torch.Tensor) -> torch.Tensor:
    """CPU (and any device without its own kernel): the reference."""
    return lut_scores_reference(query, centroids, sign_codes)


@_lut_scores_op.register_kernel("cuda")
def _lut_scores_cuda(query, centroids, sign_codes):
    from sparsekv.kernels._triton import kernel, use_triton

    if use_triton(query, centroids, sign_codes):
        impl = kernel("_lut_triton", "lut_scores_triton")
        if impl is not None:
            return impl(query, centroids, sign_codes)
    return lut_scores_reference(query, centroids, sign_codes)


@_lut_scores_op.register_fake
def _lut_scores_fake(query, centroids, sign_codes):
    b, hkv, n = sign_codes.shape[0], centroids.shape[1], sign_codes.shape[2]
    return query.new_empty((b, hkv, query.shape[2], n), dtype=torch.float32)
