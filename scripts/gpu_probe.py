"""A/B probes of the CUDA kernels' launch parameters and variants at Llama-3-8B shapes, 128K x B8 (B1 where a
section says so), one line per variant, CUDA-graph medians (pair, selfindex, sweep and plain also check each
variant's output against the default's or a reference). Sections (comma-separated, default hash,selfindex):

- hash: the query hash's precision (3xTF32 / IEEE / TF32 / bf16), bits per program and warps; prompt-key hashing
  rows per program (`_sign_hash_triton`).
- pair: a decode step's query + new-key hash as one `sign_hash_pair` launch against two launches and a copy,
  with and without the early weight loads.
- selfindex: the self-index decode kernels (LUT scores, re-rank q.K, dequantizing attention, the attention from the
  re-rank's logits, the compiled second stage) over their tile /
  warp / precision options (BENCHMARKS.md, self-index decode kernels).
- sweep, scoregrid: the Hamming scorer + selection launch grid (scorer tile, prefetch depth, GQA head adders,
  programs per SM, selection tile and warps; `_hamming_triton.TUNE`, `_topk_triton.SELECT_TUNE`).
- plain: the scorer without a histogram (int32 scores): tile, programs per SM, prefetch, head adders.
- lutselect: self-index's fixed-shape first stage at 128K and 32K x B4 (`lut_topk_fixed`: tile / warps /
  programs per SM, against `lut_scores` + torch.topk) and `select_within` (warps, against torch.topk), each
  checked against its reference.
- attnshape: the split-K attention's tile / programs per SM / warps / stages in the whole Spotlight step
  (`sparsekv.bench.attention.run_attention`; BENCHMARKS.md, the attention's launch shape).
- wide: the split-K attention at Gemma 3 270M's shapes (1 kv head x 4 query heads, d 256, 32,800 of 32,904
  slots written, under a row of kept slots as in lossless rounds, B16 and B128): one query over the buffer, a
  512-slot window read from its `start` (and without it), a 9-query verification over the buffer and over each
  query's window; the default launch, the same slots read in order without an index list, and a sweep of tile /
  warps / programs per SM / stages (`_sparse_attention_triton.default_block`'s wide rows), each checked against the
  default's output.
  PROBE_WIDE=192:1:window,192:9:buffer picks the cases (batch:queries:window|buffer).
- order: a whole-buffer read listed against in order (no index list, whatever the channels) at any shape, with the
  in-order read's tile sweep; PROBE_ORDER=batch:kv_heads:group:channels:capacity:written:queries,... (default: the
  embedded model's dense step and verification at 8K x B128, Llama 3 8B's at 128K x B4).

    python3 scripts/gpu_probe.py [hash,pair,selfindex,sweep,scoregrid,plain,lutselect,attnshape,wide]   # on a CUDA machine
    PROBE_BATCH=4 python3 scripts/gpu_probe.py selfindex   # at 128K x B4
"""

import os
import sys

import torch
import triton

from sparsekv.bench.common import graph_us
from sparsekv.kernels import _hamming_triton as ham
from sparsekv.kernels import _sign_hash_triton as sh
from sparsekv.kernels import _topk_triton as tk

SECTIONS = sys.argv[1] if len(sys.argv) > 1 else "hash,selfindex"
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
B, HQ, HKV, D, N = int(os.environ.get("PROBE_BATCH", "8")), 32, 8, 128, 131072  # PROBE_BATCH: another batch
K = int(0.02 * N)
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
w = [torch.randn(HKV, D, D, device=dev, generator=gen) * D**-0.5 for _ in range(3)]
b1 = torch.zeros(HKV, D, device=dev)


