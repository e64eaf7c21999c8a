"""Data parallelism of `eval compare` under torchrun: one process per GPU (or CPU process), each evaluating a share
of the comparison's cells, the results gathered and merged in the original order.

    torchrun --nproc-per-node 4 -m sparsekv.cli eval compare --device cuda ...

`Shard` says which cells a rank owns (cell i goes to rank i % world) and gathers any picklable object from every
rank. `data_parallel(device)` reads torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK): with more than one
process it starts the process group (NCCL and cuda:LOCAL_RANK for a CUDA device, else gloo on CPU) and destroys it on
exit; without torchrun it yields the single-process shard and the device unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from sparsekv.config import ConfigError

LAUNCH_HINT = "launch it as `torchrun --nproc-per-node N -m sparsekv.cli eval compare ...`"


@dataclass(frozen=True)
class Shard:
    """This process's place among `world` processes; `gather_fn(obj)` returns every rank's obj, in rank order."""

    rank: int = 0
    world: int = 1
    gather_fn: Callable[[Any], list] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Cell `index` (in the comparison's order) is evaluated by rank index % world."""
        return index % self.world == self.rank

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, ordered by rank (a collective: every rank calls it, the same number of times)."""
        if self.world == 1:
            return [obj]
        return self.gather_fn(obj)


SINGLE = Shard()


def _all_gather_object(obj: Any) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _env_int(name: str, default: str | None = None) -> int:
    text = os.environ.get(name, default)
    if text is None:
        raise ConfigError(f"WORLD_SIZE is set but {name} is not: {LAUNCH_HINT}")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}: {LAUNCH_HINT}") from None


def world_from_env() -> tuple[int, int, int]:
    """(world, rank, local_rank) from torchrun's environment; (1, 0, 0) without it."""
    world = _env_int("WORLD_SIZE", "1")
    if world <= 1:
        if world < 1:
            raise ConfigError(f"WORLD_SIZE must be >= 1, got {world}")
        return 1, 0, 0
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is outside 0..{world - 1} (WORLD_SIZE {world})")
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"WORLD_SIZE is {world} but {' and '.join(missing)} {verb} not set: {LAUNCH_HINT}")
    return world, rank, local_rank


def _device_type(device: str) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device expects cpu, cuda, cuda:1, ...; got {device!r}") from None


@contextlib.contextmanager
def data_parallel(device: str) -> Iterator[tuple[Shard, str]]:
    """(shard, device of this rank). Under torchrun with WORLD_SIZE > 1: a CUDA `device` becomes cuda:LOCAL_RANK
    (NCCL), any other stays as given (gloo); the process group lives for the block."""
    world, rank, local_rank = world_from_env()
    if world == 1:
        yield SINGLE, device
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed: run eval compare in one process")
    cuda = _device_type(device) == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"cannot run on {device}: this machine has no CUDA GPU (use --device cpu)")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                              "run at most one process per GPU")  # fmt: skip
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None)
    try:
        yield Shard(rank=rank, world=world, gather_fn=_all_gather_object), device
        if owned:  # the block ended on every rank: no rank tears the group down while another still talks to it
            dist.barrier()
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
