"""Method registry: one line per method, loaded lazily so a broken optional method never breaks the others.

Adding a method = one file under selectors/ (or prefill/) + one line here.

A primitive at the bottom of the layers (docs/ARCHITECTURE.md): it imports only `sparsekv.errors`. The method
modules are named here as strings and imported by `importlib` when asked for (a plug-in point, not an import
arrow), so `sparsekv.config` can validate a config through the registry without an import cycle.
"""

from __future__ import annotations

import dataclasses
import importlib

from sparsekv.errors import ConfigError

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


def get_method_class(name: str) -> type:
    """The method's class (a `selectors.base.TokenSelector` subclass)."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(available_methods())}")
    return load(METHODS[name])


def get_top_p_pruner() -> type:
    try:
        return load(TOP_P_PRUNER)
    except ModuleNotFoundError as error:
        raise ConfigError("top-p pruning (Twilight) is not available in this build") from error


def method_options(name: str) -> dict[str, dataclasses.Field]:
    """The options a method accepts (its dataclass fields beyond the shared ones: `TokenSelector.option_fields`)."""
    return get_method_class(name).option_fields()


def options_by_method(methods: list[str] | tuple[str, ...], items: dict) -> dict[str, dict]:
    """Each of `methods`' options from one set of `--option`s: an unscoped key ('bits') goes to every method that
    has that option, 'method:key' only to that method (and wins). A key no method of the run takes, or a scope
    naming a method not in the run, is a ConfigError, never silently dropped."""
    shared, scoped = {}, {}
    for key, value in items.items():
        method, sep, name = key.partition(":")
        if sep:
            if method not in methods:
                raise ConfigError(f"option {key!r} names {method!r}, which is not among the methods run "
                                  f"({', '.join(methods)})")  # fmt: skip
            scoped.setdefault(method, {})[name] = value
        else:
            shared[key] = value
    accepted = {method: method_options(method) for method in dict.fromkeys(methods)}
    for key in shared:
        if not any(key in fields for fields in accepted.values()):
            raise ConfigError(f"option {key!r}: none of {', '.join(accepted)} has it (`sparsekv methods` lists "
                              "each method's options)")  # fmt: skip
    return {method: {k: v for k, v in shared.items() if k in fields} | scoped.get(method, {})
            for method, fields in accepted.items()}  # fmt: skip