def hash_launch(x, ws, bias, prec, bm, warps, key_bias, cols=128):
    """One `_sign_hash_kernel` launch over x [B, H, M, D] with explicit precision / rows per program / warps (the
    wrapper picks these itself; the probe sweeps them)."""
    heads, m = x.shape[1], x.shape[2]
    out = torch.empty(B, heads, m, 4, dtype=torch.int32, device=dev)
    rows = heads // HKV * m  # rows of one kv head's group
    sh._sign_hash_kernel[(triton.cdiv(rows, bm), B * HKV, 128 // cols)](
        x, ws[0], ws[1], bias, ws[2], bias, out, rows, HKV, heads * m * D, rows * D, D,
        ws[0].stride(0), ws[0].stride(1), ws[1].stride(0), ws[1].stride(1),
        D=D, HID=D, BITS=128, MLP=True, BIAS=True, RESID=True, BIAS2=key_bias, PREC=prec, BM=bm, COLS=cols,
        num_warps=warps,
    )  # fmt: skip
    return out


if "hash" in SECTIONS:
    for name, dt, prec in (
        ("fp32 tf32x3", torch.float32, "tf32x3"),
        ("fp32 ieee", torch.float32, "ieee"),
        ("fp32 tf32", torch.float32, "tf32"),
        ("bf16", torch.bfloat16, "tf32"),
    ):
        ws = [t.to(dt) for t in w]
        for cols in (128, 64, 32):
            us = {
                warps: graph_us(lambda i, ws=ws, dt=dt, prec=prec, warps=warps, cols=cols:
                                hash_launch(q, ws, b1.to(dt), prec, 16, warps, False, cols), 4)
                for warps in (4, 8)
            }  # fmt: skip
            print(
                f"sign_hash q [{B},{HQ},1,{D}] {name}, {cols} bits per program: "
                + ", ".join(f"{w_} warps {u:.1f} us" for w_, u in us.items()),
                flush=True,
            )

    # prompt keys: one layer's 128K x B8 keys through the same kernel (rows per program = BM)
    keys = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16, generator=gen)
    for bm in (16, 64, 128):
        try:
            t = graph_us(lambda i, bm=bm: hash_launch(keys, w, b1, "tf32x3", bm, 8, True), 1)
            print(f"sign_hash prompt keys [{B},{HKV},{N},{D}] fp32 tf32x3 BM={bm}: {t:.0f} us", flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"BM={bm}: {type(error).__name__}: {str(error)[:200]}")
    from sparsekv.kernels.sign_hash import sign_hash_reference

    print(
        f"torch reference (fp32 matmuls) for the same keys: "
        f"{graph_us(lambda i: sign_hash_reference(keys, w[0], w[1], b1, w[2], b1), 1):.0f} us",
        flush=True,
    )
    keys = None  # free it before the next section


