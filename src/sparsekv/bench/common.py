"""Timing helpers shared by the benchmarks: CUDA-graph medians over rotated inputs, copy bandwidth, shapes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from sparsekv.budget import budget_tokens as rule_tokens
from sparsekv.config import ConfigError

SHAPES = {
    # name: (query heads, kv heads, head dim)
    "llama3-8b": (32, 8, 128),
    "default": (9, 3, 64),  # SmolLM2-135M
}


@dataclass
class Row:
    name: str
    shape: str
    us: float
    bytes: float
    flops: float = 0.0
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9 if self.us > 0 else 0.0

    def to_dict(self, copy_gbps: float | None = None) -> dict:
        d = asdict(self) | {"gbps": self.gbps}
        if copy_gbps:
            d["pct_copy"] = 100.0 * self.gbps / copy_gbps
        return d


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise ConfigError("the benchmarks need a CUDA GPU (and triton); this machine has none")
    return torch.device("cuda")


def budget_tokens(budget: float, context: int) -> int:
    """A budget given as a fraction (< 1) of the context or as a token count (a whole float from the command line),
    in tokens: the decode path's rule (`sparsekv.budget`, fractions rounded up)."""
    return rule_tokens(float(budget) if budget < 1 else int(budget), context)


def check_bench_args(batch: int, context: int, budget: float, shape: str) -> None:
    """The kernel benchmarks' shared arguments, checked before anything is allocated."""
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    if not budget > 0:
        raise ConfigError(f"budget must be a fraction in (0, 1) or a token count >= 1, got {budget}")
    if budget >= 1 and budget != int(budget):
        raise ConfigError(f"a budget of tokens must be a whole number, got {budget}")
    if budget >= 1 and budget > context:
        raise ConfigError(f"budget {int(budget)} tokens exceeds the context of {context}")
    if shape not in SHAPES:
        raise ConfigError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def median_us(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def layers_for(bytes_per_layer: float, device: torch.device, cap: int = 16) -> int:
    """How many independent input sets to rotate through so the working set is >= 4x the L2 cache."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    return max(2, min(cap, math.ceil(4 * l2 / max(bytes_per_layer, 1))))


def graph_us(step: Callable[[int], object], layers: int, use_graph: bool = True) -> float:
    """Median time of step(l) per layer, for l cycling over `layers` input sets (a decode step over layers).

    With use_graph the loop over layers is one CUDA graph (launch gaps removed, as a captured decode step)."""
    for layer in range(layers):  # compile / autotune outside the capture
        step(layer)
    torch.cuda.synchronize()
    if not use_graph:
        state = {"l": 0}

        def run():
            step(state["l"])
            state["l"] = (state["l"] + 1) % layers

        return median_us(run)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(layers):
            step(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            step(layer)
    return median_us(graph.replay) / layers


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy, bytes read + written over time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    src = dst = None  # free the memory before the next section
    return 2 * nbytes / (us * 1e-6) / 1e9


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
