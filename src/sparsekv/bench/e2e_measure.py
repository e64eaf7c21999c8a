"""Timing and memory of the end-to-end bench: wall time of a region, peak GPU memory, the bytes a cache holds,
the kernels of one decode step."""

from __future__ import annotations

import gc
import time

import torch

from sparsekv.config import SparseConfig


class Clock:
    """Wall time of a region: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_above(device: torch.device, base: int) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _tensor_bytes(obj, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr() if obj.device.type != "meta" else id(obj)
        if key in seen or obj.untyped_storage().nbytes() == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    return 0


def cache_bytes(cache) -> int:
    """Bytes the cache holds on its device (allocated capacity): K/V buffers and every tensor of the selectors'
    and pruners' state (hash weights excluded: they are modules, not cache)."""
    seen: set[int] = set()
    total = 0
    for layer in cache.layers:
        total += _tensor_bytes([layer._key_buffer, layer._value_buffer], seen)
        for part in (layer.selector, layer.pruner):
            if part is None:
                continue
            if hasattr(part, "memory_breakdown"):
                total += sum(part.memory_breakdown().values())
                continue
            for value in vars(part).values():
                if isinstance(value, torch.nn.Module):
                    continue
                total += _tensor_bytes(value, seen)
                if hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, SparseConfig)):
                    total += _tensor_bytes(vars(value), seen)
    return total


def profile_step(step, tok: torch.Tensor, pos: torch.Tensor, top: int = 40) -> dict:
    """GPU kernels of one eager decode step (torch.profiler): count, total kernel time, the heaviest names."""
    from torch.profiler import ProfilerActivity, profile

    step(tok, pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(tok, pos)
        torch.cuda.synchronize()
    try:
        kernels = [e for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA"]
        per_name: dict[str, list] = {}
        for e in kernels:
            entry = per_name.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += getattr(e, "device_time_total", None) or getattr(e, "self_device_time_total", 0.0)
        ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])
        result = {
            "kernels": len(kernels),
            "kernel_us": sum(v[1] for v in per_name.values()),
            "top": [{"name": k, "count": c, "us": us} for k, (c, us) in ranked[:top]],
        }
    except Exception as error:  # noqa: BLE001 - profiler API differences: keep the table below
        result = {"error": f"{type(error).__name__}: {error}"}
    try:
        result["table"] = prof.key_averages().table(sort_by="device_time_total", row_limit=top)
    except Exception as error:  # noqa: BLE001
        result["table_error"] = str(error)
    return result
