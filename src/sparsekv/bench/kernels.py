"""Per-kernel benchmark: median time, bytes moved, achieved bandwidth vs copy bandwidth, and torch baselines."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekv.bench.common import (
    SHAPES,
    Row,
    budget_tokens,
    check_bench_args,
    copy_bandwidth_gbps,
    device_name,
    graph_us,
    layers_for,
    require_cuda,
)


def run_kernels(
    batch: int = 8, context: int = 131072, budget: float = 0.02, shape: str = "llama3-8b"
) -> dict:
    from sparsekv.kernels import _hamming_triton as ham
    from sparsekv.kernels import _topk_triton as tk
    from sparsekv.kernels.sparse_attention import sparse_attention

    check_bench_args(batch, context, budget, shape)
    dev = require_cuda()
    hq, hkv, d = SHAPES[shape]
    g = hq // hkv
    n = context
    k = budget_tokens(budget, n)
    bits, words = 128, 4
    rows_kv = batch * hkv
    out: list[Row] = []
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd_codes(*shape_):
        return torch.randint(-(2**31), 2**31 - 1, shape_, device=dev, dtype=torch.int32, generator=gen)

    # --- hamming scoring
    code_bytes = rows_kv * n * words * 4
    L = layers_for(code_bytes, dev)
    qc = [rnd_codes(batch, hq, 1, words) for _ in range(L)]
    kc = [rnd_codes(batch, hkv, n, words) for _ in range(L)]
    out.append(
        Row(
            "hamming_scores (int32 out)",
            f"B{batch} Hkv{hkv} N{n} 128b g{g}",
            graph_us(lambda i: ham.hamming_scores_triton(qc[i], kc[i], bits=bits), L),
            code_bytes + rows_kv * n * 4,
        )
    )
    out.append(
        Row(
            "hamming score+histogram (int16 out)",
            f"B{batch} Hkv{hkv} N{n} 128b g{g}",
            graph_us(lambda i: ham.hamming_score_hist(qc[i], kc[i], bits=bits), L),
            code_bytes + rows_kv * n * 2,
        )
    )
    default = dict(ham.TUNE)
    for pps in (16, 32):  # the default is 8 (one wave at the scorer's registers)
        ham.TUNE.update(progs_per_sm=pps)
        out.append(Row(f"  score+hist progs/SM={pps}", "sweep",
                       graph_us(lambda i: ham.hamming_score_hist(qc[i], kc[i], bits=bits), L),
                       code_bytes + rows_kv * n * 2))  # fmt: skip
    ham.TUNE.update(default)
    states = [ham.hamming_score_hist(qc[i], kc[i], bits=bits) for i in range(L)]
    sel_bytes = rows_kv * n * 2 + rows_kv * k * 8
    out.append(
        Row(
            "select from histogram (radix level 2 + compaction)",
            f"{rows_kv} rows x {n}, k={k}",
            graph_us(lambda i: ham.hamming_select(states[i], k), L),
            sel_bytes,
        )
    )
    hints = [torch.zeros(rows_kv, dtype=torch.int32, device=dev) for _ in range(L)]
    for i in range(L):  # a previous step leaves each layer's threshold as the window's centre
        ham.hamming_select(ham.hamming_score_hist(qc[i], kc[i], bits=bits, threshold_hint=hints[i]), k)
    windowed = [ham.hamming_score_hist(qc[i], kc[i], bits=bits, threshold_hint=hints[i]) for i in range(L)]
    out.append(Row("select, threshold inside the window (compaction only)", f"{rows_kv} rows x {n}, k={k}",
                   graph_us(lambda i: ham.hamming_select(windowed[i], k), L), sel_bytes))  # fmt: skip
    out.append(Row("  score + window histogram", "sweep",
                   graph_us(lambda i: ham.hamming_score_hist(qc[i], kc[i], bits=bits, threshold_hint=hints[i]),
                            L), code_bytes + rows_kv * n * 2))  # fmt: skip
    windowed = None
    recent = [
        ham.hamming_score_hist(qc[i], kc[i], bits=bits, recent_first=True, sink=4, local=64) for i in range(L)
    ]
    out.append(Row("  select, recent-first ties + sink 4 + local 64", "sweep",
                   graph_us(lambda i: ham.hamming_select(recent[i], k), L), sel_bytes))  # fmt: skip
    recent = None

    def sub(i, stage):
        st = states[i]
        flat = st.scores.view(-1, st.scores.shape[-1])
        kw = {"lo": 0, "levels": st.levels, "nbits": st.nbits, "is_float": False, "block": st.block,
              "num_chunks": st.num_chunks, "bpc": st.bpc}  # fmt: skip
        if stage == "levels":
            return tk.radix_levels(flat, k, hist=st.hist, first_done=True, **kw)
        return tk.radix_compact(flat, k, st.hist, **kw)

    for stage in ("levels", "compact"):
        out.append(Row(f"  select stage: {stage}", "sweep", graph_us(lambda i, st=stage: sub(i, st), L),
                       rows_kv * n * 2))  # fmt: skip
    int_scores = [st.scores for st in states]  # int16 [B, Hkv, 1, N]
    out.append(
        Row(
            "select_topk int (hist+threshold+compact)",
            f"{rows_kv} rows x {n} int16, k={k}",
            graph_us(lambda i: tk.select_topk_int(int_scores[i], k, 0, g * bits), L),
            2 * rows_kv * n * 2 + rows_kv * k * 8,
        )
    )
    out.append(
        Row(
            "torch.topk int16 kv-head rows",
            f"{rows_kv} rows x {n} int16, k={k}",
            graph_us(lambda i: torch.topk(int_scores[i], k, dim=-1, sorted=False), L),
            rows_kv * n * 2 + rows_kv * k * 10,
        )
    )
    qc = kc = states = int_scores = None  # free the memory before the next section
    # --- float selection over query-head rows (the oracle / generic path)
    rows_q = batch * hq
    fl_bytes = rows_q * n * 4
    Lf = layers_for(fl_bytes, dev, cap=4)
    fs = [torch.randn(batch, hq, 1, n, device=dev, generator=gen) for _ in range(Lf)]
    out.append(
        Row(
            "select_topk float (4x8-bit radix)",
            f"{rows_q} rows x {n} fp32, k={k}",
            graph_us(lambda i: tk.select_topk_float(fs[i], k), Lf),
            5 * fl_bytes + rows_q * k * 8,
        )
    )
    out.append(
        Row(
            "torch.topk fp32 q-head rows",
            f"{rows_q} rows x {n} fp32, k={k}",
            graph_us(lambda i: torch.topk(fs[i], k, dim=-1, sorted=False), Lf),
            fl_bytes + rows_q * k * 12,
        )
    )
    fs = None  # free the memory before the next section
    # --- the other scorers (Quest pages, Twilight INT4 estimate + top-p, self-index LUT)
    from sparsekv.kernels import _int4_triton, _lut_triton, _quest_triton, _top_p_triton
    from sparsekv.kernels.lut_score import SENTINEL, quantized_lut

    pages = n // 16
    qb = [torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    pmin = [
        torch.randn(batch, hkv, pages, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2)
    ]
    pmax = [m + 1 for m in pmin]
    out.append(Row("quest_page_scores (GQA sum)", f"B{batch} Hkv{hkv} pages{pages} d{d} bf16",
                   graph_us(lambda i: _quest_triton.quest_page_scores_triton(qb[i], pmin[i], pmax[i]), 2),
                   2 * rows_kv * pages * d * 2 + rows_kv * pages * 4))  # fmt: skip
    pmin = pmax = None
    cand = n // 4  # Twilight's conservative first-stage budget
    packed = [torch.randint(0, 256, (batch, hkv, n, d // 2), device=dev, dtype=torch.uint8, generator=gen)
              for _ in range(2)]  # fmt: skip
    scl = [torch.rand(batch, hkv, n, device=dev, generator=gen) for _ in range(2)]
    cidx = [torch.randint(0, n, (batch, hkv, 1, cand), device=dev, generator=gen) for _ in range(2)]
    out.append(Row("int4_qk (gathered candidates)", f"B{batch} Hq{hq} K{cand} d{d}",
                   graph_us(lambda i: _int4_triton.int4_qk_triton(qb[i], packed[i], scl[i], scl[i], cidx[i]), 2),
                   rows_kv * cand * (d // 2 + 8 + 8) + batch * hq * cand * 4))  # fmt: skip
    for blk, nw in ((32, 4), (64, 4), (128, 8)):
        _int4_triton.TUNE.update(block=blk, num_warps=nw)
        out.append(Row(f"  int4_qk block={blk} warps={nw}", "sweep",
                       graph_us(lambda i: _int4_triton.int4_qk_triton(qb[i], packed[i], scl[i], scl[i], cidx[i]), 2),
                       rows_kv * cand * (d // 2 + 8 + 8) + batch * hq * cand * 4))  # fmt: skip
    _int4_triton.TUNE.update(block=128, num_warps=4)
    packed = scl = cidx = None
    Lp = 4
    wts = [torch.softmax(torch.randn(batch * hq, cand, device=dev, generator=gen) * 3, -1) for _ in range(Lp)]
    vmask = torch.ones(batch * hq, cand, dtype=torch.bool, device=dev)
    out.append(Row("top_p_threshold p=0.9 (bisection)", f"{batch * hq} rows x {cand}",
                   graph_us(lambda i: _top_p_triton.top_p_threshold_triton(wts[i], vmask, 0.9), Lp),
                   batch * hq * cand * (4 + 1 + 1)))  # fmt: skip
    wts = None
    lcodes = [rnd_codes(batch, hkv, n, d // 32) for _ in range(2)]
    cent = torch.randn(batch, hkv, d // 4, 16, 4, device=dev, generator=gen)
    lut_tables = [quantized_lut(qb[i], cent) for i in range(2)]
    out.append(Row("lut_scores (self-index)", f"B{batch} Hkv{hkv} N{n} d{d}",
                   graph_us(lambda i: _lut_triton.lut_scores_triton(*lut_tables[i], lcodes[i]), 2),
                   rows_kv * n * (d // 8 + 4)))  # fmt: skip
    # the self-index step's first stage: 3 x the budget's candidates, 32 sinks listed
    wide, written = 3 * k, torch.tensor([n], device=dev)
    sinks = torch.full((batch, hkv, 32), SENTINEL, device=dev)
    out.append(Row("lut_topk_fixed (score + select)", f"B{batch} Hkv{hkv} N{n} d{d}, k={wide}",
                   graph_us(lambda i: _lut_triton.lut_topk_fixed_triton(lut_tables[i][0], lcodes[i], wide, written,
                                                                        sinks, local=64), 2),
                   rows_kv * n * (d // 8 + 2)))  # fmt: skip
    lcodes = qb = None
    # --- attention
    dt = torch.bfloat16
    kv_bytes = 2 * rows_kv * n * d * 2
    La = 2
    qs = [torch.randn(batch, hq, 1, d, device=dev, dtype=dt, generator=gen) for _ in range(La)]
    ks = [torch.randn(batch, hkv, n, d, device=dev, dtype=dt, generator=gen) for _ in range(La)]
    vs = [torch.randn(batch, hkv, n, d, device=dev, dtype=dt, generator=gen) for _ in range(La)]
    idx = [torch.rand(batch, hkv, 1, n, device=dev, generator=gen).topk(k, dim=-1).indices for _ in range(La)]
    out.append(
        Row(
            "sparse_attention (split-K, GQA shared)",
            f"B{batch} Hq{hq} Hkv{hkv} d{d} K{k}",
            graph_us(lambda i: sparse_attention(qs[i], ks[i], vs[i], idx[i], None, d**-0.5), La),
            rows_kv * k * (2 * d * 2 + 8),
        )
    )
    from sparsekv.kernels import _sparse_attention_triton as sat

    default_att = dict(sat.TUNE)
    for blk, mult, nw, ns in ((32, 4, 4, 2), (64, 4, 4, 3), (32, 8, 4, 3), (64, 2, 8, 3), (128, 2, 8, 2)):
        sat.TUNE.update(block=blk, sm_mult=mult, num_warps=nw, num_stages=ns)
        out.append(Row(f"  attention block={blk} sm_mult={mult} warps={nw} stages={ns}", "sweep",
                       graph_us(lambda i: sparse_attention(qs[i], ks[i], vs[i], idx[i], None, d**-0.5), La),
                       rows_kv * k * (2 * d * 2 + 8)))  # fmt: skip
    sat.TUNE.update(default_att)
    out.append(
        Row(
            "dense SDPA (enable_gqa)",
            f"B{batch} Hq{hq} Hkv{hkv} d{d} N{n}",
            graph_us(lambda i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True), La),
            kv_bytes,
        )
    )
    qs = ks = vs = None  # free the memory before the next section
    copy = copy_bandwidth_gbps(dev)
    return {
        "device": device_name(),
        "batch": batch,
        "context": n,
        "budget_tokens": k,
        "shape": shape,
        "copy_gbps": copy,
        "rows": [r.to_dict(copy) for r in out],
    }
