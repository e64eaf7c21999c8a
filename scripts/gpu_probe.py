"""Device probe (issues 9/10): query-hash precision variants, prompt-key hashing tile sizes, and the histogram
modes of the radix select.

    python3 scripts/gpu_probe.py [hash,select]     # on a CUDA machine; prints one line per variant
"""

import sys

import torch
import triton

from sparsekv.bench.common import graph_us
from sparsekv.kernels import _hamming_triton as ham
from sparsekv.kernels import _sign_hash_triton as sh
from sparsekv.kernels import _topk_triton as tk

SECTIONS = sys.argv[1] if len(sys.argv) > 1 else "hash,select"
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
B, HQ, HKV, D, N = 8, 32, 8, 128, 131072
K = int(0.02 * N)
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
w = [torch.randn(HKV, D, D, device=dev, generator=gen) * D**-0.5 for _ in range(3)]
b1 = torch.zeros(HKV, D, device=dev)


def hash_launch(x, ws, bias, prec, bm, warps, key_bias):
    """One `_sign_hash_kernel` launch over x [B, H, M, D] with explicit precision / rows per program / warps (the
    wrapper picks these itself; the probe sweeps them)."""
    heads, m = x.shape[1], x.shape[2]
    out = torch.empty(B, heads, m, 4, dtype=torch.int32, device=dev)
    rows = heads // HKV * m  # rows of one kv head's group
    sh._sign_hash_kernel[(triton.cdiv(rows, bm), B * HKV)](
        x, ws[0], ws[1], bias, ws[2], bias, out, rows, HKV, heads * m * D, rows * D, D,
        ws[0].stride(0), ws[0].stride(1), ws[1].stride(0), ws[1].stride(1),
        D=D, HID=D, BITS=128, MLP=True, BIAS=True, RESID=True, BIAS2=key_bias, PREC=prec, BM=bm,
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
        us = {
            warps: graph_us(lambda i, ws=ws, dt=dt, prec=prec, warps=warps:
                            hash_launch(q, ws, b1.to(dt), prec, 16, warps, False), 4)
            for warps in (4, 8)
        }  # fmt: skip
        print(
            f"sign_hash q [{B},{HQ},1,{D}] {name}: "
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
    keys = None  # free it before the select section
codes = [
    torch.randint(-(2**31), 2**31 - 1, (B, HKV, N, 4), device=dev, dtype=torch.int32, generator=gen)
    for _ in range(4)
]
qc = [
    torch.randint(-(2**31), 2**31 - 1, (B, HQ, 1, 4), device=dev, dtype=torch.int32, generator=gen)
    for _ in range(4)
]
for prefetch in (False, True):
    tk.PREFETCH["on"] = prefetch
    for score_mode in ("packed", "atomic"):
        tk.HIST_MODE["mode"] = score_mode
        states = [ham.hamming_score_hist(qc[i], codes[i], bits=128, recent_first=True) for i in range(4)]
        t_score = graph_us(lambda i: ham.hamming_score_hist(qc[i], codes[i], bits=128, recent_first=True), 4)
        t_sel = graph_us(lambda i, states=states: ham.hamming_select(states[i], K), 4)
        print(
            f"prefetch {prefetch!s:5s} scorer hist {score_mode:6s}: score {t_score:.1f} us, "
            f"select {t_sel:.1f} us, sum {t_score + t_sel:.1f} us",
            flush=True,
        )
tk.HIST_MODE["mode"] = "packed"
tk.PREFETCH["on"] = True
