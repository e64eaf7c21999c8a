"""What sparsekv relies on in `transformers`, checked in one place: the tested release range and the name under
which a model's forward takes its cache (`past_key_values` until 5.2x, `cache` after)."""

from __future__ import annotations

import functools
import inspect
import os

import transformers
from packaging.version import Version

from sparsekv.config import ConfigError

#: the lowest and the newest transformers release the test suite runs against (CI runs both); pyproject's pin
#: allows exactly these and the releases between them
TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")
#: set to 1 to run on a transformers release outside the tested range (sparsekv then still refuses any forward in
#: which the model bypasses its cache, so a wrong decode stays an error, not a silent dense answer)
ALLOW_UNTESTED_ENV = "SPARSEKV_ALLOW_UNTESTED_TRANSFORMERS"

CACHE_ARGUMENTS = ("cache", "past_key_values")


def supported_range() -> str:
    low, high = TESTED_TRANSFORMERS
    return f"transformers {low} to {Version(high).major}.{Version(high).minor}.x"


def check_transformers_version(version: str | None = None) -> None:
    """Raises ConfigError when the installed transformers lies outside the tested range (unless opted in)."""
    found = Version(version or transformers.__version__)
    low, high = (Version(v) for v in TESTED_TRANSFORMERS)
    newest_minor = Version(f"{high.major}.{high.minor + 1}.0.dev0")
    if low <= found < newest_minor or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise ConfigError(
        f"sparsekv supports {supported_range()} (the releases its tests run against); found transformers "
        f"{found}. Install a supported release, e.g. pip install 'transformers>={low},<{high.major}.{high.minor + 1}'"
        f" (or set {ALLOW_UNTESTED_ENV}=1 to try this one at your own risk)"
    )


@functools.cache
def _cache_argument_of(forward_type: type, forward_name: str) -> str:
    forward = getattr(forward_type, forward_name)
    parameters = inspect.signature(forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise ConfigError(
        f"{forward_type.__name__}.forward takes no cache argument ({' / '.join(CACHE_ARGUMENTS)}); "
        "sparsekv needs a decoder that uses a transformers Cache"
    )


def cache_argument(model) -> str:
    """The keyword under which `model`'s forward takes its KV cache on this transformers release."""
    return _cache_argument_of(type(model), "forward")


def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` for `model(..., **cache_kwargs(model, cache))`, whatever the release calls the argument."""
    return {cache_argument(model): cache}
