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


def test_top_p_reference():
    from sparsekv.kernels.top_p import top_p_threshold_reference

    g = torch.Generator().manual_seed(5)
    w = torch.softmax(torch.randn(6, 257, generator=g) * 3, -1)
    valid = torch.rand(6, 257, generator=g) < 0.9
    for p in (0.5, 0.9, 0.99):
        keep = top_p_threshold_reference(w, valid, p)
        assert not bool((keep & ~valid).any())
        wv = torch.where(valid, w, 0.0)
        for r in range(6):
            kept = wv[r][keep[r]]
            assert kept.sum() >= p * wv[r].sum() - 1e-4
            # minimal up to the bisection tolerance: every kept weight is among the largest valid ones
            order = wv[r].sort(descending=True).values
            n_min = int((order.cumsum(0) < p * wv[r].sum()).sum()) + 1
            assert kept.numel() <= n_min + int(((order - order[n_min - 1]).abs() < 2e-5).sum())
    single = top_p_threshold_reference(
        torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[True, True, False]]), 0.9
    )
    assert single.tolist() == [[False, True, False]]


def test_int4_roundtrip_and_qk():
    from sparsekv.kernels.int4_qk import dequantize_int4, int4_qk_reference, quantize_int4

    g = torch.Generator().manual_seed(6)
    keys = torch.randn(2, 2, 50, 24, generator=g)
    packed, scale, zero = quantize_int4(keys)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2, 50, 12) and scale.shape == (2, 2, 50)
    deq = dequantize_int4(packed, scale, zero)
    assert bool(((deq - keys).abs() <= scale[..., None] / 2 + 1e-5).all())
    query = torch.randn(2, 6, 2, 24, generator=g)
    for s in (2, 6):
        idx = torch.randint(0, 50, (2, s, 2, 9), generator=g)
        est = int4_qk_reference(query, packed, scale, zero, idx)
        assert est.shape == (2, 6, 2, 9)
        full = torch.einsum("bhqd,bhnd->bhqn", query, deq.repeat_interleave(3, dim=1))
        head_idx = idx.repeat_interleave(6 // s, dim=1)
        assert torch.allclose(est, torch.gather(full, -1, head_idx), atol=1e-4)


def test_quest_reference():
    from sparsekv.kernels.quest import quest_page_scores_reference

    g = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 5, 16, 8, generator=g)  # 5 pages of 16 tokens
    query = torch.randn(1, 4, 1, 8, generator=g)
    mn, mx = keys.amin(3), keys.amax(3)
    per_head = quest_page_scores_reference(query, mn, mx, group_reduce="none")
    exact = torch.einsum("bhqd,bhpnd->bhqpn", query, keys.repeat_interleave(2, dim=1)).amax(-1)
    assert bool((per_head >= exact - 1e-5).all())  # an upper bound of every token's q.k in the page
    summed = quest_page_scores_reference(query, mn, mx)
    assert torch.allclose(summed, per_head.reshape(1, 2, 2, 1, 5).sum(2), atol=1e-5)


