"""The pruner contract: shrink a selector's candidates to a varlen subset (per selection head and query)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.config import SparseConfig
from sparsekv.step import DecodeStep, LayerInfo, Selection


@dataclass
class Pruner:
    config: SparseConfig
    layer: LayerInfo

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
        """Builds the pruner's own state (e.g. quantized keys) from the prompt."""

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Extends the state with newly cached tokens."""

    def crop(self, length: int) -> None:
        """Rolls the state back to the first `length` cached tokens."""

    def begin_fixed_shape(self, capacity: int) -> None:
        """Fixed-shape decoding starts (`SparseCache.begin_fixed_shape`): room for `capacity` tokens, once."""

    def append_fixed_shape(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        """`append` of one token at a device position [1] (no host count changes: a CUDA graph replays it)."""

    def end_fixed_shape(self, length: int) -> None:
        """Fixed-shape decoding ends with `length` tokens cached."""

    def prune(self, step: DecodeStep, selection: Selection) -> Selection:
        """The kept subset of `selection`. A fixed-shape step (`step.hints.fixed`) keeps the selection's width and
        marks what it drops invalid (no host read of the kept counts)."""
        raise NotImplementedError
