"""Speed-of-light probe for the 128K x B8 decode step: how fast can this GPU move the bytes that a
Spotlight step must move, whatever the kernels do around them?

- the codes: 134 MB read as one stream (the scorer's reads, without its score writes);
- the K/V rows: 2621 of 131072 positions in each of 64 kv-head rows, 256-byte bf16 rows of K and of V (86 MB),
  gathered and summed (no attention arithmetic), over a sweep of launch shapes; the same bytes as 512-byte and
  1 KB rows, in random order, and as contiguous runs, to show what the access pattern costs;
- the split-K attention kernel over the same positions, for comparison;
- the two byte streams back to back and concurrently: the floor of any kernel design for these bytes.

    python3 scripts/gpu_bytes_ceiling.py [bytes,launches]    # on a CUDA machine; the table comes last
"""

import sys

import torch
import triton
import triton.language as tl

from sparsekv.bench.common import copy_bandwidth_gbps, graph_us
from sparsekv.kernels import _sparse_attention_triton as sa
from sparsekv.kernels._tl_utils import pdl_enter
from sparsekv.kernels._triton import pdl_launch

dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
B, HQ, HKV, D, N = 8, 32, 8, 128, 131072
ROWS, K = B * HKV, int(0.02 * N)
SECTIONS = sys.argv[1] if len(sys.argv) > 1 else "bytes,launches"
SETS = 2  # input sets cycled through, so a replay does not find the previous one's rows in L2


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr):
    """Reads x [n, 4] int32 (16-byte tokens) in contiguous slices, one per program; XOR-folds them."""
    start = tl.program_id(0).to(tl.int64) * per_prog
    end = tl.minimum(start + per_prog, n)
    acc = tl.zeros([BLOCK, 4], dtype=tl.int32)
    cols = tl.arange(0, 4)
    for j in range(start, end, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs[:, None] * 4 + cols[None, :], mask=(offs < end)[:, None], other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _gather_kernel(k_ptr, v_ptr, idx_ptr, out_ptr, kk, split_len, row_stride, E: tl.constexpr,
                   BLOCK: tl.constexpr, UNROLL: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """Program (split, row) gathers the rows listed in idx[row, slice] (E elements each) from k (and v) and
    sums them: the attention's gathers without its arithmetic."""
    sp = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    e = tl.arange(0, E)
    acc = tl.zeros([BLOCK, E], dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, kk)
    for j in range(start, end, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            offs = j + u * BLOCK + tl.arange(0, BLOCK)
            ok = offs < end
            idx = tl.load(idx_ptr + r * kk + offs, mask=ok, other=0).to(tl.int64)
            acc += tl.load(
                k_ptr + r * row_stride + idx[:, None] * E + e[None, :], mask=ok[:, None], other=0.0
            )
            if TWO:
                acc += tl.load(
                    v_ptr + r * row_stride + idx[:, None] * E + e[None, :], mask=ok[:, None], other=0.0
                )
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + sp, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _hop_kernel(in_ptr, out_ptr, USE_PDL: tl.constexpr = False):
    """One stage of a dependent chain: every program reads what the previous stage wrote, then writes."""
    pdl_enter(USE_PDL)
    tl.store(out_ptr + tl.program_id(0), tl.load(in_ptr) + 1)


@triton.jit
def _barrier_kernel(ctr_ptr, buf_ptr, BARRIERS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One launch, all programs resident, BARRIERS grid-wide barriers: each program writes, waits for every
    program, then reads a neighbour's write. The counter only grows: a program's ticket t says which barrier
    episode it is in, and the episode ends at the next multiple of the grid size."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    grid = tl.num_programs(0)
    x = tl.load(buf_ptr + p)
    for _ in tl.static_range(BARRIERS):
        tl.store(buf_ptr + p, x + 1)
        tl.debug_barrier()
        target = (tl.atomic_add(ctr_ptr, 1, sem="acq_rel") // grid + 1) * grid
        while tl.atomic_add(ctr_ptr, 0, sem="acquire") < target:
            pass
        x = tl.load(buf_ptr + (p + 1) % grid, cache_modifier=".cg")
    tl.store(buf_ptr + p, x)


def chain(bufs, stages, programs, pdl):
    for s in range(stages):
        _hop_kernel[(programs,)](bufs[s % 2], bufs[(s + 1) % 2], **(pdl_launch(dev) if pdl else {}))


def stream(x, out, mult=8, block=256, warps=4):
    progs = mult * SMS
    n = x.shape[0]
    _stream_kernel[(progs,)](x, out, n, triton.cdiv(n, progs), BLOCK=block, num_warps=warps)


def gather(k, v, idx, out, cfg):
    block, warps, mult, unroll, stages = cfg
    kk, e = idx.shape[1], k.shape[-1]
    splits = max(1, mult * SMS // ROWS)
    split_len = triton.cdiv(triton.cdiv(kk, splits), block * unroll) * block * unroll
    splits = triton.cdiv(kk, split_len)
    _gather_kernel[(splits, ROWS)](k, v if v is not None else k, idx, out, kk, split_len, k.shape[1] * e, E=e,
                                   BLOCK=block, UNROLL=unroll, TWO=v is not None, num_warps=warps,
                                   num_stages=stages)  # fmt: skip


def positions(kk, n, order="sorted"):
    if order == "runs":  # kk contiguous positions from a random start
        start = torch.randint(0, n - kk, (ROWS, 1), device=dev, generator=gen)
        return (start + torch.arange(kk, device=dev)).to(torch.int32)
    idx = torch.rand(ROWS, n, device=dev, generator=gen).argsort(-1)[:, :kk]
    return (idx.sort(-1).values if order == "sorted" else idx).to(torch.int32)


def bytes_ceiling(report):
    """The step's bytes: the codes stream, the K/V gathers, the attention, both streams together."""
    codes = [torch.randint(-2**31, 2**31 - 1, (ROWS * N, 4), device=dev, dtype=torch.int32, generator=gen)
             for _ in range(SETS)]  # fmt: skip
    sink = torch.empty(1 << 16, device=dev, dtype=torch.float32)
    isink = torch.empty(1 << 16, device=dev, dtype=torch.int32)
    code_bytes = codes[0].numel() * 4
    best_stream = None
    for mult in (4, 8, 16):
        for block in (256, 512, 1024):
            for warps in (4, 8):
                t = graph_us(lambda i, c=(mult, block, warps): stream(codes[i], isink, *c), SETS)
                report(f"stream codes 134 MB, {mult}/SM block {block} warps {warps}", code_bytes, t)
                if best_stream is None or t < best_stream[1]:
                    best_stream = ((mult, block, warps), t)
    report("torch.amax over the codes (134 MB)", code_bytes, graph_us(lambda i: torch.amax(codes[i]), SETS))
    # dense decode attention over as many K/V bytes as the codes: what a long-tuned read kernel reaches
    qd = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
    kvd = [torch.randn(2, B, HKV, code_bytes // (2 * 2 * B * HKV * D), D, device=dev, dtype=torch.bfloat16,
                       generator=gen) for _ in range(SETS)]  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = graph_us(lambda i: sdpa(qd, kvd[i][0], kvd[i][1], enable_gqa=True), SETS)
    report("dense SDPA decode over 134 MB of K/V (B8, 4096 keys)", code_bytes, t)
    kvd.clear()

    ks = [torch.randn(ROWS, N, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(SETS)]
    vs = [torch.randn(ROWS, N, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(SETS)]
    idx = [positions(K, N) for _ in range(SETS)]
    kv_bytes = 2 * ROWS * K * D * 2
    best = None
    for block in (32, 64, 128):
        for warps in (4, 8):
            for mult in (2, 4, 8):
                for unroll, stages in ((1, 1), (2, 1), (1, 3)):
                    cfg = (block, warps, mult, unroll, stages)
                    try:
                        t = graph_us(lambda i, cfg=cfg: gather(ks[i], vs[i], idx[i], sink, cfg), SETS)
                    except Exception as error:  # noqa: BLE001 (out of resources for a shape: skip it)
                        print(f"gather {cfg}: {type(error).__name__}", flush=True)
                        continue
                    report(f"gather K+V 256 B rows sorted, block/warps/mult/unroll/stages {cfg}", kv_bytes, t)
                    if best is None or t < best[1]:
                        best = (cfg, t)
    cfg = best[0]
    for order in ("random", "runs"):
        other = [positions(K, N, order) for _ in range(SETS)]
        t = graph_us(lambda i, other=other: gather(ks[i], vs[i], other[i], sink, cfg), SETS)
        report(f"gather K+V 256 B rows {order}, {cfg}", kv_bytes, t)
    del vs
    for e, kk in ((256, K), (512, K // 2)):  # the same bytes as fewer, wider rows (views of the K buffers)
        wide = [x.view(ROWS, N * D // e, e) for x in ks]
        pos = [positions(kk, N * D // e) for _ in range(SETS)]
        for c in {cfg, (cfg[0] // 2, *cfg[1:])}:
            t = graph_us(lambda i, wide=wide, pos=pos, c=c: gather(wide[i], None, pos[i], sink, c), SETS)
            report(f"gather {2 * e} B rows sorted, {c}", kk * ROWS * e * 2, t)

    vs = [torch.randn(ROWS, N, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(SETS)]
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
    idx4 = [x.view(B, HKV, 1, K) for x in idx]
    k4 = [x.view(B, HKV, N, D) for x in ks]
    v4 = [x.view(B, HKV, N, D) for x in vs]
    tickets = torch.zeros(B * HKV, dtype=torch.int32, device=dev)
    saved = dict(sa.TUNE)
    for block, mult, warps, stages in ((64, 4, 4, 3), (128, 2, 8, 3), (64, 2, 8, 3), (128, 4, 8, 3), (64, 2, 4, 3),
                                       (32, 8, 4, 3), (128, 2, 8, 2), (64, 4, 4, 3)):  # fmt: skip
        sa.TUNE.update(block=block, sm_mult=mult, num_warps=warps, num_stages=stages)
        t = graph_us(lambda i: sa.sparse_attention_triton(q, k4[i], v4[i], idx4[i], None, D**-0.5, tickets=tickets),
                     SETS)  # fmt: skip
        report(f"sparse_attention_triton, same positions, {(block, mult, warps, stages)}", kv_bytes, t)
    sa.TUNE.update(saved)

    t = graph_us(
        lambda i: (stream(codes[i], isink, *best_stream[0]), gather(ks[i], vs[i], idx[i], sink, cfg)), SETS
    )
    report("stream codes, then gather K+V (back to back)", code_bytes + kv_bytes, t)
    side = torch.cuda.Stream()

    def both(i):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gather(ks[i], vs[i], idx[i], sink, cfg)
        stream(codes[i], isink, *best_stream[0])
        torch.cuda.current_stream().wait_stream(side)

    report(
        "stream codes and gather K+V concurrently (two streams)", code_bytes + kv_bytes, graph_us(both, SETS)
    )

    return best_stream, cfg


def launch_floor(table):
    """The 32K x B1 step's latency: dependent launches and grid barriers."""
    # the 32K x B1 step is six dependent launches: what does a chain of empty ones cost?
    bufs = [torch.zeros(SMS, device=dev, dtype=torch.int32) for _ in range(2)]
    for stages in (1, 6):
        for programs in (1, SMS):
            for pdl in (False, True):
                t = graph_us(lambda i, c=(stages, programs, pdl): chain(bufs, *c), SETS)
                table.append(
                    (f"chain of {stages} dependent launches, {programs} programs, PDL {pdl}", t, 0.0)
                )
                print(table[-1], flush=True)

    ctr = torch.zeros(1, device=dev, dtype=torch.int32)
    for barriers in (0, 1, 3, 5):
        t = graph_us(
            lambda i, n=barriers: _barrier_kernel[(SMS,)](ctr, bufs[0], BARRIERS=n, **pdl_launch(dev)), SETS
        )
        table.append((f"one launch of {SMS} programs with {barriers} grid barriers", t, 0.0))
        print(table[-1], flush=True)


def main():
    table = []
    copy = copy_bandwidth_gbps(dev)

    def report(name, nbytes, us):
        table.append((name, us, nbytes / us / 1e3))
        print(f"{name}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s ({100 * nbytes / us / 1e3 / copy:.0f}% of copy)",
              flush=True)  # fmt: skip

    best_stream = cfg = None
    if "bytes" in SECTIONS:
        best_stream, cfg = bytes_ceiling(report)
    if "launches" in SECTIONS:
        launch_floor(table)

    print(f"\n{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy:.0f} GB/s (read + write)")  # fmt: skip
    sweeps = ("stream codes 134 MB", "gather K+V 256 B rows sorted, block")
    keep = [row for row in table if not row[0].startswith(sweeps)]
    if best_stream is not None:
        print(f"best stream {best_stream[0]}, best gather {cfg}")
        best = [
            min((row for row in table if row[0].startswith(prefix)), key=lambda row: row[1])
            for prefix in sweeps
        ]
        keep = best + keep
    for name, us, gbps in keep:
        rate = f"{gbps:6.0f} GB/s {100 * gbps / copy:4.0f}%" if gbps else ""
        print(f"{name[:78]:78s} {us:8.1f} us {rate}")


if __name__ == "__main__":
    main()
