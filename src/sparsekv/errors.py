"""The error of a bad configuration or input, shared by every layer; this module imports nothing of sparsekv.

It is re-exported as `sparsekv.ConfigError` and `sparsekv.config.ConfigError`."""

from __future__ import annotations


class ConfigError(ValueError):
    """A SparseConfig (or an input to the pipeline) that cannot work; the message says why and what to do."""
