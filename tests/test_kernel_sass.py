"""Machine-code properties of the hot kernels, compiled for sm_90 on this machine (scripts/kernel_sass.py): the
selection's score loads stay 16-byte vectors on padded rows, the GQA head adders halve the scorer's POPC, and the
attention over an all-valid selection loads no mask."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton's compiler (not the interpreter)",
)


@pytest.fixture(scope="module")
def kernel_sass():
    """scripts/kernel_sass.py as a module."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import kernel_sass
    finally:
        sys.path.pop(0)
    if not Path(kernel_sass._tool("ptxas")).exists():
        pytest.skip("triton without its bundled NVIDIA tools")
    return kernel_sass


@pytest.fixture(scope="module")
def sass(kernel_sass):
    def summary(kernel, div16_drop=(), **overrides):
        fn, sig, constexprs, div16, warps = kernel_sass._kernels()[kernel]
        div16 = tuple(n for n in div16 if n not in div16_drop)
        line, _ = kernel_sass.summarise(kernel_sass.compile_sm90(fn, sig, constexprs | overrides, div16, warps, 3))
        return line

    return summary


def test_compaction_score_loads_are_vectors_on_padded_rows(sass):
    padded = sass("compact")
    assert "LDG.E.U16" not in padded and "LDG.E.128" in padded, padded
    # a row length that is not a multiple of 16 bounds the loads at N and splits them: what the padding avoids
    assert "LDG.E.U16" in sass("compact", div16_drop=("N", "n_load"))


def test_head_adders_halve_the_popcounts(sass):
    def popc(line):
        return int(line.split("POPC ")[1].split(",")[0])

    combined, per_head = popc(sass("score")), popc(sass("score", HEADS0=0))
    assert combined <= per_head // 2 + 1, (combined, per_head)


def test_attention_over_all_valid_selections_loads_no_mask(sass):
    assert "LDG.E.U8" in sass("attention")  # the valid mask: one byte per index
    assert "LDG.E.U8" not in sass("attention", VALID=False), sass("attention", VALID=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_default_attention_launch_fits_an_sms_shared_memory(kernel_sass, dtype):
    """`default_block`'s launch of the split-K attention compiles within an H100/H200 SM's shared memory for every
    row width, with the fewest and the most query rows a program holds (shared memory grows with both; float32 rows
    of 256 channels with 64 query rows took 262,400 bytes at 32 tokens a step)."""
    from sparsekv.kernels import _sparse_attention_triton as sa

    fn, sig, constexprs, div16, warps = kernel_sass._kernels()["attention"]
    sig = sig | {name: "*" + dtype for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    cases = itertools.product((64, 128, 256), (16, sa.PACKED_ROWS), (False, True), (False, True))
    for channels, rows, window, every_slot in cases:
        # window: a sliding layer's step, packed queries each from its own start (a verification's); every_slot:
        # the slots read in order, without an index list (their K/V tiles staged in shared memory)
        block = sa.default_block(channels, rows, window=window, element_size=4 if dtype == "fp32" else 2,
                                 every_slot=every_slot, rows_over_sms=True)  # fmt: skip  (the larger in-order tile)
        launch = constexprs | {"GP": rows, "G": rows if rows > 16 else 4, "GC": rows, "D": channels, "DP": channels,
                               "BLOCK": block, "PACKED": rows > 16, "CAUSAL": rows > 16, "VALID_PER_QUERY": False,
                               "LIMIT": True, "START": window, "START_PER_QUERY": window and rows > 16,
                               "EVERY_SLOT": every_slot, "PREC": "tf32x3" if dtype == "fp32" else "tf32"}  # fmt: skip
        shared = kernel_sass.compile_sm90(fn, sig, launch, div16, warps, sa.TUNE["num_stages"]).metadata.shared
        assert shared <= sa.SHARED_MEMORY_BYTES, (channels, rows, window, every_slot, block, shared)