def test_lut_reference():
    from sparsekv.kernels.lut_score import lut_scores_reference, quantized_lut

    g = torch.Generator().manual_seed(8)
    d, n = 64, 30
    keys = torch.randn(1, 2, n, d, generator=g)
    centroids = torch.randn(1, 2, d // 4, 16, 4, generator=g)
    codes = pack_sign_bits(keys)
    query = torch.randn(1, 4, 2, d, generator=g)
    table, step = quantized_lut(query, centroids)
    out = lut_scores_reference(table, step, codes)
    # naive: each group's pattern picks a centroid; score = sum over the group's query heads of q . centroid
    bitsv = (keys > 0).long().reshape(1, 2, n, d // 4, 4)
    pat = (bitsv * torch.tensor([1, 2, 4, 8])).sum(-1)
    approx = (
        torch.gather(
            centroids[:, :, None].expand(1, 2, n, d // 4, 16, 4),
            4,
            pat[..., None, None].expand(1, 2, n, d // 4, 1, 4),
        )
        .squeeze(4)
        .reshape(1, 2, n, d)
    )
    naive = torch.einsum("bhqd,bhnd->bhqn", query.reshape(1, 2, 2, 2, d).sum(2), approx)
    # the table is quantized: each of the d/4 groups' entries rounds by at most half a step
    assert bool(((out - naive).abs() <= (d // 4) * 0.5 * step[..., None] + 1e-5).all())
    assert float((out - naive).abs().max()) < 1e-2 * float(naive.abs().max())


@pytest.mark.parametrize(("bits", "group"), [(100, 3), (128, 4), (1024, 1), (33, 2)])
def test_hamming_matmul_path_equals_popcount_reference(bits, group):
    from sparsekv.kernels.hamming import hamming_scores_matmul, hamming_scores_reference

    gen = torch.Generator().manual_seed(bits)
    words = (bits + 31) // 32
    query = torch.randint(-(2**31), 2**31 - 1, (2, 2 * group, 3, words), generator=gen, dtype=torch.int64)
    keys = torch.randint(-(2**31), 2**31 - 1, (2, 2, 37, words), generator=gen, dtype=torch.int64)
    query, keys = query.to(torch.int32), keys.to(torch.int32)
    expected = hamming_scores_reference(query, keys, bits=bits)
    assert torch.equal(hamming_scores_matmul(query, keys, bits=bits), expected)


@pytest.mark.parametrize(
    "tickets,match",
    [(torch.zeros(4, dtype=torch.int64), "int32"), (torch.zeros(3, dtype=torch.int32), "at least 4"),
     (torch.zeros(8, dtype=torch.int32)[::2], "contiguous")],
)  # fmt: skip
def test_sparse_attention_rejects_bad_tickets(tickets, match):
    from sparsekv.kernels.sparse_attention import sparse_attention

    query, keys = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8)
    indices = torch.arange(3).expand(2, 2, 1, 3)  # 4 rows
    with pytest.raises(ValueError, match=match):
        sparse_attention(query, keys, keys, indices, None, 0.3, tickets=tickets)
    assert sparse_attention(query, keys, keys, indices, None, 0.3, tickets=torch.zeros(4, dtype=torch.int32)).shape \
        == query.shape  # fmt: skip


@pytest.mark.parametrize("limit,match", [(torch.tensor([2.0]), "integer"), (torch.tensor([1, 2]), "one element")])
def test_sparse_attention_rejects_bad_limits(limit, match):
    from sparsekv.kernels.sparse_attention import sparse_attention

    query, keys = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8)
    indices = torch.arange(3).expand(2, 2, 1, 3)
    with pytest.raises(ValueError, match=match):
        sparse_attention(query, keys, keys, indices, None, 0.3, limit=limit)


def test_sparse_attention_limit_stops_every_index_list():
    """The entries of an index list from `limit` on are not attended: the same as marking them invalid."""
    from sparsekv.kernels.sparse_attention import sparse_attention

    gen = torch.Generator().manual_seed(3)
    query, keys, values = torch.randn(2, 4, 2, 8, generator=gen), *torch.randn(2, 2, 2, 10, 8, generator=gen)
    indices = torch.arange(10).expand(2, 2, 2, 10)
    valid = torch.ones(2, 2, 2, 10, dtype=torch.bool)
    limited = sparse_attention(query, keys, values, indices, valid, 0.3, limit=torch.tensor([6]))
    valid[..., 6:] = False
    assert torch.equal(limited, sparse_attention(query, keys, values, indices, valid, 0.3))
    assert not torch.allclose(limited, sparse_attention(query, keys, values, indices, None, 0.3))


def test_sparse_attention_causal_ends_each_query_at_its_own_entry():
    """causal: the Q entries just below `limit` are the queries' own tokens; query i reads up to its own. The
    same as a mask row per query; without `limit` it is refused."""
    from sparsekv.kernels.sparse_attention import sparse_attention

    gen = torch.Generator().manual_seed(4)
    query, keys, values = torch.randn(2, 4, 3, 8, generator=gen), *torch.randn(2, 2, 2, 12, 8, generator=gen)
    indices = torch.arange(12).expand(2, 2, 3, 12)
    kept = (torch.rand(2, 1, 1, 12, generator=gen) < 0.7) | (torch.arange(12) == 0)
    causal = sparse_attention(query, keys, values, indices, kept.expand(2, 2, 3, 12), 0.3, limit=torch.tensor([9]),
                              causal=True)  # fmt: skip
    own = torch.arange(12)[None, :] <= torch.tensor([6, 7, 8])[:, None]  # [Q, K]: queries at entries 6, 7, 8
    assert torch.equal(causal, sparse_attention(query, keys, values, indices, (kept & own).expand(2, 2, 3, 12), 0.3))
    with pytest.raises(ValueError, match="causal attention needs `limit`"):
        sparse_attention(query, keys, values, indices, None, 0.3, causal=True)


def test_sparse_attention_start_skips_the_entries_before_it():
    """`start`: the entries of an index list before it are not attended either (a sliding window over a buffer
    of slots); without `limit` it is refused, and it must be one integer on the query's device."""
    from sparsekv.kernels.sparse_attention import sparse_attention

    gen = torch.Generator().manual_seed(5)
    query, keys, values = torch.randn(2, 4, 1, 8, generator=gen), *torch.randn(2, 2, 2, 12, 8, generator=gen)
    indices = torch.arange(12).expand(2, 2, 1, 12)
    windowed = sparse_attention(query, keys, values, indices, None, 0.3, limit=torch.tensor([10]),
                                start=torch.tensor([4]))  # fmt: skip
    valid = (torch.arange(12) >= 4) & (torch.arange(12) < 10)
    assert torch.equal(windowed, sparse_attention(query, keys, values, indices, valid.expand(2, 2, 1, 12), 0.3))
    with pytest.raises(ValueError, match="start needs `limit`"):
        sparse_attention(query, keys, values, indices, None, 0.3, start=torch.tensor([4]))
    with pytest.raises(ValueError, match="start must be an integer tensor of one element"):
        sparse_attention(query, keys, values, indices, None, 0.3, limit=torch.tensor([10]), start=torch.tensor([4.0]))


def test_sparse_attention_start_per_row_and_query_skips_each_ones_entries_before_it():
    """`start` [B, Q]: query i of row b reads from start[b, i] (a window per query in a verification of rows that
    kept different slots); a shape that is neither one element nor (batch, queries) is refused."""
    from sparsekv.kernels.sparse_attention import sparse_attention

    gen = torch.Generator().manual_seed(6)
    query, keys, values = torch.randn(2, 4, 3, 8, generator=gen), *torch.randn(2, 2, 2, 12, 8, generator=gen)
    indices = torch.arange(12).expand(2, 2, 3, 12)
    start = torch.tensor([[1, 2, 3], [5, 5, 7]])
    windowed = sparse_attention(query, keys, values, indices, None, 0.3, limit=torch.tensor([11]), start=start)
    valid = (torch.arange(12) >= start[:, None, :, None]) & (torch.arange(12) < 11)
    assert torch.equal(windowed, sparse_attention(query, keys, values, indices, valid.expand(2, 2, 3, 12), 0.3))
    assert not torch.equal(windowed, sparse_attention(query, keys, values, indices, None, 0.3, limit=torch.tensor([11]),
                                                      start=torch.tensor([1])))  # fmt: skip
    with pytest.raises(ValueError, match=r"of shape \(2, 3\) \(batch, queries\), got torch.int64 \(3, 2\)"):
        sparse_attention(query, keys, values, indices, None, 0.3, limit=torch.tensor([11]), start=start.T)


def test_select_within_reference_keeps_each_rows_budget_in_index_order():
    from sparsekv.kernels.select_within import select_within_reference

    values = torch.tensor([[0.1, 0.9, float("-inf"), 0.5, 0.5, 0.7], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    index, valid = select_within_reference(values, torch.tensor([3, 2]), 4)
    assert index.tolist() == [[1, 3, 5, 0], [0, 1, 0, 0]]  # 0.5 twice: the lower index; ties to the first
    assert valid.tolist() == [[True, True, True, False], [True, True, False, False]]
    index, valid = select_within_reference(values, torch.tensor([9, 0]), 8)  # past the finite values, k past C
    assert index[0, :5].tolist() == [0, 1, 3, 4, 5] and valid.sum(-1).tolist() == [5, 0]


@pytest.mark.parametrize(
    "counts,match",
    [(torch.full((4,), 3, dtype=torch.int64), "int32"), (torch.full((3,), 3, dtype=torch.int32), r"\[4\]")],
)  # fmt: skip
def test_lut_topk_fixed_rejects_bad_counts(counts, match):
    from sparsekv.kernels.bits import pack_sign_bits
    from sparsekv.kernels.lut_score import lut_topk_fixed, quantized_lut

    gen = torch.Generator().manual_seed(0)
    table, _ = quantized_lut(torch.randn(2, 4, 1, 32, generator=gen), torch.randn(2, 2, 8, 16, 4, generator=gen))
    codes = pack_sign_bits(torch.randn(2, 2, 20, 32, generator=gen))
    written = torch.tensor([15])
    with pytest.raises(ValueError, match=match):
        lut_topk_fixed(table, codes, 5, written, counts=counts)
    picked, _ = lut_topk_fixed(table, codes, 5, written, counts=torch.tensor([5, 4, 2, 0], dtype=torch.int32))
    assert picked.shape == (2, 2, 1, 5) and not picked.view(4, 5)[3].any() and not picked.view(4, 5)[2, 2:].any()


@pytest.mark.parametrize(
    "change,match",
    [({"keys": torch.zeros(2, 3, 1, 8, dtype=torch.float64)}, "float64"),
     ({"slots": torch.tensor([1, 2])}, "slots must be int64"),
     ({"slots": torch.tensor([1], dtype=torch.int32)}, "slots must be int64"),
     ({"values": torch.zeros(2, 3, 1, 4)}, "do not fit their buffer")],
)  # fmt: skip
def test_write_slots_rejects_what_does_not_fit_its_buffers(change, match):
    from sparsekv.kernels.write_slots import write_slots

    args = {"key_buffer": torch.zeros(2, 3, 10, 8), "value_buffer": torch.zeros(2, 3, 10, 8),
            "slots": torch.tensor([4]), "keys": torch.ones(2, 3, 1, 8), "values": torch.ones(2, 3, 1, 8)} | change  # fmt: skip
    with pytest.raises(ValueError, match=match):
        write_slots(**args)


def test_write_slots_writes_each_new_token_at_its_slot():
    from sparsekv.kernels.write_slots import write_slots

    keys, values = torch.zeros(2, 3, 10, 8), torch.zeros(2, 3, 10, 8)
    new = torch.arange(2 * 3 * 2 * 8, dtype=torch.float32).view(2, 3, 2, 8)
    write_slots(keys, values, torch.tensor([7, 3]), new, -new)
    assert torch.equal(keys[:, :, [7, 3]], new) and torch.equal(values[:, :, [7, 3]], -new)
    assert not keys[:, :, [0, 1, 2, 4, 5, 6, 8, 9]].any()


def test_sparse_attention_reference_takes_sdpa_output_in_any_layout(monkeypatch):
    """A masked CUDA SDPA may return its [B, Hkv, rows, d] output in a layout of its own (torch 2.11 on an H200: a
    strided view that `.view` cannot regroup); the reference's result must not depend on it."""
    import torch.nn.functional as F

    from sparsekv.kernels import sparse_attention as sa

    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 1, 16, generator=gen)
    keys, values = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)
    indices = torch.randint(0, 40, (2, 2, 1, 9), generator=gen)
    want = sa.sparse_attention_reference(query, keys, values, indices, None, 0.25)
    sdpa = F.scaled_dot_product_attention

    def other_layout(*args, **kwargs):  # the same values, stored [B, rows, Hkv, d]
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(sa.F, "scaled_dot_product_attention", other_layout)
    torch.testing.assert_close(sa.sparse_attention_reference(query, keys, values, indices, None, 0.25), want)
