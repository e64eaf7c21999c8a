"""Every kernel is a PyTorch custom op `sparsekv::<name>` (torch.library): the CPU implementation is the plain-PyTorch
reference, the CUDA one the Triton kernel, and a fake implementation gives torch.compile the output's shape.

`torch.library.opcheck` checks each op's registration on fresh random CPU inputs (sizes that are not multiples of
the kernels' blocks): the schema matches what the op mutates, the fake implementation agrees with the real one,
and the op traces. The kernels' results against their references are the subject of test_kernels_triton.py (the
interpreter and CUDA) and test_kernels_reference.py.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import sparsekv.kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sparse_attention():
    gen = _gen(0)
    query = torch.randn(2, 6, 3, 24, generator=gen)
    keys, values = torch.randn(2, 2, 2, 37, 24, generator=gen)
    # distinct keys per row, as a selection lists them
    indices = torch.rand(2, 2, 3, 37, generator=gen).argsort(-1)[..., :9]
    valid = torch.rand(2, 2, 3, 9, generator=gen) > 0.3
    valid[..., 0] = True
    tickets = torch.zeros(2 * 2 * 3, dtype=torch.int32)
    window = (torch.tensor([7]), True, torch.tensor([2]))  # limit, causal, start: entries 2 to 4 + i for query i
    # no index list: every slot in order, under a row of kept slots (or none) shared by the queries
    kept = (torch.rand(2, 2, 1, 37, generator=gen) > 0.3).expand(2, 2, 3, 37).clone()
    kept[..., 0] = True
    return [(query, keys, values, indices, valid, 0.2, None, None), (query, keys, values, indices, None, 0.2, tickets, None),
            (query, keys, values, indices, valid, 0.2, None, torch.tensor([5])),
            (query, keys, values, indices, None, 0.2, None, *window),
            (query, keys, values, None, kept, 0.2, None, torch.tensor([30])),
            (query, keys, values, None, None, 0.2, tickets, torch.tensor([37]), True)]  # fmt: skip


def _codes(shape, gen):
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _hamming_scores():
    gen = _gen(10)
    return [
        (_codes((2, 6, 3, 3), gen), _codes((2, 2, 37, 3), gen), 70),
        (_codes((1, 3, 1, 1), gen), _codes((1, 3, 41, 1), gen), 32),
    ]


def _hamming_topk():
    gen = _gen(11)
    qc, kc = _codes((2, 6, 3, 3), gen), _codes((2, 2, 37, 3), gen)
    kc[:, :, 20:] = kc[:, :, :1]  # equal scores
    hint = torch.zeros(2 * 2 * 3, dtype=torch.int32)
    return [
        (qc, kc, 9, 70, False, 0, 0, None),
        (qc, kc, 9, 70, True, 2, 3, hint),
        (qc, kc, 50, 70, True, 1, 1, None),  # k above the keys: every key
    ]


def _hamming_topk_fixed():
    gen = _gen(12)
    qc, kc = _codes((2, 6, 1, 3), gen), _codes((2, 2, 37, 3), gen)
    kc[:, :, 20:] = kc[:, :, :1]
    hint = torch.zeros(2 * 2, dtype=torch.int32)
    return [
        (qc, kc, 9, torch.tensor([23]), 70, 2, 3, None, True, None),
        (qc, kc, 9, torch.tensor([37]), 70, 0, 0, hint, True, None),
        (qc, kc, 30, torch.tensor([5]), 70, 1, 2, None, True, None),  # more picks than written slots: empty ones
        (qc, kc, 9, torch.tensor([23]), 70, 2, 3, None, False, None),  # the picks alone
        # each row its own count of the best, padded with position 0
        (qc, kc, 9, torch.tensor([23]), 70, 2, 3, hint, False, torch.tensor([9, 7, 5, 8], dtype=torch.int32)),
    ]


def _select_topk():
    gen = _gen(13)
    ints = torch.randint(-3, 40, (2, 3, 2, 37), generator=gen, dtype=torch.int32)
    floats = torch.randn(2, 3, 2, 37, generator=gen)
    counts = torch.randint(4, 10, (2 * 3 * 2,), generator=gen, dtype=torch.int32)
    return [(ints, 9, -3, 39, None), (ints.to(torch.int16), 9, None, None, None), (floats, 9, None, None, None),
            (ints, 50, -3, 39, None), (ints, 9, -3, 39, counts), (floats, 9, None, None, counts)]  # fmt: skip


def _top_p_threshold():
    gen = _gen(14)
    weights = torch.softmax(torch.randn(5, 37, generator=gen) * 3, -1)
    valid = torch.rand(5, 37, generator=gen) < 0.8
    return [(weights, valid, 0.9), (weights, valid, 0.5)]


def _sign_hash():
    gen = _gen(1)
    x, keys = torch.randn(2, 6, 3, 24, generator=gen), torch.randn(2, 2, 5, 24, generator=gen)
    linear, b2 = torch.randn(2, 24, 40, generator=gen), torch.randn(2, 40, generator=gen)
    w1, b1 = torch.randn(2, 24, 20, generator=gen), torch.randn(2, 20, generator=gen)
    w2, wr = torch.randn(2, 20, 45, generator=gen), torch.randn(2, 24, 45, generator=gen)
    return [(x, linear, None, None, None, b2), (keys, w1, w2, b1, wr, None), (x, w1, w2, None, None, None)]


def _sign_hash_pair():
    gen = _gen(2)
    query, keys = torch.randn(2, 6, 1, 24, generator=gen), torch.randn(2, 2, 3, 24, generator=gen)
    key_mean = torch.randn(2, 24, generator=gen)
    key_scale, query_scale = torch.rand(2, 2, generator=gen) + 0.5
    w1, b1 = torch.randn(2, 24, 20, generator=gen), torch.randn(2, 20, generator=gen)
    w2, wr = torch.randn(2, 20, 45, generator=gen), torch.randn(2, 24, 45, generator=gen)
    code_buffer = torch.zeros(2, 2, 10, 2, dtype=torch.int32)  # key_out is a view of its rows 4..6
    linear_out = torch.zeros(2, 2, 3, 1, dtype=torch.int32)
    fixed_buffer = torch.zeros(2, 2, 11, 2, dtype=torch.int32)  # a fixed-shape buffer: rows at device slots
    slots = torch.tensor([8, 2, 5])
    return [
        (query, keys, code_buffer[:, :, 4:7], key_mean, key_scale, query_scale, w1, w2, b1, wr, None),
        (query, keys, linear_out, key_mean, key_scale, query_scale, w1, None, None, None, None),
        (query, keys, fixed_buffer, key_mean, key_scale, query_scale, w1, w2, b1, wr, slots),
    ]


def _int4_qk():
    from sparsekv.kernels.int4_qk import quantize_int4

    gen = _gen(3)
    query = torch.randn(2, 6, 3, 24, generator=gen)
    packed, scale, zero = quantize_int4(torch.randn(2, 2, 37, 24, generator=gen))
    shared = torch.randint(0, 37, (2, 2, 3, 9), generator=gen)
    per_head = torch.randint(0, 37, (2, 6, 3, 9), generator=gen)
    return [(query, packed, scale, zero, shared), (query, packed, scale, zero, per_head)]


def _quest_page_scores():
    gen = _gen(4)
    query = torch.randn(2, 6, 3, 24, generator=gen)
    page_min = torch.randn(2, 2, 7, 24, generator=gen)
    page_max = page_min + torch.rand(2, 2, 7, 24, generator=gen)
    return [(query, page_min, page_max, reduce) for reduce in ("sum", "max", "none")]


def _int32_words(shape, gen) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _lut_tables(gen, q: int = 3):
    from sparsekv.kernels.lut_score import quantized_lut

    return quantized_lut(torch.randn(2, 6, q, 40, generator=gen), torch.randn(2, 2, 10, 16, 4, generator=gen))


def _lut_scores():
    gen = _gen(5)
    table, step = _lut_tables(gen)
    return [(table, step, _int32_words((2, 2, 37, 2), gen))]


def _lut_topk_fixed():
    gen = _gen(13)
    table, _ = _lut_tables(gen, q=1)
    codes = _int32_words((2, 2, 37, 2), gen)
    codes[:, :, 20:] = codes[:, :, :1]  # equal scores
    forced = torch.tensor([[[4, 2**31 - 1, 30], [9, 2, 2**31 - 1]]] * 2)
    return [
        (table, codes, 9, torch.tensor([23]), forced, 2, 3, None),
        (table, codes, 9, torch.tensor([37]), forced[..., :1], 0, 0, None),
        (table, codes, 30, torch.tensor([5]), forced, 1, 2, None),  # more picks than written slots: empty ones come in
        # each row its own count of the best, padded with position 0
        (table, codes, 9, torch.tensor([23]), forced, 2, 3, torch.tensor([9, 4, 7, 1], dtype=torch.int32)),
    ]


def _select_within():
    gen = _gen(14)
    values = torch.randn(2, 3, 1, 40, generator=gen)
    values[0, 0, 0, :6] = float("-inf")
    values[1, :, :, 10:20] = 0.25  # equal values
    budgets = torch.tensor([[[12], [0], [40]], [[5], [9], [11]]])
    return [(values, budgets, 16), (values, budgets, 45), (values.double(), budgets, 1)]


def _compressed_kv_fields(gen, channel_axis: bool) -> tuple:
    """A random `CompressedKV`'s fields in declaration order (b=2, h=2, n=37, d=40): the ops' kv arguments.
    Token axis: 3-bit magnitudes, no zero, sink and tail copies; channel axis: 4 bits, a zero, midrise."""
    from dataclasses import fields

    from sparsekv.kernels.compressed_kv import CompressedKV

    b, h, n, d = 2, 2, 37, 40
    k_bits = 4 if channel_axis else 3

    def scales(*shape):
        return (torch.rand(*shape, generator=gen) * 0.1 + 0.01).to(torch.float16)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)

    k_scale = scales(b, h, -(-(n + 5) // 16), d) if channel_axis else scales(b, h, n, d // 8)
    kv = CompressedKV(
        sign_bits=_int32_words((b, h, n, 2), gen), k_mag=codes(b, h, n, d * k_bits // 8), k_scale=k_scale,
        k_zero=scales(*k_scale.shape) if channel_axis else None, v=codes(b, h, n, d * 2 // 8),
        v_scale=scales(b, h, n, d // 8), v_zero=scales(b, h, n, d // 8) - 0.05,
        mu=torch.randn(b, h, 1, d, generator=gen), alpha=torch.rand(b, h, 1, d, generator=gen) + 0.5,
        k_bits=k_bits, v_bits=2, midrise=channel_axis, k_scale_tokens=16 if channel_axis else 1,
        k_scale_offset=5 if channel_axis else 0,
    )  # fmt: skip
    if not channel_axis:
        positions = torch.stack([torch.randperm(n, generator=gen)[:5].sort().values for _ in range(b * h)])
        unused = torch.full((b * h, 2), 2**31 - 1)
        kv.sink_positions = torch.cat([positions, unused], -1).view(b, h, 7).to(torch.int32)
        kv.sink_keys, kv.sink_values = torch.randn(2, b, h, 7, d, generator=gen).to(torch.bfloat16)
        kv.tail_first = n - 20
        kv.tail_keys, kv.tail_values = torch.randn(2, b, h, 20, d, generator=gen).to(torch.bfloat16)
    return tuple(getattr(kv, field.name) for field in fields(kv))


def _compressed_key_scores():
    gen = _gen(6)
    query = torch.randn(2, 2, 3, 40, generator=gen)
    heads = torch.randn(2, 2, 3, 3, 40, generator=gen)  # each query head of a kv head's group
    index = torch.randint(0, 37, (2, 2, 3, 11), generator=gen)
    tail_from = torch.tensor([17, 18, 37])
    return [(q, index, tail_from, *_compressed_kv_fields(gen, channel)) for channel in (False, True)
            for q in (query, heads)]  # fmt: skip


def _compressed_attention():
    gen = _gen(7)
    query = torch.randn(2, 6, 3, 40, generator=gen)
    indices = torch.randint(0, 37, (2, 2, 3, 11), generator=gen)
    valid = torch.rand(2, 2, 3, 11, generator=gen) > 0.3
    valid[..., 0] = True
    tail_from = torch.tensor([17, 18, 37])
    return [
        (query, indices, valid, 0.15, tf32, tail_from, *_compressed_kv_fields(gen, channel))
        for channel, tf32 in ((False, False), (True, True))
    ]


def _scored_attention():
    gen = _gen(9)
    scores = torch.randn(2, 2, 3, 3, 13, generator=gen)  # [B, H, G, Q, C]: 13 candidates a row
    pick = torch.stack([torch.randperm(13, generator=gen)[:6] for _ in range(12)]).view(2, 2, 3, 6)
    indices = torch.randint(0, 37, (2, 2, 3, 6), generator=gen)
    valid = torch.rand(2, 2, 3, 6, generator=gen) > 0.3
    valid[..., 0] = True
    tail_from = torch.tensor([17, 18, 37])
    return [
        (scores, pick, indices, valid, 0.15, tail_from, dtype, *_compressed_kv_fields(gen, channel))
        for channel, dtype in ((False, torch.float32), (True, torch.bfloat16))
    ]


def _write_slots():
    gen = _gen(8)
    samples = []
    for new, dim in ((1, 24), (5, 40)):
        key_buffer, value_buffer = torch.randn(2, 3, 2, 37, dim, generator=gen)
        # a model's projections [B, n, H, d] seen as [B, H, n, d]: not contiguous
        keys, values = torch.randn(2, 3, new, 2, dim, generator=gen).transpose(2, 3)
        samples.append((key_buffer, value_buffer, torch.randperm(37, generator=gen)[:new], keys, values))
    return samples


#: op name -> sample argument tuples (the op's own positional schema)
SAMPLES = {
    "sparse_attention": _sparse_attention,
    "hamming_scores": _hamming_scores,
    "hamming_topk": _hamming_topk,
    "hamming_topk_fixed": _hamming_topk_fixed,
    "select_topk": _select_topk,
    "top_p_threshold": _top_p_threshold,
    "sign_hash": _sign_hash,
    "sign_hash_pair": _sign_hash_pair,
    "int4_qk": _int4_qk,
    "quest_page_scores": _quest_page_scores,
    "lut_scores": _lut_scores,
    "lut_topk_fixed": _lut_topk_fixed,
    "select_within": _select_within,
    "compressed_key_scores": _compressed_key_scores,
    "compressed_attention": _compressed_attention,
    "scored_attention": _scored_attention,
    "write_slots": _write_slots,
}


def import_kernel_modules() -> None:
    """Registers every op (a kernel module registers its ops when imported)."""
    for module in pkgutil.iter_modules(sparsekv.kernels.__path__):
        importlib.import_module(f"sparsekv.kernels.{module.name}")


def _registered_ops() -> set[str]:
    import_kernel_modules()
    return {n.removeprefix("sparsekv::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("sparsekv::")}


def test_every_op_has_samples_and_a_cuda_kernel():
    ops = _registered_ops()
    assert ops == set(SAMPLES)
    for name in ops:  # the CUDA kernel is the Triton one: registered for "cuda", not left to the reference
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsekv::{name}", "CUDA"), name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_registration(name):
    import_kernel_modules()
    op = getattr(torch.ops.sparsekv, name)
    for args in SAMPLES[name]():
        torch.library.opcheck(op, args)
