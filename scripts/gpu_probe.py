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
if "hash" in SECTIONS:
    for name, dt, prec in (
        ("fp32 tf32x3", torch.float32, "tf32x3"),
        ("fp32 ieee", torch.float32, "ieee"),
        ("fp32 tf32", torch.float32, "tf32"),
        ("bf16", torch.bfloat16, "tf32"),
    ):
        ws = [t.to(dt) for t in w]
        orig = sh._sign_hash_kernel.fn if hasattr(sh._sign_hash_kernel, "fn") else None
        us = {}
        for warps in (4, 8):

            def run(i, ws=ws, warps=warps, prec=prec):
                out = torch.empty(B, HQ, 1, 4, dtype=torch.int32, device=dev)
                sh._sign_hash_kernel[(1, B * HKV)](
                    q,
                    ws[0],
                    ws[1],
                    b1.to(ws[0].dtype),
                    ws[2],
                    b1.to(ws[0].dtype),
                    out,
                    4,
                    HKV,
                    HQ * D,
                    4 * D,
                    D,
                    ws[0].stride(0),
                    ws[0].stride(1),
                    ws[1].stride(0),
                    ws[1].stride(1),
                    D=D,
                    HID=D,
                    BITS=128,
                    MLP=True,
                    BIAS=True,
                    RESID=True,
                    BIAS2=False,
                    PREC=prec,
                    BM=16,
                    num_warps=warps,
                )
                return out

            us[warps] = graph_us(run, 4)
        print(
            f"sign_hash q [{B},{HQ},1,{D}] {name}: "
            + ", ".join(f"{w_} warps {u:.1f} us" for w_, u in us.items()),
            flush=True,
        )

    # prompt keys: one layer's 128K x B8 keys through the same kernel (rows per program = BM)
    keys = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16, generator=gen)
    for bm, warps in ((16, 8), (64, 8), (128, 8)):

        def run_keys(i, bm=bm, warps=warps):
            out = torch.empty(B, HKV, N, 4, dtype=torch.int32, device=dev)
            sh._sign_hash_kernel[(triton.cdiv(N, bm), B * HKV)](
                keys,
                w[0],
                w[1],
                b1,
                w[2],
                b1,
                out,
                N,
                HKV,
                HKV * N * D,
                N * D,
                D,
                w[0].stride(0),
                w[0].stride(1),
                w[1].stride(0),
                w[1].stride(1),
                D=D,
                HID=D,
                BITS=128,
                MLP=True,
                BIAS=True,
                RESID=True,
                BIAS2=True,
                PREC="tf32x3",
                BM=bm,
                num_warps=warps,
            )
            return out

        try:
            print(
                f"sign_hash prompt keys [{B},{HKV},{N},{D}] fp32 tf32x3 BM={bm}: {graph_us(run_keys, 1):.0f} us",
                flush=True,
            )
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
