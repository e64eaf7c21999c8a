"""Method registry: one line per method, loaded lazily so a broken optional method never breaks the others.

Adding a method = one file under selectors/ (or prefill/) + one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from sparsekv.config import ConfigError

if TYPE_CHECKING:
    from sparsekv.selectors.base import TokenSelector

METHODS: dict[str, str] = {
    "dense": "sparsekv.selectors.dense:DenseSelector",
    "oracle-topk": "sparsekv.selectors.oracle:OracleTopK",
    "oracle-topp": "sparsekv.selectors.oracle:OracleTopP",
    "streaming": "sparsekv.selectors.streaming:StreamingSelector",
    "self-index": "sparsekv.selectors.self_index:SelfIndexSelector",
    "spotlight": "sparsekv.selectors.spotlight:SpotlightSelector",
    "twilight": "sparsekv.selectors.twilight:TwilightSelector",
    "gemfilter": "sparsekv.prefill.gemfilter:GemFilter",
    "quest": "sparsekv.selectors.quest:QuestSelector",
    "lsh": "sparsekv.selectors.lsh:LSHSelector",
    "snapkv": "sparsekv.selectors.snapkv:SnapKVSelector",
    "h2o": "sparsekv.selectors.h2o:H2OSelector",
    "double-sparsity": "sparsekv.selectors.double_sparsity:DoubleSparsitySelector",
}

#: the pruner used when a config sets top_p on a method that does not consume top_p itself
TOP_P_PRUNER = "sparsekv.pruners.top_p:TopPPruner"


def load(target: str):
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def available_methods() -> list[str]:
    return sorted(METHODS)


def get_method_class(name: str) -> type[TokenSelector]:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(available_methods())}")
    return load(METHODS[name])


def get_top_p_pruner() -> type:
    try:
        return load(TOP_P_PRUNER)
    except ModuleNotFoundError as error:
        raise ConfigError("top-p pruning (Twilight) is not available in this build") from error


def method_options(name: str) -> dict[str, dataclasses.Field]:
    """The options a method accepts (its dataclass fields beyond the shared ones)."""
    from sparsekv.selectors.base import TokenSelector

    cls = get_method_class(name)
    shared = {f.name for f in dataclasses.fields(TokenSelector)}
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in shared and f.init}
