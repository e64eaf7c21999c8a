"""sparsekv: sparse KV-cache attention for long-context decoding on stock transformers models."""

from sparsekv.api import GenerationResult, disable, enable, enabled, generate, last_cache
from sparsekv.cache import SparseCache
from sparsekv.config import ConfigError, SparseConfig
from sparsekv.registry import available_methods
from sparsekv.selectors.base import TokenSelector
from sparsekv.step import DecodeStep, LayerInfo, Selection

__all__ = [
    "ConfigError",
    "DecodeStep",
    "GenerationResult",
    "LayerInfo",
    "Selection",
    "SparseCache",
    "SparseConfig",
    "TokenSelector",
    "available_methods",
    "disable",
    "enable",
    "enabled",
    "generate",
    "last_cache",
]
__version__ = "0.1.0"
