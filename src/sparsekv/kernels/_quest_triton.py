"""Quest page scores: one program per (batch, kv head, query, block of pages); every query head of the group
reads the same page min/max tile, and the group reduction happens in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.kernels._tl_utils import chunk_and_row
from sparsekv.kernels._triton import row_grid

_REDUCE = {"sum": 0, "max": 1, "none": 2}


@triton.jit
def _quest_kernel(
    q_ptr,
    mn_ptr,
    mx_ptr,
    out_ptr,
    P,
    Q,
    HKV,
    sqb,
    sqh,
    sqq,
    smb,
    smh,
    smp,
    sxb,
    sxh,
    sxp,
    sob,
    soh,
    soq,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
    REDUCE: tl.constexpr,
):
    pb, r = chunk_and_row()
    qi = r % Q
    kvh = (r // Q) % HKV
    b = r // (Q * HKV)
    pages = pb * BLOCK + tl.arange(0, BLOCK)
    pm = pages < P
    d = tl.arange(0, DP)
    dm = d < D
    m2 = pm[:, None] & dm[None, :]
    mn = tl.load(
        mn_ptr + b.to(tl.int64) * smb + kvh.to(tl.int64) * smh + pages[:, None] * smp + d[None, :],
        mask=m2,
        other=0.0,
    ).to(tl.float32)
    mx = tl.load(
        mx_ptr + b.to(tl.int64) * sxb + kvh.to(tl.int64) * sxh + pages[:, None] * sxp + d[None, :],
        mask=m2,
        other=0.0,
    ).to(tl.float32)
    if REDUCE == 1:
        acc = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    for h in tl.static_range(G):
        q = tl.load(
            q_ptr + b.to(tl.int64) * sqb + (kvh * G + h).to(tl.int64) * sqh + qi.to(tl.int64) * sqq + d,
            mask=dm,
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(tl.maximum(q[None, :] * mx, q[None, :] * mn), axis=1)
        if REDUCE == 2:
            o = out_ptr + b.to(tl.int64) * sob + (kvh * G + h).to(tl.int64) * soh + qi.to(tl.int64) * soq
            tl.store(o + pages, s, mask=pm)
        elif REDUCE == 1:
            acc = tl.maximum(acc, s)
        else:
            acc += s
    if REDUCE != 2:
        o = out_ptr + b.to(tl.int64) * sob + kvh.to(tl.int64) * soh + qi.to(tl.int64) * soq
        tl.store(o + pages, acc, mask=pm)


def quest_page_scores_triton(query, page_min, page_max, *, group_reduce="sum"):
    b, hq, q, d = query.shape
    hkv, p = page_min.shape[1], page_min.shape[2]
    g = hq // hkv
    heads_out = hq if group_reduce == "none" else hkv
    out = torch.empty(b, heads_out, q, p, dtype=torch.float32, device=query.device)
    if p == 0:
        return out
    query, page_min, page_max = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query, page_min, page_max)
    )
    block = 32 if d >= 128 else 64
    _quest_kernel[row_grid("quest_page_scores", query.shape, triton.cdiv(p, block), b * hkv * q)](
        query, page_min, page_max, out, p, q, hkv,
        *query.stride()[:3], *page_min.stride()[:3], *page_max.stride()[:3], *out.stride()[:3],
        G=g, D=d, DP=triton.next_power_of_2(d), BLOCK=block, REDUCE=_REDUCE[group_reduce], num_warps=4,
    )  # fmt: skip
    return out
