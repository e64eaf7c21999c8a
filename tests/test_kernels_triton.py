"""Triton kernels against their references: on CUDA when present, else under the CPU interpreter.

The interpreter is slow, so sizes stay small but deliberately awkward (not multiples of the block sizes)."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from sparsekv.kernels.hamming import hamming_scores_reference
from sparsekv.kernels.sparse_attention import sparse_attention_reference
from sparsekv.kernels.topk import select_topk_reference
from tests.helpers import RUN_HERE, here, run_under_interpreter
from tests.test_kernels_reference import assert_topk_set

DEV = "cuda" if CUDA else "cpu"
#: a size the interpreter takes minutes over, whose path a smaller case of the same test also takes
gpu_only = pytest.mark.skipif(not CUDA, reason="covered by the smaller cases under the interpreter")


@pytest.mark.skipif(RUN_HERE, reason="kernels run directly in this process")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture(scope="module")
def impl():
    return {
        name: importlib.import_module(f"sparsekv.kernels.{name}")
        for name in ("_hamming_triton", "_topk_triton", "_sparse_attention_triton")
    }


def _codes(shape, gen):
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32).to(DEV)


@here
@pytest.mark.parametrize("bits,hq,hkv,n", [(128, 8, 2, 1000), (70, 3, 3, 333), (1024, 2, 1, 150)])
def test_hamming_triton(impl, bits, hq, hkv, n):
    gen = torch.Generator().manual_seed(n)
    w = (bits + 31) // 32
    qc, kc = _codes((2, hq, 1, w), gen), _codes((2, hkv, n, w), gen)
    out = impl["_hamming_triton"].hamming_scores_triton(qc, kc, bits=bits)
    assert torch.equal(out.cpu(), hamming_scores_reference(qc.cpu(), kc.cpu(), bits=bits))


@here
@pytest.mark.parametrize("bits", [128, 70])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_hamming_group_sizes_triton(impl, g, bits):
    """Every GQA group size: 1-4 heads combine in one adder group, 5-8 in two, 9 takes the per-head path."""
    gen = torch.Generator().manual_seed(10 * g + bits)
    w = (bits + 31) // 32
    qc, kc = _codes((2, 2 * g, 1, w), gen), _codes((2, 2, 300, w), gen)
    out = impl["_hamming_triton"].hamming_scores_triton(qc, kc, bits=bits)
    assert torch.equal(out.cpu(), hamming_scores_reference(qc.cpu(), kc.cpu(), bits=bits))


@here
@pytest.mark.parametrize(
    "counters,compact,scorer",
    [("bytes", "scan", {}), ("auto", "pairs", {"prefetch": 2}), ("auto", "scan", {"prefetch": False}),
     ("bytes", "pairs", {"group_adders": False}), ("histogram", "scan", {"prefetch": False})],
)  # fmt: skip
def test_hamming_topk_histogram_and_compaction_modes(impl, monkeypatch, counters, compact, scorer):
    """Every path of the scorer's histogram (4-bit or byte counters, tl.histogram where a program has too many
    keys for them) and both compactions (bit masks for int16 scores, the ordered scan for the others), with the
    scorer's launch options (prefetch depth, no head adders), select the same set as the reference."""
    from sparsekv.kernels.hamming import hamming_topk_reference

    ham, tk = impl["_hamming_triton"], impl["_topk_triton"]
    width = ham.packed_bits
    forced = {"auto": width, "bytes": lambda *a, **kw: 8 if width(*a, **kw) else 0, "histogram": lambda *a, **kw: 0}
    monkeypatch.setattr(ham, "packed_bits", forced[counters])  # the scorer's counter width (0: tl.histogram)
    if compact == "scan":
        monkeypatch.setattr(tk, "pairs_ok", lambda *args: False)  # int16 scores through the ordered scan too
    for key, value in scorer.items():
        monkeypatch.setitem(ham.TUNE, key, value)
    gen = torch.Generator().manual_seed(7)
    qc, kc = _codes((2, 8, 1, 4), gen), _codes((2, 2, 2500, 4), gen)
    kc[:, :, 1000:1400] = kc[:, :, :1]  # ties at the threshold
    ref = hamming_topk_reference(qc.cpu(), kc.cpu(), 300, bits=128, recent_first=True, sink=2, local=3)
    for hint in (None, torch.zeros(4, dtype=torch.int32, device=DEV)):
        got = impl["_hamming_triton"].hamming_topk_triton(
            qc, kc, 300, bits=128, recent_first=True, sink=2, local=3, threshold_hint=hint
        )
        assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values)
    # the selection reads score rows padded to a multiple of 64 (16-byte loads when N is not a multiple of 16)
    assert impl["_hamming_triton"].hamming_score_hist(qc, kc, bits=128).scores.stride(-2) == 2560


@here
@pytest.mark.parametrize("k", [1, 37, 500])
def test_hamming_topk_triton(impl, k):
    gen = torch.Generator().manual_seed(k)
    qc, kc = _codes((2, 8, 1, 4), gen), _codes((2, 2, 777, 4), gen)
    idx = impl["_hamming_triton"].hamming_topk_triton(qc, kc, k, bits=128)
    scores = hamming_scores_reference(qc.cpu(), kc.cpu(), bits=128)
    assert_topk_set(scores, idx.cpu(), k)


@here
def test_hamming_topk_last_chunk_runs_to_row_end(impl):
    """A row a tile longer than its equal chunks (decode lengths 2**17 + t): the last chunk takes the extra tile
    in the scorer, the window histogram and both compactions; the selected set matches the reference."""
    from sparsekv.kernels.hamming import hamming_topk_reference

    tk = impl["_topk_triton"]
    n = 4101  # 33 scorer tiles of 128 over 8 rows: 4 chunks of 8 tiles, the last with 9 (CPU counts 4 SMs)
    gen = torch.Generator().manual_seed(5)
    qc, kc = _codes((1, 32, 1, 4), gen), _codes((1, 8, n, 4), gen)
    if not CUDA:
        assert tk.chunking(8, n, 128, torch.device("cpu"), progs_per_sm=8) == (4, 8)
        assert impl["_hamming_triton"].hamming_score_hist(qc, kc, bits=128).num_chunks == 4
    ref = hamming_topk_reference(qc.cpu(), kc.cpu(), 90, bits=128, recent_first=True, sink=1, local=2)
    for hint in (None, torch.full((8,), 300, dtype=torch.int32, device=DEV)):
        got = impl["_hamming_triton"].hamming_topk_triton(
            qc, kc, 90, bits=128, recent_first=True, sink=1, local=2, threshold_hint=hint
        )
        assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values)


@here
def test_scorer_rotated_tile_order_keeps_the_output(impl, monkeypatch):
    """Scorer programs that start at a row-dependent tile of their chunk and wrap around (`rotate`) write the
    same scores and window histograms, so the same indices come out, in the same order; a partial last tile
    included."""
    ham = impl["_hamming_triton"]
    monkeypatch.setitem(ham.TUNE, "rotate_min_tiles", 2)
    # chunks of several tiles: one row of 4101 keys on the interpreter's 4 SMs, 64 rows of 40005 keys on a GPU
    b, hkv, n = (8, 8, 40005) if CUDA else (1, 2, 4101)
    gen = torch.Generator().manual_seed(8)
    qc, kc = _codes((b, 4 * hkv, 1, 4), gen), _codes((b, hkv, n, 4), gen)
    assert ham.hamming_score_hist(qc, kc, bits=128).bpc >= 2
    outs = []
    for rotate in (False, True):
        monkeypatch.setitem(ham.TUNE, "rotate", rotate)
        # the decode step's scoring (newest key first, a threshold window) is the one that rotates
        hint = torch.full((b * hkv,), 300, dtype=torch.int32, device=DEV)
        state = ham.hamming_score_hist(qc, kc, bits=128, recent_first=True, sink=1, local=3, threshold_hint=hint)
        # the scorer writes the window histogram after the radix levels (the selection writes those later)
        outs.append((state.scores.cpu(), state.hist[state.levels].cpu(), ham.hamming_select(state, 300).cpu()))
    for before, after in zip(*outs):
        assert torch.equal(before, after)


