"""Dense attention: the reference every method is compared with."""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.selectors.base import TokenSelector


@dataclass
class DenseSelector(TokenSelector):
    name = "dense"
    dense = True
