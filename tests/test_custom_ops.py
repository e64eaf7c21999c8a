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
    indices = torch.randint(0, 37, (2, 2, 3, 9), generator=gen)
    valid = torch.rand(2, 2, 3, 9, generator=gen) > 0.3
    valid[..., 0] = True
    tickets = torch.zeros(2 * 2 * 3, dtype=torch.int32)
    return [(query, keys, values, indices, valid, 0.2, None), (query, keys, values, indices, None, 0.2, tickets)]


#: op name -> sample argument tuples (the op's own positional schema)
SAMPLES = {
    "sparse_attention": _sparse_attention,
}


def _registered_ops() -> set[str]:
    for module in pkgutil.iter_modules(sparsekv.kernels.__path__):
        importlib.import_module(f"sparsekv.kernels.{module.name}")
    return {n.removeprefix("sparsekv::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("sparsekv::")}


def test_every_op_has_samples_and_a_cuda_kernel():
    ops = _registered_ops()
    assert ops == set(SAMPLES)
    for name in ops:  # the CUDA kernel is the Triton one: registered for "cuda", not left to the reference
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsekv::{name}", "CUDA"), name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_registration(name):
    op = getattr(torch.ops.sparsekv, name)
    for args in SAMPLES[name]():
        torch.library.opcheck(op, args)