def test_chunking_gives_the_remainder_to_the_last_chunk():
    from sparsekv.kernels._topk_triton import chunking, max_chunk_tiles, packed_bits

    # 241 tiles in 16 chunks: 15 each and 16 in the last, one more than 4-bit histogram counters hold
    assert max_chunk_tiles(241 * 512, 512, 16, 15) == 16 and packed_bits(5, 16, scorer=True) == 8
    assert max_chunk_tiles(240 * 512, 512, 16, 15) == 15 and packed_bits(5, 15, scorer=True) == 4
    # packed_counts adds counters in 16-bit halves: a program's keys stay below 2**16
    assert packed_bits(5, 127, scorer=True, block=512) == 8 and packed_bits(5, 128, scorer=True, block=512) == 0

    cpu = torch.device("cpu")  # 4 SMs
    assert chunking(8, 4101, 128, cpu, progs_per_sm=8) == (4, 8)  # 33 tiles: 8, 8, 8, 9
    assert chunking(8, 4096, 128, cpu, progs_per_sm=8) == (4, 8)
    assert chunking(8, 4700, 128, cpu, progs_per_sm=8) == (4, 9)  # 37 tiles: 9, 9, 9, 10
    assert chunking(8, 4900, 128, cpu, progs_per_sm=8) == (4, 10)  # 39 tiles: 10, 10, 10, 9 (3 over 9 each)
    assert chunking(8, 1000, 128, cpu, progs_per_sm=8) == (4, 2)  # 8 tiles: 2, 2, 2, 2
    # max_tiles: more chunks than the programs per SM ask for, so that each stays within 4-bit counters
    assert chunking(8, 240 * 512, 512, cpu, progs_per_sm=8) == (4, 60)
    assert chunking(8, 240 * 512, 512, cpu, progs_per_sm=8, max_tiles=15) == (16, 15)
    assert chunking(8, 240 * 512, 512, cpu, progs_per_sm=8, max_tiles=15, max_chunks=8) == (8, 30)


@here
@pytest.mark.parametrize(
    "n,k,recent,sink,local,bits,hq,hkv,tied",
    [
        (777, 37, True, 2, 3, 128, 8, 2, False),  # two-level candidate select, group of 4
        (3000, 500, False, 0, 0, 128, 4, 1, True),  # most keys tie at one score
        (1500, 1, True, 0, 1, 64, 3, 3, False),  # k = 1 taken by the forced local key
        (2049, 100, True, 4, 16, 32, 2, 1, False),
        (900, 33, True, 1, 2, 1024, 2, 1, False),  # range 2049 > 1024: the radix path, reversed afterwards
    ],
)
def test_hamming_topk_exact_rule_triton(impl, n, k, recent, sink, local, bits, hq, hkv, tied):
    """The fused select returns exactly the reference's set: score, then position (recent or not), forced keys."""
    from sparsekv.kernels.hamming import hamming_topk_reference

    gen = torch.Generator().manual_seed(n)
    w = bits // 32
    qc, kc = _codes((2, hq, 1, w), gen), _codes((2, hkv, n, w), gen)
    if tied:
        kc[:, :, 100:] = kc[:, :, :1]
    got = impl["_hamming_triton"].hamming_topk_triton(
        qc, kc, k, bits=bits, recent_first=recent, sink=sink, local=local
    )
    ref = hamming_topk_reference(qc.cpu(), kc.cpu(), k, bits=bits, recent_first=recent, sink=sink, local=local)
    assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values)


@here
@pytest.mark.parametrize(
    "n,k,sink,local,bits,hq,hkv,tied",
    [
        (777, 37, 2, 3, 128, 8, 2, False),
        (1500, 300, 0, 0, 128, 4, 1, True),  # most keys tie at one score
        (600, 33, 1, 2, 1024, 2, 1, False),  # 3 radix levels behind the window
        (500, 40, 0, 4, 16, 1, 1, False),  # range of 17 scores: one exact level, the hint is not used
    ],
)
def test_hamming_topk_threshold_hint(impl, n, k, sink, local, bits, hq, hkv, tied):
    """Any hint gives the reference's set, and the call leaves each row's exact threshold score in it, after
    which the window holds the threshold (the pass that skips the radix levels)."""
    from sparsekv.kernels.hamming import hamming_topk_reference

    ham = impl["_hamming_triton"]
    gen = torch.Generator().manual_seed(n + k)
    w = (bits + 31) // 32
    qc, kc = _codes((3, hq, 1, w), gen), _codes((3, hkv, n, w), gen)
    if tied:
        kc[:, :, 100:] = kc[:, :, :1]
    ref = hamming_topk_reference(qc.cpu(), kc.cpu(), k, bits=bits, recent_first=True, sink=sink, local=local)
    scores = hamming_scores_reference(qc.cpu(), kc.cpu(), bits=bits)
    position = torch.arange(n)
    g = hq // hkv
    scores[..., (position < sink) | (position >= n - local)] = g * bits + 1
    threshold = scores.topk(k, dim=-1).values[..., -1].flatten().to(torch.int32)
    rows = threshold.numel()
    starts = [-(2**31), 0, int(threshold[0]) + 40]  # windows at the top, the bottom, above the threshold
    for start in starts:
        hint = torch.full((rows,), start, dtype=torch.int32).to(DEV)
        for _ in range(2):  # the second call starts from the exact threshold
            got = ham.hamming_topk_triton(
                qc, kc, k, bits=bits, recent_first=True, sink=sink, local=local, threshold_hint=hint
            )
            assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values), start
            if bits * g + 1 >= 31:
                assert torch.equal(hint.cpu(), threshold), start
    with pytest.raises(ValueError, match="threshold_hint"):
        ham.hamming_topk_triton(qc, kc, k, bits=bits, threshold_hint=torch.zeros(rows + 1, dtype=torch.int32))


