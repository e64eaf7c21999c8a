"""Launch limits of the Triton kernels. CUDA grid axes y and z take at most 65535 programs; a prefill chunk of 16K
queries x 32 heads x batch 2 has 1M rows, and a (chunks, rows) grid failed on an H100 with
"Triton Error [CUDA]: invalid argument". The launchers now spread rows over axes y and z (`_triton.row_grid`).

(The Hamming scorer instead takes a long chunk in slices of its queries.) The planning is plain Python and
runs here; the kernels run with the limits shrunk to a few programs, so that
small shapes take the split path, and must give exactly what the unsplit launch gives (on CUDA when present,
else under the CPU interpreter in a child process, as in test_kernels_triton.py)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from sparsekv.kernels import _triton
from sparsekv.kernels._triton import LaunchLimitError, check_grid, row_grid, split_rows
from tests.helpers import RUN_HERE, here, run_under_interpreter

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SMALL = (2**31 - 1, 8, 8)  # axes y and z shrunk: 12 rows -> 6 x 2, 48 -> 8 x 6, 11 (prime) -> no grid


@pytest.mark.skipif(RUN_HERE, reason="kernels run directly in this process")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


# ---- planning (plain Python) ----


def test_reported_shape_fits():
    """The H100 failure: sparse attention over a 16K-query chunk, batch 2, 32 heads (one split per row)."""
    rows = 2 * 32 * 16384
    assert rows > _triton.MAX_GRID[1]  # what the old (splits, rows) grid put on axis y
    grid = row_grid("sparse_attention", (2, 32, 16384, 128), 1, rows)
    assert grid == (1, 32768, 32)
    assert grid[1] * grid[2] == rows and all(n <= lim for n, lim in zip(grid, _triton.MAX_GRID))


def test_small_row_counts_keep_the_plain_grid():
    assert row_grid("op", (1,), 16, 64) == (16, 64, 1)
    assert row_grid("op", (1,), 3, 65535) == (3, 65535, 1)
    assert row_grid("op", (1,), 3, 0) == (3, 0, 1)  # nothing to launch, as before


def test_split_rows_exact_and_fewest_layers():
    for max_y, max_z in ((8, 8), (5, 7)):
        for rows in range(70):
            yz = split_rows(rows, max_y, max_z)
            splits = [(rows // z, z) for z in range(1, max_z + 1) if rows % z == 0 and rows // z <= max_y]
            if rows == 0:
                assert yz == (0, 1)
            elif not splits:
                assert yz is None, rows
            else:
                assert yz == splits[0], rows  # y * z == rows, within both limits, fewest z
    assert split_rows(65537, 65535, 65535) is None  # a prime above axis y's limit
    assert split_rows(65535 * 65535 + 1, 65535, 65535) is None


def test_errors_name_the_op_the_shape_and_the_limit(monkeypatch):
    assert issubclass(LaunchLimitError, ValueError)
    with pytest.raises(
        LaunchLimitError, match=r"combine: shape \(2, 3\) .* axis x, above CUDA's limit of 2147483647"
    ):
        check_grid("combine", (2, 3), (2**31,))
    monkeypatch.setattr(_triton, "MAX_GRID", SMALL)
    with pytest.raises(LaunchLimitError, match=r"hamming: shape \(1, 1, 11, 4\) has 11 rows .* 8 x 8"):
        row_grid("hamming", (1, 1, 11, 4), 2, 11)
    with pytest.raises(
        LaunchLimitError, match=r"top_p_threshold: shape \(9, 5\) .* axis y, above CUDA's limit of 8"
    ):
        check_grid("top_p_threshold", (9, 5), (1, 9))


# ---- kernels on the split path (small shapes, limits shrunk) ----


@pytest.fixture
def small_grid(monkeypatch):
    """Run f(*args) with the grid limits at SMALL (every module that reads MAX_GRID)."""

    def run(f, *args, **kwargs):
        with monkeypatch.context() as m:
            for name in ("_triton", "_hamming_triton", "_sign_hash_triton"):
                m.setattr(_mod(name), "MAX_GRID", SMALL)
            return f(*args, **kwargs)

    return run


def _mod(name):
    return importlib.import_module(f"sparsekv.kernels.{name}")


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a.cpu(), b.cpu())
    else:
        for x, y in zip(a, b, strict=True):
            _same(x, y)


@here
@pytest.mark.parametrize("per_head,merge", [(False, False), (False, True), (True, True)])
def test_sparse_attention_split_rows(small_grid, per_head, merge):
    """12 rows (6 x 2) or 48 (8 x 6), 3 splits each; the rows' last splits merge through the tickets."""
    from sparsekv.kernels.sparse_attention import sparse_attention_reference

    sa = _mod("_sparse_attention_triton")
    gen = torch.Generator().manual_seed(1)
    b, hq, hkv, q, d, n, k = 2, 8, 2, 3, 32, 150, 40
    s = hq if per_head else hkv
    query, keys, values = (torch.randn(b, h, m, d, generator=gen) for h, m in ((hq, q), (hkv, n), (hkv, n)))
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b * s * q)]).view(b, s, q, k)
    valid = torch.rand(b, s, q, k, generator=gen) < 0.7
    valid[..., 0] = True
    args = [t.to(DEV) for t in (query, keys, values, indices, valid)]
    tickets = torch.zeros(b * s * q, dtype=torch.int32, device=DEV)
    kw = {"tickets": tickets, "block": 16, "splits": 3, "merge": merge}
    split = small_grid(sa.sparse_attention_triton, *args, 0.2, **kw)
    assert not tickets.any()
    _same(split, sa.sparse_attention_triton(*args, 0.2, **kw))
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, 0.2)
    assert (split.cpu().double() - ref).norm() / ref.norm() < 1e-4


