"""Multi-head attention with any scheme, masks, KV cache and backends."""

from .backends import BACKENDS, get_backend
from .cache import KVCache
from .eager import eager_attention
from .mha import MultiheadAttention

__all__ = ["BACKENDS", "KVCache", "MultiheadAttention", "eager_attention", "get_backend"]