@here
@pytest.mark.parametrize(
    "n,k,length,sink,local,bits,hq,hkv",
    [
        (301, 17, 211, 0, 0, 128, 8, 2),
        (300, 40, 300, 2, 3, 64, 4, 1),
        (129, 60, 40, 1, 1, 96, 3, 3),  # more picks than written slots: empty ones come in, the most recent first
    ],
)
def test_hamming_topk_fixed_triton(impl, n, k, length, sink, local, bits, hq, hkv):
    """The fused fixed-shape select returns the reference's set and ranking scores (empty slots 0, keys 1 + their
    score, forced ones the top; equal scores to the more recent slot)."""
    from sparsekv.kernels.hamming import hamming_topk_fixed_reference

    gen = torch.Generator().manual_seed(n + length)
    w = (bits + 31) // 32
    qc, kc = _codes((2, hq, 1, w), gen), _codes((2, hkv, n, w), gen)
    kc[:, :, n // 2 :] = kc[:, :, : n - n // 2]  # repeated codes: many equal scores
    written = torch.tensor([length])
    got, got_scores = impl["_hamming_triton"].hamming_topk_fixed_triton(
        qc, kc, k, written.to(DEV), bits=bits, sink=sink, local=local
    )
    ref, ref_scores = hamming_topk_fixed_reference(qc.cpu(), kc.cpu(), k, written, bits=bits, sink=sink, local=local)
    got, order = got.cpu().sort(-1)
    ref, ref_order = ref.sort(-1)
    assert torch.equal(got, ref)
    assert got_scores.dtype == ref_scores.dtype
    assert torch.equal(got_scores.cpu().gather(-1, order), ref_scores.gather(-1, ref_order))


@here
@pytest.mark.parametrize("n,k,length,bits,hq,hkv,hinted", [(1500, 300, 1333, 128, 4, 1, True), (777, 37, 700, 64, 8, 2, False)])
def test_hamming_topk_fixed_row_counts(impl, n, k, length, bits, hq, hkv, hinted):
    """With per-row counts the fixed-shape select puts each row's counts[r] best slots first and position 0 in
    the rest of its k entries: the reference's rows, entry for entry past the counts, as sets before them."""
    from sparsekv.kernels.hamming import hamming_topk_fixed_reference

    ham = impl["_hamming_triton"]
    gen = torch.Generator().manual_seed(n)
    w = (bits + 31) // 32
    qc, kc = _codes((3, hq, 1, w), gen), _codes((3, hkv, n, w), gen)
    kc[:, :, 100:200] = kc[:, :, :1]  # ties at the threshold
    rows = 3 * hkv
    counts = torch.randint(k // 2, k + 1, (rows,), generator=gen, dtype=torch.int32)
    counts[0] = k
    written = torch.tensor([length])
    hint = torch.zeros(rows, dtype=torch.int32).to(DEV) if hinted else None
    for _ in range(2):  # a hint buffer's second call starts from the first one's thresholds
        got, _ = ham.hamming_topk_fixed_triton(qc, kc, k, written.to(DEV), bits=bits, sink=2, local=3,
                                               threshold_hint=hint, with_scores=False, counts=counts.to(DEV))  # fmt: skip
        want, _ = hamming_topk_fixed_reference(qc.cpu(), kc.cpu(), k, written, bits=bits, sink=2, local=3,
                                               with_scores=False, counts=counts)  # fmt: skip
        got, want = got.cpu().view(rows, k), want.view(rows, k)
        for r in range(rows):
            c = int(counts[r])
            assert torch.equal(got[r, :c].sort().values, want[r, :c].sort().values), r
            assert not got[r, c:].any(), r


@here
@pytest.mark.parametrize(
    "n,k,length,sink,local,bits,hq,hkv,tied",
    [
        (777, 37, 700, 2, 3, 128, 8, 2, False),
        (1500, 300, 1333, 0, 0, 128, 4, 1, True),  # most keys tie at one score
        (600, 33, 541, 1, 2, 1024, 2, 1, False),  # 3 radix levels behind the window
        (129, 60, 40, 1, 1, 96, 3, 3, False),  # more picks than written slots: the threshold is an empty slot
    ],
)
def test_hamming_topk_fixed_threshold_hint(impl, n, k, length, sink, local, bits, hq, hkv, tied):
    """The fixed-shape select with any threshold hint returns the reference's set and ranking scores, and leaves
    each row's threshold ranking score in the hint (the next step's window then holds it)."""
    from sparsekv.kernels.hamming import hamming_topk_fixed_reference

    ham = impl["_hamming_triton"]
    gen = torch.Generator().manual_seed(n + length)
    w = (bits + 31) // 32
    qc, kc = _codes((3, hq, 1, w), gen), _codes((3, hkv, n, w), gen)
    if tied:
        kc[:, :, 100:] = kc[:, :, :1]
    written = torch.tensor([length])
    ref, ref_scores = hamming_topk_fixed_reference(qc.cpu(), kc.cpu(), k, written, bits=bits, sink=sink, local=local)
    threshold = ref_scores.to(torch.int32).amin(-1).flatten()
    rows = threshold.numel()
    for start in [-(2**31), 0, int(threshold[0]) + 40]:  # windows at the top, the bottom, above the threshold
        hint = torch.full((rows,), start, dtype=torch.int32).to(DEV)
        for _ in range(2):  # the second call starts from the exact threshold
            got, got_scores = ham.hamming_topk_fixed_triton(
                qc, kc, k, written.to(DEV), bits=bits, sink=sink, local=local, threshold_hint=hint
            )
            got, order = got.cpu().sort(-1)
            want, want_order = ref.sort(-1)
            assert torch.equal(got, want), start
            assert torch.equal(got_scores.cpu().gather(-1, order), ref_scores.gather(-1, want_order)), start
            if bits * (hq // hkv) + 2 >= 31:
                assert torch.equal(hint.cpu(), threshold), start


@here
@pytest.mark.parametrize("n,k,lo", [(301, 17, 0), (1234, 200, -50)])
def test_select_topk_int_triton(impl, n, k, lo):
    gen = torch.Generator().manual_seed(n)
    scores = torch.randint(lo, lo + 60, (2, 3, 1, n), generator=gen, dtype=torch.int32).to(DEV)
    idx = impl["_topk_triton"].select_topk_int(scores, k, lo, lo + 59)
    assert_topk_set(scores.cpu(), idx.cpu(), k)
    # the reference's rule among equal scores (the lower position) is the kernel's
    assert torch.equal(idx.cpu().sort(-1).values, select_topk_reference(scores.cpu(), k).sort(-1).values)
    # each row its own count of the best (int16 scores >= 0 take the bit-mask compaction, the others the scan)
    counts = torch.randint(k // 2, k + 1, (6,), generator=gen, dtype=torch.int32)
    for src in (scores, (scores - lo).to(torch.int16)):
        low = lo if src.dtype == torch.int32 else 0
        got = impl["_topk_triton"].select_topk_int(src, k, low, low + 59, counts.to(DEV)).cpu().view(6, k)
        want = select_topk_reference(src.cpu(), k, counts).view(6, k)
        for r, c in enumerate(counts.tolist()):
            assert torch.equal(got[r, :c].sort().values, want[r, :c].sort().values) and not got[r, c:].any(), r
    # one count shared by the rows as a stride-0 view (a single sequence's budget over its heads)
    shared = torch.full((1,), k - 2, dtype=torch.int32, device=DEV).expand(6)
    got = impl["_topk_triton"].select_topk_int(scores, k, lo, lo + 59, shared).cpu().view(6, k)
    want = select_topk_reference(scores.cpu(), k, shared.cpu().contiguous()).view(6, k)
    for r in range(6):
        assert torch.equal(got[r, : k - 2].sort().values, want[r, : k - 2].sort().values), r


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_topk_float_triton(impl, dtype):
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 2, 1, 613, generator=gen).to(dtype)
    scores[0, 0, 0, :50] = scores[0, 0, 0, 50]  # ties at the threshold, negatives, and +-0
    scores[1, 1, 0, :5] = -0.0
    idx = impl["_topk_triton"].select_topk_float(scores.to(DEV), 71)
    assert_topk_set(scores, idx.cpu(), 71)


@here
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize(
    "hq,hkv,per_head,d,n,k,masked",
    [(8, 2, False, 64, 300, 45, True), (6, 3, True, 40, 200, 77, True), (8, 2, False, 64, 300, 45, False),
     (12, 4, False, 64, 300, 45, False)],
)
def test_sparse_attention_triton(impl, hq, hkv, per_head, d, n, k, masked, merge):
    """masked=False: valid is None (every index attended, no mask loads). merge: the row's last split merges
    the partials (tickets), twice on one buffer, which must be zero again after each call."""
    gen = torch.Generator().manual_seed(k)
    b, q = 2, 1 if not per_head else 2
    s = hq if per_head else hkv
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b * s * q)]).view(b, s, q, k)
    valid = torch.rand(b, s, q, k, generator=gen) < 0.7
    valid[..., 0] = True
    if not masked:
        valid[:] = True
    scale = d**-0.5
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, scale)
    args = [t.to(DEV) for t in (query, keys, values, indices)] + [valid.to(DEV) if masked else None]
    tickets = torch.zeros(b * s * q + 3, dtype=torch.int32, device=DEV) if merge else None
    for _ in range(2 if merge else 1):
        out = impl["_sparse_attention_triton"].sparse_attention_triton(*args, scale, tickets=tickets, block=16,
                                                                       splits=3, merge=merge)  # fmt: skip
        err = (out.cpu().double() - ref).norm() / ref.norm()
        # float32 inputs: 3xTF32 dots on the GPU (about float32 accuracy; one TF32 pass gives ~1e-3), IEEE in the
        # interpreter
        assert err < 1e-4, float(err)
        if merge:
            assert not tickets.any()


@here
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("hq,hkv,q,n", [(9, 3, 5, 301), (8, 2, 9, 130), (4, 4, 3, 77)])
def test_sparse_attention_packed_queries_triton(impl, hq, hkv, q, n, merge):
    """Queries that share one index list (expanded over Q: a dense forward of several new tokens) run packed,
    G x Q rows a program, each with its own valid row (here causal over the last Q slots, and some slots masked
    for one batch row only)."""
    gen = torch.Generator().manual_seed(q * n)
    b, d = 2, 64
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    indices = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
    causal = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]  # [Q, N]
    kept = torch.rand(b, 1, 1, n, generator=gen) < 0.8
    kept[..., -q:] = True
    valid = (causal[None, None] & kept).expand(b, hkv, q, n)
    scale = d**-0.5
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, scale)
    tickets = torch.zeros(b * hkv * q, dtype=torch.int32, device=DEV) if merge else None
    shared = torch.arange(n, device=DEV).view(1, 1, 1, n).expand(b, hkv, q, n)  # stride 0 over Q: packed
    args = [query.to(DEV), keys.to(DEV), values.to(DEV), shared, valid.to(DEV)]
    out = impl["_sparse_attention_triton"].sparse_attention_triton(*args, scale, tickets=tickets, block=16, splits=3,
                                                                   merge=merge)  # fmt: skip
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-4, float(err)
    if merge:
        assert not tickets.any()


