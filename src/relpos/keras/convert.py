"""``from_torch``: a Keras layer with the weights of a relpos PyTorch module, same numbers."""

from __future__ import annotations

import numpy as np

from ..attention.mha import MultiheadAttention
from ..embedding import TokenPositionEmbedding
from ..schemes import ALiBi, LearnedAbsolute, Sinusoidal, T5Bias
from .attention import RelativeMultiHeadAttention
from .embeddings import PositionEmbedding, SinePositionEncoding, TokenAndPositionEmbedding
from .relative import AlibiBias, T5RelativeBias

__all__ = ["from_torch"]


def _np(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def _attention(m: MultiheadAttention, dtype) -> RelativeMultiHeadAttention:
    h, d, width = m.num_heads, m.head_dim, m.d_model
    if m.num_kv_heads != h:
        raise ValueError(
            f"from_torch: grouped-query attention (num_kv_heads={m.num_kv_heads} < "
            f"num_heads={h}) has no Keras layer yet"
        )
    layer = RelativeMultiHeadAttention(
        h,
        d,
        use_bias=m.qkv.bias is not None,
        scheme=m.scheme.config.to_dict(),
        causal=m.causal,
        dropout=m.dropout,
        dtype=dtype,
    )
    layer.build((None, None, width))
    w = _np(m.qkv.weight).reshape(3, h, d, width).transpose(0, 3, 1, 2)  # (3, D, h, d)
    b = None if m.qkv.bias is None else _np(m.qkv.bias).reshape(3, h, d)
    for i, dense in enumerate((layer.query_dense, layer.key_dense, layer.value_dense)):
        dense.kernel.assign(w[i])
        if b is not None:
            dense.bias.assign(b[i])
    layer.output_dense.kernel.assign(_np(m.out.weight).T.reshape(h, d, width))
    if m.out.bias is not None:
        layer.output_dense.bias.assign(_np(m.out.bias))
    s, ks = m.scheme, layer.position_scheme
    for name in ("table", "key_table", "value_table"):
        t = getattr(s, name, None)
        if t is not None:
            getattr(ks, name).assign(_np(t))
    return layer


def from_torch(module, *, dtype=None):
    """The Keras layer equivalent to a relpos PyTorch module, with its weights copied.

    Supported: :class:`relpos.MultiheadAttention` (any scheme Keras has) →
    :class:`RelativeMultiHeadAttention`; :class:`relpos.TokenPositionEmbedding` with a learned
    table and unscaled tokens → :class:`TokenAndPositionEmbedding`; the schemes ``learned`` →
    :class:`PositionEmbedding`, ``sinusoidal`` → :class:`SinePositionEncoding`, ``t5`` →
    :class:`T5RelativeBias`, ``alibi`` → :class:`AlibiBias`.

    Outputs agree to float32 rounding on every Keras backend (the test suite checks 1e-5).
    """
    if isinstance(module, MultiheadAttention):
        return _attention(module, dtype)
    if isinstance(module, TokenPositionEmbedding):
        if not isinstance(module.scheme, LearnedAbsolute) or module.scale != 1.0:
            raise ValueError(
                "from_torch converts a TokenPositionEmbedding with a learned scheme and "
                f"scale_tokens=False; got scheme {module.scheme.config.name!r}, "
                f"scale {module.scale}"
            )
        vocab, width = module.tokens.weight.shape
        layer = TokenAndPositionEmbedding(vocab, module.scheme.config.max_len, width, dtype=dtype)
        layer.build((None, None))
        layer.token_embedding.embeddings.assign(_np(module.tokens.weight))
        layer.position_embedding.position_embeddings.assign(_np(module.scheme.table))
        return layer
    if isinstance(module, LearnedAbsolute):
        layer = PositionEmbedding(module.config.max_len, dtype=dtype)
        layer.build((None, None, module.d_model))
        layer.position_embeddings.assign(_np(module.table))
        return layer
    if isinstance(module, Sinusoidal):
        c = module.config
        return SinePositionEncoding(c.base, interleaved=c.interleaved, dtype=dtype)
    if isinstance(module, T5Bias):
        c = module.config
        layer = T5RelativeBias(
            module.num_heads,
            c.num_buckets,
            c.max_distance,
            bidirectional=not module.causal,
            dtype=dtype,
        )
        layer.build()
        layer.table.assign(_np(module.table))
        return layer
    if isinstance(module, ALiBi):
        return AlibiBias(
            module.num_heads, causal=module.causal, slopes=module.config.slopes, dtype=dtype
        )
    raise TypeError(f"from_torch does not convert {type(module).__name__}")
