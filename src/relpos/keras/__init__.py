"""relpos for Keras 3: the same schemes and per-row positions as Keras layers, on the
TensorFlow, JAX and PyTorch backends (``pip install relpos[keras]``).

Written with ``keras.ops`` only. See ``docs/keras.md``.
"""

from .attention import RelativeMultiHeadAttention
from .convert import from_torch
from .embeddings import (
    PositionEmbedding,
    ReversibleEmbedding,
    SinePositionEncoding,
    TokenAndPositionEmbedding,
)
from .positions import Positions, resolve_positions
from .relative import AlibiBias, RelativePositionEmbedding, T5RelativeBias
from .rotary import RotaryEmbedding
from .schemes import KERAS_SCHEMES, AttentionScheme, make_attention_scheme
from .transformer import Transformer, TransformerBlock

__all__ = [
    "KERAS_SCHEMES",
    "AlibiBias",
    "AttentionScheme",
    "PositionEmbedding",
    "Positions",
    "RelativeMultiHeadAttention",
    "RelativePositionEmbedding",
    "ReversibleEmbedding",
    "RotaryEmbedding",
    "SinePositionEncoding",
    "T5RelativeBias",
    "TokenAndPositionEmbedding",
    "Transformer",
    "TransformerBlock",
    "from_torch",
    "make_attention_scheme",
    "resolve_positions",
]