@here
@pytest.mark.parametrize("q,d,causal", [(1, 64, False), (1, 128, False), (1, 256, False), (5, 64, True),
                                         (9, 256, True)])  # fmt: skip
@pytest.mark.parametrize("kept", [False, True])
def test_sparse_attention_without_an_index_list_reads_every_slot_triton(impl, q, d, causal, kept):
    """indices None: the kernel reads the buffer's slots in order (no list), as the reference over arange: the
    written ones (`limit`), causally for packed queries, under a kept row shared by the queries."""
    gen = torch.Generator().manual_seed(40 + q + d)
    b, hq, hkv, n = 3, 4, 1, 333
    query = torch.randn(b, hq, q, d, generator=gen)
    keys, values = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    valid = None
    if kept:
        row = torch.rand(b, hkv, 1, n, generator=gen) > 0.3
        row[..., :2] = True
        valid = row.expand(b, hkv, q, n)  # one row for every query, as lossless rounds pass it
    limit = torch.tensor([301])
    every = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
    ref = sparse_attention_reference(query, keys, values, every, valid, 0.1, limit=limit, causal=causal)
    dev = [t.to(DEV) if t is not None else None for t in (query, keys, values, valid, limit)]
    out = impl["_sparse_attention_triton"].sparse_attention_triton(dev[0], dev[1], dev[2], None, dev[3], 0.1,
                                                                   limit=dev[4], causal=causal).cpu()  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_reads_without_an_index_list_go_in_order_where_that_was_measured_faster():
    """One query reads in order at every width, many queries only over rows wider than 64 channels; one query in
    order takes 32 tokens a step over 128 channels, over 256 channels 16 while rows are fewer than SMs and 32 after,
    and no tile staged deeper than EVERY_SLOT_STAGE_BYTES."""
    from sparsekv.kernels import _sparse_attention_triton as sa

    assert sa.reads_in_order(64, 16) and sa.reads_in_order(128, 16) and sa.reads_in_order(256, 16)
    assert not sa.reads_in_order(64, 32) and sa.reads_in_order(128, 64) and sa.reads_in_order(256, 64)
    assert sa.default_block(128, 16, every_slot=True) == 32
    assert sa.default_block(256, 16, every_slot=True) == 16
    assert sa.default_block(256, 16, every_slot=True, rows_over_sms=True) == 32
    assert sa.default_block(64, 16, every_slot=True) == sa.default_block(64, 16) == 2 * sa.TUNE["block"]
    for channels, rows, size in itertools.product((64, 128, 256), (16, 64), (2, 4)):
        block = sa.default_block(channels, rows, element_size=size, every_slot=True, rows_over_sms=True)
        assert block == 16 or sa.TUNE["num_stages"] * block * channels * size * 2 <= sa.EVERY_SLOT_STAGE_BYTES


def test_wide_rows_of_many_queries_over_a_window_take_small_steps_and_fewer_splits():
    """9 queries x 4 heads (d 256) over a sliding window, each query with a valid row of its own: 16 tokens a step,
    half the programs per SM; under one valid row (a lossless verification's sliding layer), one query over a
    window, or many over the whole buffer: 32 tokens and TUNE's programs."""
    from sparsekv.kernels import _sparse_attention_triton as sa

    assert sa.default_block(256, 64, row_per_query=True, window=True) == sa.TUNE["block"] // 4
    assert sa.programs_per_sm(256, 64, window=True, row_per_query=True) == sa.TUNE["sm_mult"] // 2
    assert sa.default_block(256, 64, window=True) == sa.default_block(256, 16, window=True) == sa.TUNE["block"] // 2
    assert sa.default_block(256, 64) == sa.TUNE["block"] // 2
    assert sa.programs_per_sm(256, 64, window=True) == sa.programs_per_sm(256, 64) == sa.TUNE["sm_mult"]
    assert sa.default_block(128, 64, row_per_query=True, window=True) == sa.TUNE["block"]


@here
@pytest.mark.parametrize("d,q,causal,expect", [(64, 1, False, 128), (64, 9, False, 64), (64, 9, True, 128),
                                                (128, 1, False, 64), (40, 2, False, 128), (128, 9, True, 64),
                                                (256, 1, False, 64), (256, 9, True, 32)])  # fmt: skip
def test_sparse_attention_default_launch_triton(impl, d, q, causal, expect):
    """The launch a call gets without block / splits (`default_block`): narrow rows with few query rows take
    twice the tokens a step, and up to twice as many query rows where the queries share one valid row (causal);
    wide rows with many query rows half; a list of 203 of 333 slots is no multiple of any block."""
    kernel = impl["_sparse_attention_triton"]
    gen = torch.Generator().manual_seed(d + q)
    b, hq, hkv, n, k = 2, 6, 3, 333, 203
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    if q == 1:
        indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b * hkv)]).view(b, hkv, 1, k)
        valid = torch.rand(b, hkv, 1, k, generator=gen) < 0.7
        rows = hq // hkv
    else:  # one list for every query: packed, G x Q query rows a program
        indices = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
        valid = (torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]).expand(b, hkv, q, n).clone()
        rows = hq // hkv * q
    valid[..., 0] = True
    assert kernel.default_block(d, max(16, kernel.next_pow2(rows)), row_per_query=q > 1 and not causal) == expect
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, d**-0.5)
    shared = indices.to(DEV) if q == 1 else torch.arange(n, device=DEV).view(1, 1, 1, n).expand(b, hkv, q, n)
    if causal:  # the same mask as causality from the limit, without a valid row
        out = kernel.sparse_attention_triton(query.to(DEV), keys.to(DEV), values.to(DEV), shared, None, d**-0.5,
                                             limit=torch.tensor([n], device=DEV), causal=True)  # fmt: skip
    else:
        out = kernel.sparse_attention_triton(query.to(DEV), keys.to(DEV), values.to(DEV), shared, valid.to(DEV),
                                             d**-0.5)  # fmt: skip
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-4, float(err)


@here
@pytest.mark.parametrize("q,limit,splits", [(1, 150, 3), (1, 40, 4), (9, 290, 2), (9, 333, 1)])
def test_sparse_attention_limit_triton(impl, q, limit, splits):
    """`limit`: only the first entries of each list are read; a split that starts past it stores an empty
    partial (limit 40 leaves every split but the first empty)."""
    kernel = impl["_sparse_attention_triton"]
    gen = torch.Generator().manual_seed(limit)
    b, hq, hkv, n, d = 2, 6, 3, 333, 64
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    indices = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
    valid = torch.rand(b, 1, 1, n, generator=gen) < 0.8
    valid = (valid & (torch.arange(n)[None, :] <= torch.arange(limit - q, limit)[:, None])).expand(b, hkv, q, n)
    valid = valid.clone()
    valid[..., 0] = True
    everywhere = valid.clone()
    everywhere[..., limit:] = True  # valid past the limit too: only the limit keeps those entries out
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, d**-0.5)
    shared = torch.arange(n, device=DEV).view(1, 1, 1, n).expand(b, hkv, q, n)
    out = kernel.sparse_attention_triton(query.to(DEV), keys.to(DEV), values.to(DEV), shared, everywhere.to(DEV),
                                         d**-0.5, splits=splits, limit=torch.tensor([limit], device=DEV))  # fmt: skip
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-4, float(err)


@here
@pytest.mark.parametrize("q,start,limit,splits,d", [(1, 200, 300, 3, 64), (1, 290, 300, 4, 64), (4, 150, 333, 2, 64),
                                                    (1, 0, 77, 2, 64), (3, 37, 141, 3, 256)])  # fmt: skip
