"""Multi-head attention with any scheme, masks, KV cache, and backends behind one contract.

What a user meets: :class:`MultiheadAttention` (:mod:`.mha`), :class:`KVCache` (:mod:`.cache`),
the backends ``eager``, ``sdpa``, ``flex``, ``chunked`` and ``auto`` (:mod:`.backends`), all of one
signature (:class:`~.contract.AttentionBackend`). The CPU engines behind ``chunked`` live in
:mod:`.chunked`.
"""

from .backends import BACKENDS, get_backend
from .cache import KVCache
from .contract import AttentionBackend
from .eager import eager_attention
from .mha import MultiheadAttention

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "KVCache",
    "MultiheadAttention",
    "eager_attention",
    "get_backend",
]