@here
def test_sparse_attention_merge_tile_limit(monkeypatch):
    """A merge tile [GC, SP, DP] over Triton's tensor limit: the combine kernel merges instead (tickets untouched)."""
    sa = _mod("_sparse_attention_triton")
    gen = torch.Generator().manual_seed(2)
    # MQA, one row: 4 query heads share it (GC 4), 3 splits (SP 4), d 64 (DP 64)
    query, keys, values = (torch.randn(1, h, m, 64, generator=gen) for h, m in ((4, 1), (1, 90), (1, 90)))
    indices = torch.randperm(90, generator=gen)[:48].view(1, 1, 1, 48)  # 3 splits of 16
    args = [t.to(DEV) for t in (query, keys, values, indices)]
    combined = sa.sparse_attention_triton(*args, None, 0.1, block=16, splits=3, merge=False)

    class Spy:  # records the combine kernel's launches
        def __init__(self, kernel):
            self.kernel, self.grids = kernel, []

        def __getitem__(self, grid):
            self.grids.append(grid)
            return self.kernel[grid]

    tickets = torch.zeros(1, dtype=torch.int32, device=DEV)
    spy = Spy(sa._combine_kernel)
    monkeypatch.setattr(sa, "_combine_kernel", spy)
    out = sa.sparse_attention_triton(*args, None, 0.1, tickets=tickets, block=16, splits=3, merge=True)
    assert spy.grids == []  # within the limit the rows' last splits merge
    monkeypatch.setattr(sa, "MAX_TENSOR_NUMEL", 4 * 4 * 64 - 1)  # one element short of the merge tile
    _same(
        sa.sparse_attention_triton(*args, None, 0.1, tickets=tickets, block=16, splits=3, merge=True),
        combined,
    )
    assert spy.grids == [(4,)] and not tickets.any()
    torch.testing.assert_close(out, combined, rtol=1e-6, atol=1e-6)


@here
@pytest.mark.parametrize("hint", [False, True])
def test_hamming_split_queries(small_grid, hint):
    """12 rows, 4 per query: the scorer runs on slices of 2 + 1 queries (its rows stay on axis y), with the
    threshold-window histogram and each slice's thresholds written back into the hint."""
    ham = _mod("_hamming_triton")
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, q, n = 2, 4, 2, 3, 700

    def codes(*shape):
        return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32).to(DEV)

    qc, kc = codes(b, hq, q, 4), codes(b, hkv, n, 4)
    hints = [
        torch.full((b * hkv * q,), 140, dtype=torch.int32, device=DEV) if hint else None for _ in range(2)
    ]
    kw = {"bits": 128, "recent_first": True, "sink": 2, "local": 3}
    _same(small_grid(ham.hamming_topk_triton, qc, kc, 37, threshold_hint=hints[0], **kw),
          ham.hamming_topk_triton(qc, kc, 37, threshold_hint=hints[1], **kw))  # fmt: skip
    if hint:
        _same(hints[0], hints[1])
    _same(
        small_grid(ham.hamming_scores_triton, qc, kc, bits=128), ham.hamming_scores_triton(qc, kc, bits=128)
    )


@here
def test_select_topk_split_rows(small_grid):
    tk = _mod("_topk_triton")
    scores = torch.randint(-5, 40, (2, 3, 4, 301), generator=torch.Generator().manual_seed(4)).to(DEV)
    _same(small_grid(tk.select_topk_int, scores, 50, -5, 40), tk.select_topk_int(scores, 50, -5, 40))