def test_sparse_attention_start_triton(impl, q, start, limit, splits, d):
    """`start`: the entries before it are not read either, and a row's splits share the entries from `start` to
    `limit` (a sliding window's step over a buffer of slots); a mask row per query as a window's verification
    keeps (q 3, 4)."""
    kernel = impl["_sparse_attention_triton"]
    gen = torch.Generator().manual_seed(start + limit)
    b, hq, hkv, n = 2, 6, 3, 333
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    indices = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
    own = torch.arange(n)[None, :] <= torch.arange(limit - q, limit)[:, None]  # [Q, N]
    window = torch.arange(n)[None, :] >= torch.arange(start, start + q)[:, None]
    valid = (own & window).expand(b, hkv, q, n)
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, d**-0.5)
    everywhere = valid.clone()
    everywhere[..., :start] = True  # valid before the start too: only `start` keeps those entries out
    shared = torch.arange(n, device=DEV).view(1, 1, 1, n).expand(b, hkv, q, n)
    out = kernel.sparse_attention_triton(query.to(DEV), keys.to(DEV), values.to(DEV), shared, everywhere.to(DEV),
                                         d**-0.5, splits=splits, limit=torch.tensor([limit], device=DEV),
                                         start=torch.tensor([start], device=DEV))  # fmt: skip
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-4, float(err)


@here
@pytest.mark.parametrize("q,limit,splits,d", [(1, 300, 3, 64), (9, 333, 2, 64), (9, 290, 1, 256), (5, 141, 3, 256),
                                               (1, 77, 2, 256)])  # fmt: skip
def test_sparse_attention_start_per_row_and_query_triton(impl, q, limit, splits, d):
    """`start` [B, Q]: each row's queries read from their own first entries, under one valid row shared by every
    query and a causal limit (a lossless verification's window per query over the slots its row kept; q 1: a
    draft step's window per row). The program reads from its queries' least start and masks each query's own."""
    kernel = impl["_sparse_attention_triton"]
    gen = torch.Generator().manual_seed(limit + q + d)
    b, hq, hkv, n = 3, 4, 1, 333
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    indices = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
    kept = (torch.rand(b, 1, 1, n, generator=gen) < 0.8) | (torch.arange(n) == limit - q)
    first = torch.randint(0, limit - q, (b, 1), generator=gen) + torch.arange(q)  # nondecreasing per row
    own = torch.arange(n)[None, :] <= torch.arange(limit - q, limit)[:, None]
    valid = (kept & own & (torch.arange(n) >= first[:, None, :, None])).expand(b, hkv, q, n)
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, d**-0.5)
    shared = torch.arange(n, device=DEV).view(1, 1, 1, n).expand(b, hkv, q, n)
    out = kernel.sparse_attention_triton(query.to(DEV), keys.to(DEV), values.to(DEV), shared,
                                         kept.expand(b, hkv, q, n).to(DEV), d**-0.5, splits=splits,
                                         limit=torch.tensor([limit], device=DEV), causal=True,
                                         start=first.to(torch.int32).to(DEV))  # fmt: skip
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-4, float(err)


@here
@pytest.mark.parametrize("q,limit,splits,masked", [(9, 290, 2, True), (9, 333, 1, False), (5, 77, 3, True),
                                                   (2, 150, 1, True)])  # fmt: skip
def test_sparse_attention_causal_triton(impl, q, limit, splits, masked):
    """`causal`: each of the Q queries stops at its own entry below `limit`, under one valid row shared by every
    query (masked) or none; the packed kernel reads that row once a block (q 2, 5, 9: not powers of two)."""
    kernel = impl["_sparse_attention_triton"]
    gen = torch.Generator().manual_seed(limit + q)
    b, hq, hkv, n, d = 2, 6, 3, 333, 64
    query = torch.randn(b, hq, q, d, generator=gen)
    keys = torch.randn(b, hkv, n, d, generator=gen)
    values = torch.randn(b, hkv, n, d, generator=gen)
    indices = torch.arange(n).view(1, 1, 1, n).expand(b, hkv, q, n)
    kept = (torch.rand(b, 1, 1, n, generator=gen) < 0.8) | (torch.arange(n) == 0) if masked else None
    own = torch.arange(n)[None, :] <= torch.arange(limit - q, limit)[:, None]
    valid = (own if kept is None else kept & own).expand(b, hkv, q, n)
    ref = sparse_attention_reference(query.double(), keys.double(), values.double(), indices, valid, d**-0.5)
    shared = torch.arange(n, device=DEV).view(1, 1, 1, n).expand(b, hkv, q, n)
    row = None if kept is None else kept.to(DEV).expand(b, hkv, q, n)  # stride 0 over the queries
    out = kernel.sparse_attention_triton(query.to(DEV), keys.to(DEV), values.to(DEV), shared, row, d**-0.5,
                                         splits=splits, limit=torch.tensor([limit], device=DEV), causal=True)  # fmt: skip
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-4, float(err)


@here
@pytest.mark.parametrize(
    "mlp,resid,cols,early",
    [(True, False, 128, False), (False, False, 128, False), (True, True, 128, False), (False, True, 128, False),
     (True, True, 32, False), (True, True, 64, True), (True, False, 128, True)],
)  # fmt: skip
def test_sign_hash_triton(impl, monkeypatch, mlp, resid, cols, early):
    """cols: output bits per program for decode queries (the MLP's hidden layer is recomputed in each); early:
    the second layer's weights loaded before the first dot."""
    from sparsekv.kernels.sign_hash import sign_hash_reference

    mod = importlib.import_module("sparsekv.kernels._sign_hash_triton")
    monkeypatch.setitem(mod.TUNE, "cols", cols)
    monkeypatch.setitem(mod.TUNE, "early", early)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 3, 32, generator=gen)
    w1 = torch.randn(2, 32, 64 if mlp else 128, generator=gen)
    w2 = torch.randn(2, 64, 128, generator=gen) if mlp else None
    b1 = torch.randn(2, 64, generator=gen) if mlp else None
    wr = torch.randn(2, 32, 128, generator=gen) if resid and mlp else None  # Spotlight's linear branch
    b2 = torch.randn(2, 128, generator=gen) if resid else None
    args = (x, w1, w2, b1, wr, b2)
    ref = sign_hash_reference(*(None if t is None else t.double() for t in args))
    out = mod.sign_hash_triton(*(t.to(DEV) if t is not None else None for t in args)).cpu()
    # tf32 / reduced-precision dots can flip the sign of values near 0: allow a few flipped bits
    from sparsekv.kernels.bits import popcount32

    flips = popcount32(out ^ ref).sum().item()
    assert out.shape == ref.shape and flips <= 0.01 * ref.numel() * 32, flips


