"""The pruner contract: shrink a selector's candidates to a varlen subset (per selection head and query)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.config import SparseConfig
from sparsekv.selectors.base import DecodeStep, LayerInfo, Selection


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

    def prune(self, step: DecodeStep, selection: Selection) -> Selection:
        raise NotImplementedError
