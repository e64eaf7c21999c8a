"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU and summarise its machine code:
registers, shared memory, instructions, POPC, barriers and the width of its global loads.

Triton's wheel carries ptxas and cuobjdump, so this costs no device time. It answers questions such as "are the
score loads 16 bytes wide?" or "how many barriers does one compaction tile take?" before a timed run
(docs/kernels-notes.md). Argument types follow the decode path at 128K x B8; integer arguments
named in --div16 are assumed multiples of 16, as Triton's specialisation assumes for such values at run time.

    python scripts/kernel_sass.py compact [--warps 2] [--set BLOCK=1024] [--odd-n] [--dump out.sass]
    python scripts/kernel_sass.py score   [--set PREFETCH=False --set HEADS0=0]
    python scripts/kernel_sass.py attention [--stages 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

I32 = "i32"


def _kernels() -> dict:
    from sparsekv.kernels import _hamming_triton as ham
    from sparsekv.kernels import _sparse_attention_triton as sa
    from sparsekv.kernels import _topk_triton as tk

    compact_sig = {"src_ptr": "*i16", "out_ptr": "*i64", "hist_ptr": "*i32", "N": I32, "n_load": I32,
                   "stride_row": I32, "lo": I32, "k": I32, "num_rows": I32, "num_chunks": I32,
                   "blocks_per_chunk": I32, "base_ptr": "*i32", "hint_ptr": "*i32", "top": I32}  # fmt: skip
    score_sig = {name: "*i32" for name in ("q_ptr", "k_ptr", "hist_ptr", "hint_ptr", "base_ptr")}
    score_sig["out_ptr"] = "*i16"
    score_sig |= {name: I32 for name in ("N", "Q", "HKV", "bits", "num_chunks", "blocks_per_chunk", "sqb", "sqh",
                                         "sqq", "skb", "skh", "skn", "sob", "soh", "soq", "sink", "local",
                                         "forced_score")}  # fmt: skip
    attn_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "idx_ptr": "*i64", "valid_ptr": "*u8",
                "o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16", "tickets_ptr": "*i32",
                "limit_ptr": "*i64", "start_ptr": "*i64"}  # fmt: skip
    attn_sig |= {name: I32 for name in ("S", "Q", "K", "split_len", "num_splits", "HQ", "g")}
    attn_sig["qk_scale"] = "fp32"
    attn_sig |= {name: I32 for name in ("sqb", "sqh", "sqq", "skb", "skh", "skn", "svb", "svh", "svn", "sib",
                                        "sis", "siq", "svlb", "svls", "svlq", "sstb", "sstq")}  # fmt: skip
    return {
        "compact": (tk._compact_kernel, compact_sig,
                    {"LEVELS": 2, "NBITS": 5, "CP": 16, "IS_FLOAT": False, "BLOCK": tk.SELECT_TUNE["block"],
                     "REVERSE": True, "WINDOW": True, "INLINE_STORE": True, "USE_PDL": True, "counts_ptr": None,
                     "COUNTS": False},
                    ("N", "n_load", "stride_row", "blocks_per_chunk", "num_chunks"), tk.SELECT_TUNE["num_warps"]),
        "compact_pairs": (tk._compact_pairs_kernel, compact_sig,
                          {"LEVELS": 2, "NBITS": 5, "CP": 16, "BLOCK": tk.SELECT_TUNE["block"], "W": tk.SCORE_PAIRS,
                           "REVERSE": True, "WINDOW": True, "INLINE": True, "USE_POPC": True, "USE_PDL": True,
                           "counts_ptr": None, "COUNTS": False},
                          ("N", "n_load", "stride_row", "blocks_per_chunk", "num_chunks"),
                          tk.SELECT_TUNE["num_warps"]),
        "score": (ham._hamming_kernel, score_sig,
                  {"G": 4, "W": 4, "WP": 4, "BLOCK": ham.TUNE["block"], "HIST": True, "NBITS": 5, "LEVELS": 2,
                   "FULL": True, "VEC": True, "USE_POPC": True, "REVERSE": True, "PACKED": 4,
                   "WINDOW": True, "HSLOT": 2, "USE_PDL": True, "HEADS0": 4, "HEADS1": 0, "PREFETCH": True,
                   "ROTATE": ham.TUNE["rotate"], "written_ptr": None, "FIXED": False},
                  ("N", "sqb", "sqh", "skb", "skh", "skn", "sob", "soh", "num_chunks", "blocks_per_chunk"),
                  ham.TUNE["num_warps"]),
        "attention": (sa._partial_kernel, attn_sig,
                      {"G": 4, "GP": 16, "D": 128, "DP": 128, "BLOCK": sa.TUNE["block"], "VALID": True,
                       "MERGE": True, "GC": 4, "SP": 8, "PREC": "tf32", "USE_PDL": True, "PACKED": False,
                       "LIMIT": False, "VALID_PER_QUERY": True, "CAUSAL": False, "START": False,
                       "START_PER_QUERY": False, "EVERY_SLOT": False},
                      ("sqb", "sqh", "skb", "skh", "skn", "svb", "svh", "svn", "sib", "sis", "svlb", "svls",
                       "split_len"), sa.TUNE["num_warps"]),
    }  # fmt: skip


def compile_sm90(fn, signature: dict, constexprs: dict, div16, num_warps: int, num_stages: int, maxnreg=None):
    sig = signature | {name: "constexpr" for name in constexprs}
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})  # fmt: skip


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def summarise(compiled) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    loads = collections.Counter(op for op in ops if op.startswith("LDG"))
    regs = re.search(r"REG:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    line = (f"registers {regs.group(1) if regs else '?'}, local (spills) {local.group(1) if local else '?'} B, "
            f"shared {shared.group(1) if shared else '?'} B, "
            f"{len(ops)} instructions, POPC {sum(op.startswith('POPC') for op in ops)}, "
            f"BAR.SYNC {sum(op.startswith('BAR.SYNC') for op in ops)}, global loads {dict(loads)}")  # fmt: skip
    return line, sass


def main() -> None:
    kernels = _kernels()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=sorted(kernels))
    ap.add_argument("--warps", type=int, help="num_warps (default: the library's launch value)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a constexpr")
    ap.add_argument("--odd-n", action="store_true", help="N (and n_load) not known to be a multiple of 16")
    ap.add_argument("--dump", help="write the full SASS here")
    ap.add_argument("--maxnreg", type=int, help="register cap per thread (the launch option)")
    args = ap.parse_args()
    fn, sig, constexprs, div16, warps = kernels[args.kernel]
    constexprs = dict(constexprs)
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in constexprs:
            ap.error(f"{name} is not a constexpr of {args.kernel}: {sorted(constexprs)}")
        constexprs[name] = {"True": True, "False": False}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    if args.odd_n:
        div16 = tuple(n for n in div16 if n not in ("N", "n_load"))
    line, sass = summarise(compile_sm90(fn, sig, constexprs, div16, args.warps or warps, args.stages, args.maxnreg))
    print(f"{args.kernel} (sm_90, {args.warps or warps} warps): {line}")
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