@here
@pytest.mark.parametrize("queries", [1, 40])  # decode rows, and a prompt's (128 rows or more per kv head)
def test_sign_hash_head_dim_256(queries):
    """Gemma 3's shape (head_dim 256, MLP hidden 256, one kv head of 4 query heads): the hidden layer runs in
    chunks and the rows, chunks and output columns in tiles of at most TILE_BYTES (a whole 256 x 256 float32 W1
    needs more shared memory than an H200 has); the codes equal the reference's, the pair kernel's too."""
    from sparsekv.kernels.bits import popcount32
    from sparsekv.kernels.sign_hash import sign_hash_pair_reference, sign_hash_reference

    mod = importlib.import_module("sparsekv.kernels._sign_hash_triton")
    assert mod._fit(256, 256 * 4, 16) == 64 and mod._fit(128, 128 * 4, 16) == 128  # float32: 256 in chunks of 64
    gen = torch.Generator().manual_seed(queries)
    d, hid, bits = 256, 256, 128
    x = torch.randn(2, 4, queries, d, generator=gen)
    w1, w2 = torch.randn(1, d, hid, generator=gen) * d**-0.5, torch.randn(1, hid, bits, generator=gen) * 0.1
    b1, wr = torch.randn(1, hid, generator=gen), torch.randn(1, d, bits, generator=gen) * d**-0.5
    ref = sign_hash_reference(x.double(), w1.double(), w2.double(), b1.double(), wr.double())
    out = mod.sign_hash_triton(*(t.to(DEV) for t in (x, w1, w2, b1, wr))).cpu()
    flips = popcount32(out ^ ref).sum().item()  # tf32 dots on the GPU may flip signs of values near 0
    assert out.shape == ref.shape and flips <= 0.01 * ref.numel() * 32, flips
    if queries == 1:
        keys = torch.randn(2, 1, 1, d, generator=gen)
        mean, kscale, qscale = torch.zeros(1, d), torch.ones(1), torch.ones(1)
        ref_keys = torch.zeros(2, 1, 1, bits // 32, dtype=torch.int32)
        ref_q = sign_hash_pair_reference(x.double(), keys.double(), ref_keys, mean, kscale, qscale, w1, w2, b1, wr)
        got_keys = torch.zeros(2, 1, 1, bits // 32, dtype=torch.int32, device=DEV)
        got_q = mod.sign_hash_pair_triton(*(t.to(DEV) for t in (x, keys)), got_keys,
                                          *(t.to(DEV) for t in (mean, kscale, qscale, w1, w2, b1, wr))).cpu()  # fmt: skip
        for got, want in ((got_q, ref_q), (got_keys.cpu(), ref_keys)):
            assert popcount32(got ^ want).sum().item() <= 0.01 * want.numel() * 32


@here  # imports a kernel module: triton is imported in the process that runs the kernels only
def test_decode_hash_bits_per_program():
    """As narrow as one program per SM allows (132 SMs: an H200): B1 and B8 of Llama-3-8B (8 kv heads)."""
    from sparsekv.kernels._sign_hash_triton import decode_cols

    assert [decode_cols(rows, 128, 132) for rows in (8, 33, 34, 66, 67, 256)] == [32, 32, 64, 64, 128, 128]
    assert decode_cols(8, 96, 132) == 32 and decode_cols(50, 96, 132) == 96  # 96 bits: 3 x 32 or all at once


@here
@pytest.mark.parametrize("kind,group,new,cols,early", [("mlp", 4, 1, 64, False), ("mlp", 3, 2, 128, True),
                                                      ("linear", 4, 1, 64, False), ("mlp", 1, 5, 32, False)])
def test_sign_hash_pair_triton(monkeypatch, kind, group, new, cols, early):
    """Queries + new keys in one launch == the reference, keys written into a slice of a larger code buffer."""
    from sparsekv.kernels.bits import popcount32
    from sparsekv.kernels.sign_hash import sign_hash_pair_reference

    mod = importlib.import_module("sparsekv.kernels._sign_hash_triton")
    monkeypatch.setitem(mod.TUNE, "cols", cols)
    monkeypatch.setitem(mod.TUNE, "early", early)
    gen = torch.Generator().manual_seed(group * 10 + new)
    b, hkv, d, bits = 2, 3, 32, 128
    query = torch.randn(b, hkv * group, 1, d, generator=gen)
    keys = torch.randn(b, hkv, new, d, generator=gen) + 0.5
    mean, kscale, qscale = 0.5 + 0.1 * torch.randn(hkv, d, generator=gen), torch.rand(hkv) + 0.5, torch.rand(hkv) + 1
    if kind == "mlp":
        weights = (torch.randn(hkv, d, 64, generator=gen) * d**-0.5, torch.randn(hkv, 64, bits, generator=gen) * 0.1,
                   torch.randn(hkv, 64, generator=gen), torch.randn(hkv, d, bits, generator=gen))  # fmt: skip
    else:
        weights = (torch.randn(hkv, d, bits, generator=gen), None, None, None)
    ref_buffer = torch.zeros(b, hkv, 9, bits // 32, dtype=torch.int32)
    ref_q = sign_hash_pair_reference(query.double(), keys.double(), ref_buffer[:, :, 4 : 4 + new], mean, kscale,
                                     qscale, *weights)  # fmt: skip
    buffer = torch.full((b, hkv, 9, bits // 32), 7, dtype=torch.int32, device=DEV)
    out_q = mod.sign_hash_pair_triton(query.to(DEV), keys.to(DEV), buffer[:, :, 4 : 4 + new], mean.to(DEV),
                                      kscale.to(DEV), qscale.to(DEV),
                                      *(None if w is None else w.to(DEV) for w in weights)).cpu()  # fmt: skip
    buffer = buffer.cpu()
    assert (buffer[:, :, :4] == 7).all() and (buffer[:, :, 4 + new :] == 7).all()  # only the new keys' slots
    for got, ref in ((out_q, ref_q), (buffer[:, :, 4 : 4 + new], ref_buffer[:, :, 4 : 4 + new])):
        flips = popcount32(got ^ ref).sum().item()  # tf32 dots on the GPU may flip signs of values near 0
        assert got.shape == ref.shape and flips <= 0.01 * ref.numel() * 32, flips


def _mod(name):
    return importlib.import_module(f"sparsekv.kernels.{name}")


@here
@pytest.mark.parametrize("reduce", ["sum", "max", "none"])
def test_quest_triton(impl, reduce):
    from sparsekv.kernels.quest import quest_page_scores_reference

    gen = torch.Generator().manual_seed(21)
    query = torch.randn(2, 6, 2, 48, generator=gen)
    mn = torch.randn(2, 3, 37, 48, generator=gen)
    mx = mn + torch.rand(2, 3, 37, 48, generator=gen)
    ref = quest_page_scores_reference(query, mn, mx, group_reduce=reduce)
    out = _mod("_quest_triton").quest_page_scores_triton(
        *(t.to(DEV) for t in (query, mn, mx)), group_reduce=reduce
    )
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_head", [False, True])
@here
def test_int4_qk_triton(impl, per_head):
    from sparsekv.kernels.int4_qk import int4_qk_reference, quantize_int4

    gen = torch.Generator().manual_seed(22)
    keys = torch.randn(2, 2, 300, 64, generator=gen)
    packed, scale, zero = quantize_int4(keys)
    query = torch.randn(2, 8, 1, 64, generator=gen)
    s = 8 if per_head else 2
    idx = torch.randint(0, 300, (2, s, 1, 77), generator=gen)
    ref = int4_qk_reference(query.half().float(), packed, scale, zero, idx)
    out = _mod("_int4_triton").int4_qk_triton(*(t.to(DEV) for t in (query, packed, scale, zero, idx))).cpu()
    assert (out - ref).norm() / ref.norm() < 1e-3


@here
@pytest.mark.parametrize("k", [333, 2500])
def test_top_p_triton(impl, k):
    from sparsekv.kernels.top_p import top_p_threshold_reference

    gen = torch.Generator().manual_seed(23)
    w = torch.softmax(torch.randn(5, k, generator=gen) * 3, -1)
    valid = torch.rand(5, k, generator=gen) < 0.8
    w[4] = 0.0  # all-zero row: keeps its first valid entry
    for p in (0.6, 0.95):
        ref = top_p_threshold_reference(w, valid, p)
        out = _mod("_top_p_triton").top_p_threshold_triton(w.to(DEV), valid.to(DEV), p).cpu()
        assert not bool((out & ~valid).any())
        diff = out ^ ref  # summation order may move the threshold by rounding: differences sit at it
        wv = torch.where(valid, w, 0.0)
        for r in range(5):
            assert wv[r][out[r]].sum() >= p * wv[r].sum() - 1e-4
            if diff[r].any():
                thr = wv[r][ref[r]].min()
                assert bool(((wv[r][diff[r]] - thr).abs() < 1e-4).all())


@here
def test_lut_triton(impl):
    from sparsekv.kernels.bits import pack_sign_bits
    from sparsekv.kernels.lut_score import lut_scores_reference, quantized_lut

    lut = _mod("_lut_triton")
    old = dict(lut.LUT_TUNE)
    gen = torch.Generator().manual_seed(24)
    try:
        lut.LUT_TUNE.update(tile=64, tiles=3)  # 301 keys: one full program, one ragged
        for d, n in ((64, 301), (48, 77), (128, 193)):
            codes = pack_sign_bits(torch.randn(1, 2, n, d, generator=gen))
            table, step = quantized_lut(torch.randn(1, 4, 2, d, generator=gen),
                                        torch.randn(1, 2, d // 4, 16, 4, generator=gen))  # fmt: skip
            out = lut.lut_scores_triton(*(t.to(DEV) for t in (table, step, codes))).cpu()
            assert torch.equal(out, lut_scores_reference(table, step, codes))  # integer sums x the same step
    finally:
        lut.LUT_TUNE.update(old)


@here
@pytest.mark.parametrize("d,n,k", [(128, 1000, 77), (64, 301, 30), (48, 77, 76), (128, 9000, 500),
                                   pytest.param(128, 20000, 400, marks=gpu_only)])  # fmt: skip
def test_lut_topk_fixed_triton(impl, d, n, k):
    """The fused first stage: ranks and picks equal the reference's, with sinks / local / listed forced keys, a
    listed position past `written` (not forced), many equal scores (repeated codes) and rows not a multiple of
    the tiles (below 8,192 keys 128-key tiles, from there SELECT_TUNE's)."""
    from sparsekv.kernels.bits import pack_sign_bits
    from sparsekv.kernels.lut_score import SENTINEL, lut_topk_fixed_reference, quantized_lut

    lut = _mod("_lut_triton")
    gen = torch.Generator().manual_seed(n)
    b, hkv = 2, 2
    codes = pack_sign_bits(torch.randn(b, hkv, n, d, generator=gen))
    codes[:, :, n // 2 :] = codes[:, :, : n - n // 2]
    table, _ = quantized_lut(torch.randn(b, 4, 1, d, generator=gen), torch.randn(b, hkv, d // 4, 16, 4, generator=gen))
    written = torch.tensor([n - 13])
    forced = torch.tensor([n - 100, SENTINEL, 5, n - 2, 6]).expand(b, hkv, 5).contiguous()
    for sink, local in ((0, 0), (2, 3)):
        want = lut_topk_fixed_reference(table, codes, k, written, forced, sink=sink, local=local)
        got = lut.lut_topk_fixed_triton(*(t.to(DEV) for t in (table, codes)), k, written.to(DEV), forced.to(DEV),
                                        sink=sink, local=local)  # fmt: skip
        _assert_same("lut_topk_fixed", [t.cpu() for t in got], want)
    # each row its own count: its counts[r] best first (as a set), then position 0
    counts = torch.randint(k // 2, k + 1, (b * hkv,), generator=gen, dtype=torch.int32)
    want, _ = lut_topk_fixed_reference(table, codes, k, written, forced, sink=2, local=3, counts=counts)
    got, _ = lut.lut_topk_fixed_triton(*(t.to(DEV) for t in (table, codes)), k, written.to(DEV), forced.to(DEV),
                                       sink=2, local=3, counts=counts.to(DEV))  # fmt: skip
    got, want = got.cpu().view(b * hkv, k), want.view(b * hkv, k)
    for r, c in enumerate(counts.tolist()):
        assert torch.equal(got[r, :c].sort().values, want[r, :c].sort().values), r
        assert not got[r, c:].any() and not want[r, c:].any(), r
    # one count shared by every row, as a decode step's budget is: a stride-0 view over the rows
    shared = torch.full((1,), k - 3, dtype=torch.int32, device=DEV).expand(b * hkv)
    want, _ = lut_topk_fixed_reference(table, codes, k, written, forced, counts=shared.cpu().contiguous())
    got, _ = lut.lut_topk_fixed_triton(*(t.to(DEV) for t in (table, codes)), k, written.to(DEV), forced.to(DEV),
                                       counts=shared)  # fmt: skip
    got, want = got.cpu().view(b * hkv, k), want.view(b * hkv, k)
    for r in range(b * hkv):
        assert torch.equal(got[r, : k - 3].sort().values, want[r, : k - 3].sort().values), r


@here
@pytest.mark.parametrize("rows,c,k", [(5, 300, 100), (3, 7863, 2621), (4, 50, 60), (2, 33, 33)])
def test_select_within_triton(rows, c, k):
    """Each row's budget of its best values: -inf never kept, equal values to the lower index, budgets of 0, of
    more than k and of more than the finite values, k above the row length; the indices ascending, compacted."""
    from sparsekv.kernels.select_within import select_within_reference

    impl = _mod("_select_within_triton")
    gen = torch.Generator().manual_seed(c)
    values = torch.randn(rows, c, generator=gen)
    values[0, :10] = float("-inf")
    values[1, 20:40] = 0.5
    values[:, 5] = 0.5
    budgets = torch.randint(0, k + 5, (rows,), generator=gen)
    budgets[0] = k
    budgets[-1] = 0 if rows > 2 else budgets[-1]
    got = impl.select_within_triton(values.to(DEV), budgets.to(DEV), k)
    want = select_within_reference(values, budgets, k)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@here
@pytest.mark.parametrize("n,k,hi", [(4096, 100, 512), (2600, 300, 9), (8, 3, 1), (1048, 1, 0), (5000, 70, 512)])
def test_compaction_pairs_mode(impl, monkeypatch, n, k, hi):
    """int16 scores take the bit-mask compaction: the same indices in the same order as the ordered scan (keys
    above the threshold by position, then the first equal ones), many ties, the 0 / 2**15 - 1 edges, rows that
    end mid-tile and a chunk split; the GPU runs its PTX store loop, the interpreter the per-key stores."""
    tk = impl["_topk_triton"]
    gen = torch.Generator().manual_seed(n + k)
    scores = torch.randint(0, hi + 1, (3, n), generator=gen, dtype=torch.int16)
    scores[0, : n // 3] = hi  # a run of equal top scores
    scores = (scores + (2**15 - 1 - hi) * (torch.arange(3) == 2)[:, None]).to(torch.int16)  # up to 2**15 - 1
    scores = scores.to(DEV)
    assert tk.pairs_ok(scores, 0, False, n, tk._sblock(n))
    pairs = tk.select_topk_int(scores, k, 0, 2**15 - 1).cpu()
    monkeypatch.setattr(tk, "pairs_ok", lambda *args: False)  # the same scores through the ordered scan
    scan = tk.select_topk_int(scores, k, 0, 2**15 - 1).cpu()
    assert torch.equal(pairs, scan)
    assert_topk_set(scores.cpu(), pairs, k)


def _compressed_kv(gen, b, h, n, d, k_bits, channel_axis, midrise, zero, sinks, tail):
    from sparsekv.kernels.compressed_kv import CompressedKV

    def rnd_bytes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)

    def rnd_pos(*shape):
        return (torch.rand(*shape, generator=gen) * 0.1 + 0.01).to(torch.float16)

    rows, offset = (-(-(n + 5) // 16), 5) if channel_axis else (n, 0)
    k_scale = rnd_pos(b, h, rows, d) if channel_axis else rnd_pos(b, h, n, d // 16)
    kv = CompressedKV(
        sign_bits=_codes((b, h, n, -(-d // 32)), gen).cpu(), k_mag=rnd_bytes(b, h, n, d * k_bits // 8),
        k_scale=k_scale, k_zero=rnd_pos(*k_scale.shape) if zero else None, v=rnd_bytes(b, h, n, d * 2 // 8),
        v_scale=rnd_pos(b, h, n, d // 32), v_zero=rnd_pos(b, h, n, d // 32) - 0.05,
        mu=torch.randn(b, h, 1, d, generator=gen), alpha=torch.rand(b, h, 1, d, generator=gen) + 0.5,
        k_bits=k_bits, v_bits=2, midrise=midrise, k_scale_tokens=16 if channel_axis else 1,
        k_scale_offset=offset,
    )  # fmt: skip
    if sinks:
        pos = torch.stack([torch.randperm(n, generator=gen)[:5].sort().values for _ in range(b * h)])
        kv.sink_positions = torch.cat([pos, torch.full((b * h, 2), 2**31 - 1)], -1).view(b, h, 7).to(torch.int32)
        kv.sink_keys = torch.randn(b, h, 7, d, generator=gen).to(torch.bfloat16)
        kv.sink_values = torch.randn(b, h, 7, d, generator=gen).to(torch.bfloat16)
    if tail:
        kv.tail_first = n - 20
        kv.tail_keys = torch.randn(b, h, 20, d, generator=gen).to(torch.bfloat16)
        kv.tail_values = torch.randn(b, h, 20, d, generator=gen).to(torch.bfloat16)
    for name, value in vars(kv).items():
        if isinstance(value, torch.Tensor):
            setattr(kv, name, value.to(DEV))
    return kv


@here
@pytest.mark.parametrize(
    "k_bits,channel_axis,midrise,zero,sinks,tail,d",
    [(3, False, False, False, True, True, 64), (2, False, False, True, False, False, 64),
     (4, True, True, False, True, False, 64), (3, True, True, False, False, True, 48)],
)  # fmt: skip
def test_compressed_kv_kernels(k_bits, channel_axis, midrise, zero, sinks, tail, d):
    """Dequant-on-gather re-rank scores, attention, and attention from the re-rank's scores == the torch references
    (awkward sizes, every layout; d = 48 takes the per-element loads, powers of two the whole-byte loads)."""
    from sparsekv.kernels import _compressed_kv_triton as ck
    from sparsekv.kernels.compressed_kv import (
        compressed_attention_reference,
        compressed_key_scores_reference,
        scored_attention_reference,
    )

    gen = torch.Generator().manual_seed(k_bits * 10 + channel_axis)
    b, h, g, n, q = 2, 2, 3, 301, 2
    tol = 1e-4 if ck.interpreting() else 2e-3  # the GPU's attention dots are 3xTF32
    kv = _compressed_kv(gen, b, h, n, d, k_bits, channel_axis, midrise, zero, sinks, tail)
    index = torch.stack([torch.randperm(n, generator=gen)[:45] for _ in range(b * h * q)]).view(b, h, q, 45)
    index[..., :3] = torch.tensor([n - 1, n - 15, 0])  # tail tokens (per query) and the first token
    index = index.to(DEV)
    tail_from = torch.tensor([n - 18, n - 5]).to(DEV)
    qsum = torch.randn(b, h, q, d, generator=gen).to(DEV)
    got = ck.compressed_key_scores_triton(qsum, kv, index, tail_from)
    ref = compressed_key_scores_reference(qsum, kv, index, tail_from)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-4, atol=1e-4)
    heads = torch.randn(b, h, g, q, d, generator=gen).to(DEV)  # each query head of a group, the keys read once
    got = ck.compressed_key_scores_triton(heads, kv, index, tail_from)
    ref = compressed_key_scores_reference(heads, kv, index, tail_from)
    assert got.shape == (b, h, g, q, 45)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-4, atol=1e-4)

    query = torch.randn(b, h * g, q, d, generator=gen).to(DEV)
    valid = (torch.rand(b, h, q, 45, generator=gen) > 0.2).to(DEV)
    valid[..., 0] = True
    got = ck.compressed_attention_triton(query, kv, index, valid, 0.125, tail_from)
    ref = compressed_attention_reference(query, kv, index, valid, 0.125, tail_from)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=tol, atol=tol)
    # a 16-bit model's precision (one TF32 pass) for its float32 rotated query: within bf16's rounding
    got = ck.compressed_attention_triton(query, kv, index, valid, 0.125, tail_from, tf32=True)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-2, atol=1e-2)

    # the same attention over a selection of the candidates `index`, its logits taken from their re-rank scores
    scores = compressed_key_scores_reference(query.view(b, h, g, q, d), kv, index, tail_from)
    pick = torch.stack([torch.randperm(45, generator=gen)[:21] for _ in range(b * h * q)]).view(b, h, q, 21).to(DEV)
    chosen, valid = index.gather(-1, pick), valid[..., :21]
    got = ck.scored_attention_triton(scores, pick, kv, chosen, valid, 0.125, tail_from, torch.float32)
    ref = scored_attention_reference(scores, pick, kv, chosen, valid, 0.125, tail_from, torch.float32)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-4, atol=1e-4)  # float32 FMAs, no TF32 dot
    direct = compressed_attention_reference(query, kv, chosen, valid, 0.125, tail_from)
    torch.testing.assert_close(ref.cpu(), direct.cpu(), rtol=1e-5, atol=1e-5)
    got = ck.scored_attention_triton(scores, pick, kv, chosen, valid, 0.125, tail_from, torch.bfloat16)
    assert got.dtype == torch.bfloat16  # the model's dtype, as its query
    torch.testing.assert_close(got.cpu().float(), ref.cpu(), rtol=1e-2, atol=1e-2)


@here
@pytest.mark.parametrize("options", [{}, {"sink_tokens": 0, "residual": 0}])
def test_self_index_decode_step_on_kernels_equals_torch_path(options, monkeypatch):
    """SelfIndexSelector's re-rank and attention through the compressed-cache kernels == its torch path."""
    from sparsekv.step import DecodeStep, StepHints
    from tests.test_self_index import prefilled, selector

    gen = torch.Generator().manual_seed(5)
    n0, extra, d = 290, 11, 64
    keys, values = torch.randn(2, 3, n0 + extra, d, generator=gen), torch.randn(2, 3, n0 + extra, d, generator=gen)
    query = torch.randn(2, 9, n0 + extra, d, generator=gen)
    keys, values, query = keys.to(DEV), values.to(DEV), query.to(DEV)
    sel = prefilled(selector(**options), keys[:, :, :n0], values[:, :, :n0], query[:, :, :n0])
    for t in range(n0, n0 + extra):  # decode tokens: the 16-bit tail
        sel.store(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    n = n0 + extra
    visible = torch.ones(2, 1, n, dtype=torch.bool, device=DEV)
    step = DecodeStep(query=query[:, :, -1:], keys=keys[..., :0], values=values[..., :0], visible=visible,
                      forced=torch.zeros_like(visible), budgets=torch.full((2, 1), 40, device=DEV), layer=sel.layer,
                      gqa="group", hints=StepHints(max_budget=40, uniform=False))  # fmt: skip
    picked = sel.select(step)
    fast = sel.attend(step, picked, 0.125)
    monkeypatch.setenv("SPARSEKV_DISABLE_TRITON", "1")
    reference = sel.select(step)
    assert torch.equal(picked.to_mask(n), reference.to_mask(n))
    tol = 1e-4 if os.environ.get("TRITON_INTERPRET") == "1" else 2e-3  # the GPU's attention dots are 3xTF32
    torch.testing.assert_close(fast, sel.attend(step, reference, 0.125), rtol=tol, atol=tol)


#: ops that return a set of indices (in no particular order): compared as sorted sets
SET_OPS = ("hamming_topk", "select_topk")


def _cuda_implementation(name: str):
    """What `torch.ops.sparsekv.<name>` runs on a CUDA tensor: the op's "cuda" kernel (on CPU tensors under the
    interpreter, where dispatch would pick the reference)."""
    from torch._library.custom_ops import OPDEFS

    return OPDEFS[f"sparsekv::{name}"]._backend_fns["cuda"]


def _fresh(args, device):
    return [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _assert_same(name, got, want):
    if want is None:  # an op that only writes its arguments
        assert got is None
        return
    if isinstance(want, (tuple, list)):
        if name in ("hamming_topk_fixed", "lut_topk_fixed"):  # (indices, scores): the same (index, score) pairs
            got = [t.cpu() for t in got]
            order_got, order_want = got[0].sort(-1), want[0].sort(-1)
            assert torch.equal(order_got.values, order_want.values)
            assert got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
            if want[1].shape[-1]:  # (scores=False: none gathered)
                assert torch.equal(got[1].gather(-1, order_got.indices), want[1].gather(-1, order_want.indices))
            return
        for g, w in zip(got, want, strict=True):
            _assert_same(name, g, w)
        return
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if name in SET_OPS:
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    elif want.dtype == torch.bool:  # top-p: a weight at the threshold may round to either side
        assert int((got != want).sum()) <= 2
    elif want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    else:
        assert torch.equal(got, want)


@here
@pytest.mark.parametrize("name", ["sparse_attention", "hamming_scores", "hamming_topk", "hamming_topk_fixed",
                                  "select_topk", "top_p_threshold", "sign_hash", "sign_hash_pair", "int4_qk",
                                  "quest_page_scores", "lut_scores", "lut_topk_fixed", "select_within",
                                  "compressed_key_scores", "compressed_attention", "scored_attention",
                                  "write_slots"])  # fmt: skip
def test_cuda_implementation_of_every_op_equals_its_reference(name):
    """Each op's CUDA implementation — the Triton kernel behind its launch conditions, what a GPU runs — against
    the op's CPU implementation, the reference, on the registration samples of tests/test_custom_ops.py (the tensors
    an op mutates compared too)."""
    from tests.test_custom_ops import SAMPLES, import_kernel_modules

    import_kernel_modules()
    op = getattr(torch.ops.sparsekv, name)
    for args in SAMPLES[name]():
        want_args = _fresh(args, "cpu")
        want = op(*want_args)
        got_args = _fresh(args, DEV)
        got = op(*got_args) if CUDA else _cuda_implementation(name)(*got_args)
        _assert_same(name, got, want)
        for g, w in zip(got_args, want_args):  # mutated arguments: written alike (tickets return to zero)
            if isinstance(w, torch.Tensor) and name not in ("hamming_topk", "hamming_topk_fixed"):
                # (the hamming ops' threshold hint is the kernel's own)
                _assert_same(name, g, w)
