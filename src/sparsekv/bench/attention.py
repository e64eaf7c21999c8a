"""Full sparse decode attention (score + select + attend) against dense SDPA in the same run.

Each stage and the whole step are timed as CUDA graphs over several layers' worth of independent inputs (so the
working set exceeds the L2 cache, as in a real decode step), and reported per layer."""

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
    require_cuda,
)
from sparsekv.config import ConfigError

METHOD_BITS = {"spotlight": 128, "lsh": 1024}


def _hash_query(q: torch.Tensor, hash_args: tuple) -> torch.Tensor:
    """Spotlight's query hash as the selector runs it on CUDA (per kv head: sign(silu(q W1 + b1) W2 + q W),
    float32 weights, one kernel), or linear LSH sign(q R)."""
    from sparsekv.kernels.sign_hash import sign_hash

    return sign_hash(q, *hash_args)


def run_attention(
    method: str = "spotlight",
    batch: int = 8,
    context: int = 131072,
    budget: float = 0.02,
    shape: str = "llama3-8b",
    use_graph: bool = True,
    layers: int | None = None,
) -> dict:
    from sparsekv.kernels._hamming_triton import hamming_score_hist, hamming_select
    from sparsekv.kernels.sparse_attention import sparse_attention

    if method not in METHOD_BITS:
        raise ConfigError(f"method must be one of {', '.join(sorted(METHOD_BITS))}, got {method!r}")
    check_bench_args(batch, context, budget, shape)
    dev = require_cuda()
    hq, hkv, d = SHAPES[shape]
    bits = METHOD_BITS[method]
    words = bits // 32
    k = budget_tokens(budget, context)
    dt = torch.bfloat16
    kv_bytes = 2 * batch * hkv * context * d * 2
    if layers is None:
        free = torch.cuda.mem_get_info(dev)[0]
        layers = max(2, min(4, int(0.6 * free // (kv_bytes * 1.1)), -(-256 * 2**20 // kv_bytes)))
    gen = torch.Generator(device=dev).manual_seed(0)
    data = []
    for _ in range(layers):
        keys = torch.randn(batch, hkv, context, d, device=dev, dtype=dt, generator=gen)
        values = torch.randn(batch, hkv, context, d, device=dev, dtype=dt, generator=gen)
        # a view of a buffer with capacity in multiples of 64 keys, as the selectors' code caches hold them
        codes = torch.randint(
            -(2**31), 2**31 - 1, (batch, hkv, -(-context // 64) * 64, words), device=dev, dtype=torch.int32,
            generator=gen,
        )[:, :, :context]
        q = torch.randn(batch, hq, 1, d, device=dev, dtype=dt, generator=gen)
        f32 = torch.float32
        if method == "spotlight":  # MLP d -> d -> bits plus the linear branch d -> bits
            hash_args = (
                torch.randn(hkv, d, d, device=dev, dtype=f32, generator=gen) * d**-0.5,
                torch.randn(hkv, d, bits, device=dev, dtype=f32, generator=gen) * d**-0.5,
                torch.zeros(hkv, d, device=dev, dtype=f32),
                torch.randn(hkv, d, bits, device=dev, dtype=f32, generator=gen),
            )
        else:
            hash_args = (torch.randn(hkv, d, bits, device=dev, dtype=f32, generator=gen),)
        data.append((q, keys, values, codes, hash_args))
    scale = d**-0.5
    # each layer's threshold window (the selectors keep one per layer): 0 = cold, no previous threshold
    hints = [torch.zeros(batch * hkv, dtype=torch.int32, device=dev) for _ in range(layers)]
    cold = [torch.zeros(batch * hkv, dtype=torch.int32, device=dev) for _ in range(layers)]
    # and its split-K attention's tickets (the row's last split merges the partials: no combine launch)
    tickets = [torch.zeros(batch * hkv, dtype=torch.int32, device=dev) for _ in range(layers)]

    def scored(i, hint=None):
        q, _, _, c, h = data[i]
        return hamming_score_hist(_hash_query(q, h), c, bits=bits, recent_first=True, threshold_hint=hint)

    # stage inputs computed once, so each stage can be timed alone
    states = [scored(i) for i in range(layers)]
    idx = [hamming_select(st, k) for st in states]
    for i in range(layers):  # a first step leaves each layer's threshold in its window
        hamming_select(scored(i, hints[i]), k)
    warm = [scored(i, hints[i]) for i in range(layers)]  # the threshold falls inside the window
    missed = [scored(i, cold[i]) for i in range(layers)]  # a window of base 0: outside, the radix levels run

    def score(i):
        return scored(i, hints[i])

    def select(i):
        return hamming_select(warm[i], k)

    def select_miss(i):
        return hamming_select(missed[i], k)

    def select_plain(i):
        return hamming_select(states[i], k)

    def attend(i):
        q, kk, vv, *_ = data[i]
        return sparse_attention(q, kk, vv, idx[i], None, scale, tickets=tickets[i])

    def total(i):
        q, kk, vv, *_ = data[i]
        selected = hamming_select(scored(i, hints[i]), k)
        return sparse_attention(q, kk, vv, selected, None, scale, tickets=tickets[i])

    def total_plain(i):
        q, kk, vv, *_ = data[i]
        return sparse_attention(q, kk, vv, hamming_select(scored(i), k), None, scale, tickets=tickets[i])

    def dense(i):
        q, kk, vv, *_ = data[i]
        return F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)

    # correctness of the timed step against the dense reference restricted to the same indices
    from sparsekv.kernels.sparse_attention import sparse_attention_reference

    q, kk, vv, *_ = data[0]
    b0 = slice(0, 1)
    ref = sparse_attention_reference(
        q[b0].float(), kk[b0].float(), vv[b0].float(), idx[0][b0], None, scale
    )
    got = attend(0)[b0].float()
    rel_err = float((got - ref).norm() / ref.norm())

    rows_n = batch * hkv
    code_bytes = rows_n * context * words * 4
    score_bytes = rows_n * context * 2
    gather_bytes = rows_n * k * (2 * d * 2 + 8)
    sel_bytes = score_bytes + rows_n * k * 8
    step_bytes = code_bytes + 2 * score_bytes + rows_n * k * 8 + gather_bytes
    rows = [
        Row("score (hash + hamming + window histogram)", shape, graph_us(score, layers, use_graph),
            code_bytes + score_bytes),
        Row("select (threshold in the window + compaction)", shape, graph_us(select, layers, use_graph),
            sel_bytes),
        Row("attend (split-K over gathered K/V)", shape, graph_us(attend, layers, use_graph), gather_bytes),
        Row("total sparse step", shape, graph_us(total, layers, use_graph), step_bytes),
        Row("dense SDPA", shape, graph_us(dense, layers, use_graph), kv_bytes),
        # the same step when the threshold leaves the window (2 radix passes), and without a window (1 pass)
        Row("  select, threshold outside the window", shape, graph_us(select_miss, layers, use_graph),
            3 * score_bytes + rows_n * k * 8),
        Row("  select without a window (radix level 2 + compaction)", shape,
            graph_us(select_plain, layers, use_graph), 2 * score_bytes + rows_n * k * 8),
        Row("  total sparse step without a window", shape, graph_us(total_plain, layers, use_graph),
            step_bytes + score_bytes),
    ]  # fmt: skip
    copy = copy_bandwidth_gbps(dev)
    return {
        "device": device_name(),
        "method": method,
        "batch": batch,
        "context": context,
        "budget_tokens": k,
        "shape": shape,
        "cuda_graph": use_graph,
        "layers_rotated": layers,
        "copy_gbps": copy,
        "attend_rel_err": rel_err,
        "speedup_vs_dense": rows[4].us / rows[3].us,
        "speedup_vs_dense_without_window": rows[4].us / rows[7].us,
        "rows": [r.to_dict(copy) for r in rows],
    }
