"""CPU references of the kernels against naive definitions (always run; no triton needed)."""

from __future__ import annotations

import pytest
import torch

from sparsekv.kernels.bits import pack_sign_bits, popcount32
from sparsekv.kernels.hamming import hamming_scores_reference
from sparsekv.kernels.topk import select_topk_reference


def _naive_pack(x: torch.Tensor) -> list[list[int]]:
    rows = x.reshape(-1, x.shape[-1]).tolist()
    out = []
    for row in rows:
        words = []
        for w in range((len(row) + 31) // 32):
            v = 0
            for i in range(32):
                j = 32 * w + i
                if j < len(row) and row[j] > 0:
                    v |= 1 << i
            words.append(v - 2**32 if v >= 2**31 else v)
        out.append(words)
    return out


@pytest.mark.parametrize("dim", [1, 31, 32, 33, 70, 128])
def test_pack_sign_bits(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 5, dim, generator=g)
    x[0, 0, 0] = 0.0  # zero is not positive
    packed = pack_sign_bits(x)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, (dim + 31) // 32)
    assert packed.reshape(-1, packed.shape[-1]).tolist() == _naive_pack(x)


def test_popcount32():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31, (4097,), generator=g, dtype=torch.int64).to(torch.int32)
    x[:3] = torch.tensor([0, -1, -(2**31)], dtype=torch.int32)
    ref = [(v & 0xFFFFFFFF).bit_count() for v in x.tolist()]
    assert popcount32(x).tolist() == ref


def _naive_hamming(qc, kc, bits):
    b, hq, q, w = qc.shape
    hkv, n = kc.shape[1], kc.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hkv, q, n, dtype=torch.int32)
    qb = [
        [[[(v >> i) & 1 for v in word for i in range(32)] for word in [row]] for row in head]
        for head in qc.reshape(-1, q, w).tolist()
    ]
    kb = [
        [[(v >> i) & 1 for v in row for i in range(32)] for row in head]
        for head in kc.reshape(-1, n, w).tolist()
    ]
    for bi in range(b):
        for h in range(hq):
            kvh = h // g
            for qi in range(q):
                qbits = qb[bi * hq + h][qi][0][:bits]
                for ni in range(n):
                    kbits = kb[bi * hkv + kvh][ni][:bits]
                    out[bi, kvh, qi, ni] += sum(int(a == c) for a, c in zip(qbits, kbits))
    return out


@pytest.mark.parametrize("bits,hq,hkv", [(64, 4, 2), (70, 3, 1), (128, 6, 3)])
def test_hamming_reference(bits, hq, hkv):
    g = torch.Generator().manual_seed(bits)
    w = (bits + 31) // 32
    # random words, padding bits included: they must not count
    qc = torch.randint(-(2**31), 2**31, (2, hq, 3, w), generator=g, dtype=torch.int64).to(torch.int32)
    kc = torch.randint(-(2**31), 2**31, (2, hkv, 37, w), generator=g, dtype=torch.int64).to(torch.int32)
    out = hamming_scores_reference(qc, kc, bits=bits, chunk=16)
    assert out.dtype == torch.int32 and out.shape == (2, hkv, 3, 37)
    assert torch.equal(out, _naive_hamming(qc, kc, bits))


def test_hamming_identical_codes_score_max():
    x = torch.randn(1, 4, 1, 100)
    codes = pack_sign_bits(x)
    out = hamming_scores_reference(codes, codes[:, :1].expand(1, 1, 1, 4).contiguous(), bits=100)
    assert out.shape == (1, 1, 1, 1)
    assert 100 <= out.item() <= 400


def assert_topk_set(scores: torch.Tensor, idx: torch.Tensor, k: int) -> None:
    """idx holds k distinct positions whose scores are the k largest of each row (ties: any choice)."""
    assert idx.dtype == torch.int64 and idx.shape == (*scores.shape[:-1], k)
    flat_s = scores.reshape(-1, scores.shape[-1]).double()
    flat_i = idx.reshape(-1, k)
    for s, i in zip(flat_s, flat_i):
        assert len(set(i.tolist())) == k, "duplicate indices"
        assert int(i.min()) >= 0 and int(i.max()) < s.numel()
        kth = torch.topk(s, k).values[-1]
        chosen = s[i]
        assert bool((chosen >= kth).all())
        # as many strictly-above-threshold picks as exist
        assert int((chosen > kth).sum()) == int((s > kth).sum())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.float32])
def test_select_topk_reference(dtype):
    g = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        scores = torch.randn(2, 3, 2, 301, generator=g).to(dtype)
    else:
        scores = torch.randint(0, 40, (2, 3, 2, 301), generator=g).to(dtype)
    idx = select_topk_reference(scores, 17)
    assert_topk_set(scores, idx, 17)
    assert torch.equal(idx, select_topk_reference(scores, 17))  # deterministic
    assert select_topk_reference(scores, 1000).shape[-1] == 301