@here
def test_scoring_kernels_split_rows(small_grid, monkeypatch):
    """int4 q.K, Quest page scores and the LUT scores (both modes) on 12-48 rows, several blocks per row."""
    from sparsekv.kernels.bits import pack_sign_bits
    from sparsekv.kernels.int4_qk import quantize_int4

    gen = torch.Generator().manual_seed(5)
    packed, scale, zero = quantize_int4(torch.randn(2, 2, 300, 64, generator=gen))
    args = [t.to(DEV) for t in (torch.randn(2, 8, 3, 64, generator=gen), packed, scale, zero)]
    idx = torch.randint(0, 300, (2, 2, 3, 300), generator=gen).to(DEV)
    int4 = _mod("_int4_triton").int4_qk_triton
    _same(small_grid(int4, *args, idx), int4(*args, idx))

    mn = torch.randn(2, 2, 77, 48, generator=gen)
    args = [t.to(DEV) for t in (torch.randn(2, 4, 3, 48, generator=gen), mn, mn + 1)]
    quest = _mod("_quest_triton").quest_page_scores_triton
    for reduce in ("sum", "none"):
        _same(small_grid(quest, *args, group_reduce=reduce), quest(*args, group_reduce=reduce))

    from sparsekv.kernels.lut_score import quantized_lut

    lut = _mod("_lut_triton")
    table = quantized_lut(torch.randn(2, 4, 3, 64, generator=gen), torch.randn(2, 2, 16, 16, 4, generator=gen))
    args = [t.to(DEV) for t in (*table, pack_sign_bits(torch.randn(2, 2, 301, 64, generator=gen)))]
    monkeypatch.setitem(lut.LUT_TUNE, "tile", 64)
    _same(small_grid(lut.lut_scores_triton, *args), lut.lut_scores_triton(*args))


@here
def test_compressed_kv_split_rows(small_grid):
    from tests.test_kernels_triton import _compressed_kv

    ck = _mod("_compressed_kv_triton")
    gen = torch.Generator().manual_seed(6)
    b, h, g, q, n, d = 2, 2, 2, 3, 120, 64
    kv = _compressed_kv(gen, b, h, n, d, 3, False, False, False, True, True)
    index = torch.stack([torch.randperm(n, generator=gen)[:70] for _ in range(b * h * q)]).view(b, h, q, 70)
    index, tail_from = index.to(DEV), torch.tensor([n - 18, n - 9, n - 5]).to(DEV)
    qsum = torch.randn(b, h, q, d, generator=gen).to(DEV)
    args = (qsum, kv, index, tail_from)
    _same(small_grid(ck.compressed_key_scores_triton, *args), ck.compressed_key_scores_triton(*args))
    query = torch.randn(b, h * g, q, d, generator=gen).to(DEV)
    valid = (torch.rand(b, h, q, 70, generator=gen) > 0.2).to(DEV)
    valid[..., 0] = True
    args = (query, kv, index, valid, 0.125, tail_from)
    _same(small_grid(ck.compressed_attention_triton, *args), ck.compressed_attention_triton(*args))


@here
def test_sign_hash_batch_slices(small_grid, monkeypatch):
    """5 x 2 (batch, kv head) pairs on axis y, limit 8: the batch goes in slices of 4 and 1."""
    sh = _mod("_sign_hash_triton")
    monkeypatch.setitem(sh.TUNE, "cols", 128)  # the same bits per program whatever the slice's size
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 6, 3, 32, generator=gen).to(DEV)
    weights = [torch.randn(2, 32, 64, generator=gen), torch.randn(2, 64, 128, generator=gen)]
    weights = [w.to(DEV) for w in (*weights, torch.randn(2, 64, generator=gen))]
    _same(small_grid(sh.sign_hash_triton, x, *weights), sh.sign_hash_triton(x, *weights))


@here
def test_unsplittable_rows_raise(small_grid):
    """Rows that no launch split covers: one clear error, no launch. 11 rows (prime, above the shrunk axis y)
    fit no exact y x z grid; the Hamming scorer slices the queries, down to one query of 3 x 3 rows."""
    query = torch.zeros(1, 1, 11, 48, device=DEV)
    pages = torch.zeros(1, 1, 5, 48, device=DEV)
    with pytest.raises(LaunchLimitError, match=r"quest_page_scores: shape \(1, 1, 11, 48\) has 11 rows"):
        small_grid(_mod("_quest_triton").quest_page_scores_triton, query, pages, pages)
    qc = torch.zeros(3, 3, 2, 4, dtype=torch.int32, device=DEV)
    kc = torch.zeros(3, 3, 50, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(
        LaunchLimitError, match=r"hamming: shape \(3, 3, 1, 4\) needs 9 programs on grid axis y"
    ):
        small_grid(_mod("_hamming_triton").hamming_scores_triton, qc, kc, bits=128)