def self_index_probe():
    """The self-index decode step's kernels at 128K x B8 (Llama-3-8B shapes, default layout: 3-bit |K| with
    per-channel scales per 32 tokens, 2-bit V in groups of 64, 32 sinks, a 64-token residual block), one variant per
    line, each checked against the default's output."""
    from sparsekv.kernels import _compressed_kv_triton as ckv
    from sparsekv.kernels import _lut_triton as lt
    from sparsekv.kernels.compressed_kv import CompressedKV
    from sparsekv.kernels.lut_score import quantized_lut

    def rand_bytes(*shape):
        return torch.randint(0, 256, shape, device=dev, dtype=torch.uint8, generator=gen)

    def half(*shape):
        return torch.rand(*shape, device=dev, generator=gen).to(torch.float16)

    S, T = 32, 64
    kvs = [
        CompressedKV(
            sign_bits=torch.randint(-(2**31), 2**31 - 1, (B, HKV, N, 4), device=dev, dtype=torch.int32, generator=gen),
            k_mag=rand_bytes(B, HKV, N, 48), k_scale=half(B, HKV, N // 32, D), k_zero=None,
            v=rand_bytes(B, HKV, N, 32), v_scale=half(B, HKV, N, 2), v_zero=half(B, HKV, N, 2),
            mu=torch.randn(B, HKV, 1, D, device=dev) * 0.1, alpha=torch.rand(B, HKV, 1, D, device=dev),
            k_bits=3, v_bits=2, k_scale_tokens=32,
            sink_positions=torch.sort(torch.randperm(N - T, device=dev)[:S].int()).values.expand(B, HKV, S).contiguous(),
            sink_keys=torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16),
            sink_values=torch.randn(B, HKV, S, D, device=dev, dtype=torch.bfloat16),
            tail_keys=torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16),
            tail_values=torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16), tail_first=N - T,
        )
        for _ in range(2)
    ]  # fmt: skip
    tail_from = torch.full((1,), N - T, device=dev, dtype=torch.int64)
    cent = torch.randn(B, HKV, D // 4, 16, 4, device=dev)
    qf = q.float()
    qsum = qf.view(B, HKV, HQ // HKV, 1, D).sum(2)

    def report(name, fn, ref=None):
        try:
            t = graph_us(fn, 2)
            out = fn(0)
            err = "" if ref is None else f", max |diff| vs default {(out.float() - ref.float()).abs().max().item():.2e}"
            print(f"{name}: {t:.1f} us{err}", flush=True)
            return out
        except Exception as error:  # noqa: BLE001
            print(f"{name}: {type(error).__name__}: {str(error)[:300]}", flush=True)

    old = dict(lt.LUT_TUNE)
    table, step = quantized_lut(q, cent)
    ref = report("lut default", lambda i: lt.lut_scores_triton(table, step, kvs[i].sign_bits))
    for tile, tiles, warps in ((256, 8, 4), (128, 8, 4), (256, 8, 8), (256, 32, 4), (64, 16, 2)):
        lt.LUT_TUNE.update(tile=tile, tiles=tiles, num_warps=warps)
        report(f"lut tile {tile} x {tiles} warps {warps}",
               lambda i: lt.lut_scores_triton(table, step, kvs[i].sign_bits), ref)  # fmt: skip
    lt.LUT_TUNE.clear()
    lt.LUT_TUNE.update(old)

    k = int(0.02 * N)
    scores = [torch.randn(B, HKV, 1, N, device=dev) for _ in range(2)]
    report(f"torch.topk {3 * k} of {N} fp32, 64 rows", lambda i: scores[i].topk(3 * k, dim=-1, sorted=False)[1])
    cand = [scores[i].topk(3 * k, dim=-1, sorted=False)[1] for i in range(2)]
    report(f"torch.topk {k} of {3 * k} fp32, 64 rows",
           lambda i: scores[i][..., : 3 * k].topk(k, dim=-1, sorted=False)[1])  # fmt: skip

    old = dict(ckv.KEYS_TUNE)
    ref = report("re-rank q.K default " + str(old),
                 lambda i: ckv.compressed_key_scores_triton(qsum, kvs[i], cand[i], tail_from))  # fmt: skip
    for block, warps in ((64, 4), (32, 2), (16, 2), (32, 8), (16, 4), (8, 2), (8, 1), (16, 1)):
        ckv.KEYS_TUNE.update(block=block, num_warps=warps)
        report(f"re-rank q.K block {block} warps {warps}",
               lambda i: ckv.compressed_key_scores_triton(qsum, kvs[i], cand[i], tail_from), ref)  # fmt: skip
    ckv.KEYS_TUNE.update(old)

    sel = [c[..., :k].contiguous() for c in cand]
    valid = torch.ones(B, HKV, 1, k, device=dev, dtype=torch.bool)
    old = dict(ckv.ATTN_TUNE)
    ref = report("attention default " + str(old),
                 lambda i: ckv.compressed_attention_triton(q, kvs[i], sel[i], valid, D**-0.5, tail_from))  # fmt: skip
    for block, warps, keys, per_sm, prec in (
        (32, 4, 1 << 30, 4, "tf32"), (16, 2, 64, 2, "tf32"), (16, 2, 96, 2, "tf32"), (16, 2, 128, 2, "tf32"),
        (16, 2, 80, 4, "tf32"), (32, 4, 80, 2, "tf32"), (16, 2, 80, 2, "tf32x3"),
    ):  # fmt: skip  (1 << 30 tokens a program: a fixed number of programs per SM)
        ckv.ATTN_TUNE.update(block=block, num_warps=warps, split_keys=keys, min_programs_per_sm=per_sm, precision=prec)
        report(f"attention block {block} warps {warps} split_keys {keys} programs/SM >= {per_sm} {prec}",
               lambda i: ckv.compressed_attention_triton(q, kvs[i], sel[i], valid, D**-0.5, tail_from), ref)  # fmt: skip
    ckv.ATTN_TUNE.update(old)
    report("attention default, float32 query (the selector's rotated query), 3xTF32",
           lambda i: ckv.compressed_attention_triton(qf, kvs[i], sel[i], valid, D**-0.5, tail_from))  # fmt: skip
    report("attention default, float32 query, tf32 (a 16-bit model's)",
           lambda i: ckv.compressed_attention_triton(qf, kvs[i], sel[i], valid, D**-0.5, tail_from, tf32=True))  # fmt: skip
    plain = [CompressedKV(**{**kv.__dict__, "sink_positions": None, "sink_keys": None, "sink_values": None,
                             "tail_keys": None, "tail_values": None}) for kv in kvs]  # fmt: skip
    report("attention default, no sinks / tail copies",
           lambda i: ckv.compressed_attention_triton(q, plain[i], sel[i], valid, D**-0.5, tail_from))  # fmt: skip
    # the default "softmax" group rule: the re-rank's per-head q . K, its compiled second stage, and the attention over
    # the picks from those logits (V alone) against the one that reads the picks' keys again
    from sparsekv.selectors.self_index.selector import _second_stage

    heads = qf.view(B, HKV, HQ // HKV, 1, D)
    ordered = [c.sort(-1).values for c in cand]
    report(f"re-rank q.K, the {HQ // HKV} heads of a group",
           lambda i: ckv.compressed_key_scores_triton(heads, kvs[i], ordered[i], tail_from))  # fmt: skip
    scores5 = [ckv.compressed_key_scores_triton(heads, kvs[i], ordered[i], tail_from) for i in range(2)]
    ranks = [torch.randint(1, 30000, (B, HKV, 1, 3 * k), device=dev, dtype=torch.int16, generator=gen) for _ in range(2)]
    compiled = torch.compile(_second_stage, dynamic=False)
    report("second stage (group softmax, sum, ranks), eager",
           lambda i: _second_stage(ranks[i], scores5[i], None, D**-0.5))  # fmt: skip
    report("second stage, compiled", lambda i: compiled(ranks[i], scores5[i], None, D**-0.5))
    pick = [torch.randperm(3 * k, device=dev, generator=gen)[:k].sort().values.expand(B, HKV, 1, k).contiguous()
            for _ in range(2)]  # fmt: skip
    chosen = [ordered[i].gather(-1, pick[i]) for i in range(2)]
    report("attention over the picks, reading their keys (tf32)",
           lambda i: ckv.compressed_attention_triton(qf, kvs[i], chosen[i], valid, D**-0.5, tail_from, tf32=True))  # fmt: skip
    report("attention over the picks from the re-rank's logits (tf32)",
           lambda i: ckv.scored_attention_triton(scores5[i], pick[i], kvs[i], chosen[i], valid, D**-0.5, tail_from,
                                                 torch.bfloat16, tf32=True))  # fmt: skip
    from sparsekv.kernels._sparse_attention_triton import sparse_attention_triton

    kd = [torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    report("bf16 sparse_attention over the same rows (reference point)",
           lambda i: sparse_attention_triton(q, kd[i], kd[i], sel[i], valid, D**-0.5))  # fmt: skip


if "selfindex" in SECTIONS:
    self_index_probe()


def sweep_probe(grid=None):
    """Score + select launch grid: scorer tile, prefetch of the next tile(s), GQA head adders,
    programs per SM, select tile and warps; at 128K x B8 and at an N that is not a
    multiple of 16 (the decode case: rows padded, one wave of programs). Each line is checked against the
    default's set."""
    import itertools

    def run(batch, n, data):
        k = int(0.02 * n)
        codes, qcs = data
        hints = [torch.zeros(batch * HKV, dtype=torch.int32, device=dev) for _ in range(len(codes))]

        def scored(i):
            return ham.hamming_score_hist(qcs[i], codes[i], bits=128, recent_first=True, sink=4, local=64,
                                          threshold_hint=hints[i])  # fmt: skip

        for i in range(len(codes)):
            ham.hamming_select(scored(i), k)  # each row's threshold is now in its window
        warm = [scored(i) for i in range(len(codes))]
        t_score = graph_us(scored, len(codes))
        t_sel = graph_us(lambda i: ham.hamming_select(warm[i], k), len(codes))
        idx = ham.hamming_select(scored(0), k).sort(-1).values
        return t_score, t_sel, idx

    def rand_codes(*shape):
        return torch.randint(-(2**31), 2**31 - 1, shape, device=dev, dtype=torch.int32, generator=gen)

    spare = [rand_codes(B, HKV, N + 64, 4) for _ in range(3)]  # cache views with spare capacity, as in decoding
    qcs = [rand_codes(B, HQ, 1, 4) for _ in range(3)]
    saved = (dict(ham.TUNE), dict(tk.SELECT_TUNE))
    ref = run(B, N, ([c[:, :, :N] for c in spare], qcs))[2]
    if grid is None:
        grid = list(itertools.product((512, 1024), (False, True), (False, True), (8, 16), ((512, 2),)))
        grid += [(512, True, True, 8, select) for select in ((1024, 4), (256, 2))]
    for block, prefetch, adders, pps, (sblock, swarps) in grid:
        ham.TUNE.update(block=block, prefetch=prefetch, group_adders=adders, progs_per_sm=pps)
        tk.SELECT_TUNE.update(block=sblock, num_warps=swarps)
        t_score, t_sel, idx = run(B, N, ([c[:, :, :N] for c in spare], qcs))
        same = "" if torch.equal(idx, ref) else "  MISMATCH"
        print(f"score tile {block} prefetch {prefetch!s:5s} adders {adders!s:5s} "
              f"progs/SM {pps:2d} select {sblock}x{swarps}w: score {t_score:.1f} select {t_sel:.1f} "
              f"sum {t_score + t_sel:.1f} us{same}", flush=True)  # fmt: skip
    for table, old in zip((ham.TUNE, tk.SELECT_TUNE), saved, strict=True):
        table.update(old)
    for n in (N, N + 5):
        t_score, t_sel, _ = run(B, n, ([c[:, :, :n] for c in spare], qcs))
        print(f"defaults, N = {n}: score {t_score:.1f} select {t_sel:.1f} sum {t_score + t_sel:.1f} us", flush=True)


if "sweep" in SECTIONS:
    sweep_probe()
if "scoregrid" in SECTIONS:  # tiles in flight ahead x programs per SM (occupancy by registers)
    sweep_probe([(block, depth, True, pps, (512, 2)) for block in (512, 1024) for depth in (1, 2)
                 for pps in (4, 6, 8)])  # fmt: skip


def plain_probe():
    """The plain scorer (int32 scores, no histogram): tile, programs per SM, prefetch, head adders."""
    import itertools

    codes = [torch.randint(-(2**31), 2**31 - 1, (B, HKV, N, 4), device=dev, dtype=torch.int32, generator=gen)
             for _ in range(3)]  # fmt: skip
    qcs = [torch.randint(-(2**31), 2**31 - 1, (B, HQ, 1, 4), device=dev, dtype=torch.int32, generator=gen)
           for _ in range(3)]  # fmt: skip
    saved = dict(ham.TUNE)
    ref = ham.hamming_scores_triton(qcs[0], codes[0], bits=128)
    for block, pps, prefetch, adders in itertools.product((512, 1024), (8, 16), (False, True), (False, True)):
        ham.TUNE.update(block_plain=block, progs_per_sm_plain=pps, prefetch=prefetch, group_adders=adders)
        t = graph_us(lambda i: ham.hamming_scores_triton(qcs[i], codes[i], bits=128), 3)
        same = "" if torch.equal(ham.hamming_scores_triton(qcs[0], codes[0], bits=128), ref) else "  MISMATCH"
        print(f"plain scorer tile {block} progs/SM {pps:2d} prefetch {prefetch!s:5s} adders {adders!s:5s}: "
              f"{t:.1f} us{same}", flush=True)  # fmt: skip
    ham.TUNE.update(saved)


if "plain" in SECTIONS:
    plain_probe()


def lut_select_shape(n: int, b: int, g: torch.Generator) -> None:
    from sparsekv.kernels import _lut_triton as lt
    from sparsekv.kernels import _select_within_triton as sw
    from sparsekv.kernels.lut_score import lut_topk_fixed_reference, quantized_lut
    from sparsekv.kernels.select_within import select_within_reference

    hkv, hq, d, k = 8, 32, 128, 3 * int(0.02 * n)
    codes = [torch.randint(-(2**31), 2**31 - 1, (b, hkv, n, d // 32), device=dev, dtype=torch.int64,
                           generator=g).to(torch.int32) for _ in range(2)]  # fmt: skip
    cent = torch.randn(b, hkv, d // 4, 16, 4, device=dev, generator=g)
    tables = [quantized_lut(torch.randn(b, hq, 1, d, device=dev, generator=g), cent) for _ in range(2)]
    written, sinks = torch.tensor([n - 5], device=dev), torch.randint(0, n, (b, hkv, 32), device=dev, generator=g)
    scores = lt.lut_scores_triton(*tables[0], codes[0])
    old = graph_us(lambda i: lt.lut_scores_triton(*tables[i], codes[i]), 2) + graph_us(
        lambda i: torch.topk(scores, k, dim=-1, sorted=False), 2)
    got = lt.lut_topk_fixed_triton(tables[0][0], codes[0], k, written, sinks, local=64)
    want = lut_topk_fixed_reference(tables[0][0], codes[0], k, written, sinks, local=64)
    same = torch.equal(got[0].sort(-1).values, want[0].sort(-1).values)
    print(f"N={n} B{b}, {k} kept: lut_scores + torch.topk {old:.1f} us; lut_topk_fixed equals its reference: {same}")
    base = dict(lt.SELECT_TUNE)
    for block, warps, per_sm in ((256, 2, 16), (512, 4, 8), (256, 4, 8), (512, 4, 16), (256, 4, 16)):
        lt.SELECT_TUNE.update(block=block, num_warps=warps, progs_per_sm=per_sm)
        t = graph_us(lambda i: lt.lut_topk_fixed_triton(tables[i][0], codes[i], k, written, sinks, local=64), 2)
        print(f"  lut_topk_fixed tile {block}, {warps} warps, {per_sm} programs/SM: {t:.1f} us")
    lt.SELECT_TUNE.update(base)
    second = torch.randn(b, hkv, 1, k, device=dev, generator=g)
    budgets = torch.full((b, hkv, 1), k // 3, device=dev)
    got, want = sw.select_within_triton(second, budgets, k // 3), select_within_reference(second, budgets, k // 3)
    same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    topk = graph_us(lambda i: second.topk(k // 3, dim=-1, sorted=False), 2)
    print(f"  select_within {k // 3} of {k} equals its reference: {same}; torch.topk {topk:.1f} us")
    default = sw._warps
    for warps in (4, 8, 16):
        sw._warps = lambda candidates, w=warps: w
        t = graph_us(lambda i: sw.select_within_triton(second, budgets, k // 3), 2)
        print(f"  select_within, {warps} warps: {t:.1f} us")
    sw._warps = default


def lut_select_probe():
    g = torch.Generator(device=dev).manual_seed(0)
    for n, b in ((131072, 4), (32768, 4)):
        lut_select_shape(n, b, g)


if "lutselect" in SECTIONS:
    lut_select_probe()


def pair_probe():
    """A decode step's query + new-key hash: two `sign_hash` launches and the copy into the code buffer (the former
    decode path) against one `sign_hash_pair` launch, with and without the early weight loads; B8 and B1.
    Every line is checked against the pair's torch reference (bits flipped by rounding)."""
    from sparsekv.kernels.bits import popcount32
    from sparsekv.kernels.sign_hash import sign_hash, sign_hash_pair, sign_hash_pair_reference

    mean, kscale, qscale = 0.1 * torch.randn(HKV, D, device=dev), torch.rand(HKV, device=dev) + 0.5, torch.rand(
        HKV, device=dev) + 0.5  # fmt: skip
    weights = (w[0], w[1] * 0.1, b1, w[2])
    saved = dict(sh.TUNE)

    def probe(batch):
        qs = [torch.randn(batch, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
        ks = [torch.randn(batch, HKV, 1, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
        buffers = [torch.zeros(batch, HKV, 64, 4, dtype=torch.int32, device=dev) for _ in range(4)]
        ref_buf = torch.zeros(batch, HKV, 1, 4, dtype=torch.int32, device=dev)
        ref_q = sign_hash_pair_reference(qs[0], ks[0], ref_buf, mean, kscale, qscale, *weights)

        def two(i):  # the folded per-role launches; `mean` stands in for the keys' [Hkv, bits] output bias
            sign_hash(qs[i], *weights)
            buffers[i][:, :, 5:6] = sign_hash(ks[i], *weights, mean)

        def pair(i):
            return sign_hash_pair(qs[i], ks[i], buffers[i][:, :, 5:6], mean, kscale, qscale, *weights)

        for early in (False, True):
            sh.TUNE.update(early=early)
            t_two, t_pair = graph_us(two, 4), graph_us(pair, 4)
            got_q = pair(0)
            flips = int(popcount32(got_q ^ ref_q).sum()) + int(popcount32(buffers[0][:, :, 5:6] ^ ref_buf).sum())
            print(f"B{batch} early {early!s:5s}: q + k hash as two launches + copy {t_two:.1f} us, "
                  f"one pair launch {t_pair:.1f} us (bits flipped vs reference: {flips})", flush=True)  # fmt: skip

    for batch in (8, 1):
        probe(batch)
    sh.TUNE.update(saved)


if "pair" in SECTIONS:
    pair_probe()


def step_result(label: str, batch: int, n: int, stage: str) -> None:
    """One `run_attention` of the spotlight step: a RESULT line with one stage, the total, dense and the ratio."""
    from sparsekv.bench.attention import run_attention

    r = run_attention("spotlight", batch=batch, context=n, budget=0.02)
    us = {row["name"]: row["us"] for row in r["rows"]}
    print(f"RESULT {label:8s} {batch} {n:6d} {stage.split(' (')[0]} {us[stage]:.1f} | total "
          f"{us['total sparse step']:.1f} | dense {us['dense SDPA']:.1f} | x {r['speedup_vs_dense']:.2f}",
          flush=True)  # fmt: skip
    torch.cuda.empty_cache()


def attnshape_probe(variants=((64, 4, 4, 3), (128, 2, 8, 3), (64, 2, 8, 3))):
    """The split-K attention's tile / programs per SM / warps / stages in the whole spotlight step: a plain gather
    of the same rows reached 29.8 µs at 128 keys x 8 warps x 2 programs per SM, the attention 33.5 µs at its
    default (scripts/gpu_bytes_ceiling.py). Alternating, twice."""
    from sparsekv.kernels import _sparse_attention_triton as sa

    saved = dict(sa.TUNE)
    for _ in range(2):
        for block, mult, warps, stages in variants:
            sa.TUNE.update(block=block, sm_mult=mult, num_warps=warps, num_stages=stages)
            for batch, n in ((8, 131072), (8, 131077), (1, 32768), (8, 32768)):
                step_result(f"{block}/{mult}/{warps}/{stages}", batch, n, "attend (split-K over gathered K/V)")
    sa.TUNE.update(saved)


if "attnshape" in SECTIONS:
    attnshape_probe()


def wide_probe(capacity=32904, written=32800, window=512):
    """Gemma 3 270M's attention shapes through `sparse_attention_triton`: graph replays (one input set, the
    buffer is 0.5-4 GB), the bytes floor at 4.25 TB/s, the default launch and the five best of the sweep."""
    import functools
    import itertools

    from sparsekv.kernels import _sparse_attention_triton as sa

    saved = dict(sa.TUNE)
    cases = ((16, 1, False), (16, 1, True), (128, 1, False), (128, 1, True), (128, 9, False), (128, 9, True))
    if os.environ.get("PROBE_WIDE"):  # e.g. "192:1:window,192:9:window,192:9:buffer"
        cases = [(int(b), int(q), kind == "window") for b, q, kind in
                 (case.split(":") for case in os.environ["PROBE_WIDE"].split(","))]  # fmt: skip
    for batch, queries, windowed in cases:
        keys = torch.randn(batch, 1, capacity, 256, device=dev, dtype=torch.bfloat16, generator=gen)
        query = torch.randn(batch, 4, queries, 256, device=dev, dtype=torch.bfloat16, generator=gen)
        slots = torch.arange(capacity, device=dev)
        own = written - queries + torch.arange(queries, device=dev)  # each query's own slot
        # as lossless rounds' fixed-shape steps call it: every written slot under the row's kept slots (one row
        # for every query), causal over several queries; a window starts each query at its own first slot ([B, Q]
        # where several queries share a program: a verification's sliding layer)
        kept = torch.ones(batch, 1, 1, capacity, dtype=torch.bool, device=dev).expand(-1, -1, queries, -1)
        attend = functools.partial(
            sa.sparse_attention_triton, query, keys, torch.randn_like(keys), slots.view(1, 1, 1, -1).expand(
                batch, 1, queries, -1), kept, 0.0625, limit=torch.tensor([written], device=dev),
            causal=queries > 1)  # fmt: skip
        first = (own - window + 1).view(1, queries).expand(batch, -1) if queries > 1 else own - window + 1
        start = {"start": first} if windowed else {}
        floor = 2 * batch * (window if windowed else written) * 256 * 2 / 4.25e12 * 1e6
        reference = attend(**start).float()
        unlimited = graph_us(lambda _, attend=attend: attend(), 1)
        default = graph_us(lambda _, attend=attend, start=start: attend(**start), 1)
        # the same slots read in order, without the index list (what the fixed-shape steps' whole-buffer reads do)
        in_order = functools.partial(sa.sparse_attention_triton, query, attend.args[1], attend.args[2], None, kept,
                                     0.0625, **attend.keywords)  # fmt: skip
        order_err = float((in_order(**start).float() - reference).norm() / reference.norm())
        ordered = graph_us(lambda _, in_order=in_order, start=start: in_order(**start), 1)
        results = []
        for block, warps, mult, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 4), (2, 3)):
            sa.TUNE.update(block=block, num_warps=warps, sm_mult=mult, num_stages=stages)
            try:
                out = attend(block=block, **start).float()
            except Exception as error:  # noqa: BLE001 - a launch that does not fit an SM's shared memory
                print(f"  block {block} warps {warps} x{mult}/SM stages {stages}: {type(error).__name__}")
                continue
            us = graph_us(lambda _, attend=attend, block=block, start=start: attend(block=block, **start), 1)
            results.append((us, block, warps, mult, stages, float((out - reference).norm() / reference.norm())))
        sa.TUNE.update(saved)
        results.sort()
        print(f"B{batch} Q{queries} {'window from its start' if windowed else 'whole buffer'}: floor {floor:.1f} us"
              f" | without start {unlimited:.1f} | default {default:.1f} | in order {ordered:.1f} (err"
              f" {order_err:.0e}) | best "
              + "; ".join(f"{us:.1f} (block {b} warps {w} x{m}/SM stages {st}, err {e:.0e})"
                          for us, b, w, m, st, e in results[:5]), flush=True)  # fmt: skip
        torch.cuda.empty_cache()


if "wide" in SECTIONS:
    wide_probe()


def order_probe():
    """A whole-buffer read under a kept row: listed, in order (`reads_in_order` forced), the shipped rule, and the
    in-order read over tiles and stages; graph replays, the bytes floor at 4.25 TB/s."""
    import functools

    from sparsekv.kernels import _sparse_attention_triton as sa

    spec = os.environ.get("PROBE_ORDER", "128:3:3:64:9344:8448:1,128:3:3:64:9344:8448:9,4:8:4:128:131200:131072:1")
    saved, rule = dict(sa.TUNE), sa.reads_in_order
    for case in spec.split(","):
        batch, hkv, group, d, capacity, written, queries = (int(x) for x in case.split(":"))
        keys = torch.randn(batch, hkv, capacity, d, device=dev, dtype=torch.bfloat16, generator=gen)
        query = torch.randn(batch, hkv * group, queries, d, device=dev, dtype=torch.bfloat16, generator=gen)
        slots = torch.arange(capacity, device=dev).view(1, 1, 1, -1).expand(batch, hkv, queries, -1)
        kept = torch.ones(batch, 1, 1, capacity, dtype=torch.bool, device=dev).expand(-1, hkv, queries, -1)
        call = functools.partial(sa.sparse_attention_triton, query, keys, torch.randn_like(keys), valid=kept,
                                 scaling=d**-0.5, limit=torch.tensor([written], device=dev), causal=queries > 1)  # fmt: skip
        floor = 2 * batch * hkv * written * d * 2 / 4.25e12 * 1e6
        reference = call(indices=slots).float()
        listed = graph_us(lambda _, call=call, slots=slots: call(indices=slots), 1)
        sa.reads_in_order = lambda *_: True
        err = float((call(indices=None).float() - reference).norm() / reference.norm())
        ordered = graph_us(lambda _, call=call: call(indices=None), 1)
        results = []
        for block in (16, 32, 64, 128):
            for stages in (2, 3, 4):
                sa.TUNE.update(num_stages=stages)
                try:
                    call(indices=None, block=block)
                except Exception as error:  # noqa: BLE001 - a launch over an SM's shared memory
                    print(f"  block {block} stages {stages}: {type(error).__name__}")
                    continue
                results.append((graph_us(lambda _, call=call, block=block: call(indices=None, block=block), 1), block,
                                stages))
                sa.TUNE.update(saved)
        sa.TUNE.update(saved)
        sa.reads_in_order = rule
        shipped = graph_us(lambda _, call=call: call(indices=None), 1)
        results.sort()
        print(f"order B{batch} {hkv}x{group} d{d} {written}/{capacity} Q{queries}: floor {floor:.1f} us | listed"
              f" {listed:.1f} | in order {ordered:.1f} (err {err:.0e}) | shipped {shipped:.1f} | in order best "
              + "; ".join(f"{us:.1f} (block {b} stages {st})" for us, b, st in results[:4]), flush=True)  # fmt: skip
        torch.cuda.empty_cache()


if "order" in SECTIONS:
    order_probe()
