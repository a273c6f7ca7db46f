"""``from_torch``: a Keras layer with the weights of a relpos PyTorch module, same numbers.

The PyTorch classes are imported when :func:`from_torch` runs: ``import relpos.keras`` needs no
torch (a module to convert comes with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .attention import RelativeMultiHeadAttention
from .embeddings import PositionEmbedding, SinePositionEncoding, TokenAndPositionEmbedding
from .relative import AlibiBias, T5RelativeBias

if TYPE_CHECKING:
    from ..attention.mha import MultiheadAttention

__all__ = ["from_torch"]


def _np(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def _attention(m: MultiheadAttention, dtype) -> RelativeMultiHeadAttention:
    h, kvh, d, width = m.num_heads, m.num_kv_heads, m.head_dim, m.d_model
    layer = RelativeMultiHeadAttention(
        h,
        d,
        use_bias=m.qkv.bias is not None,
        scheme=m.scheme.config.to_dict(),
        causal=m.causal,
        dropout=m.dropout,
        dtype=dtype,
        num_key_value_heads=kvh,
    )
    layer.build((None, None, width))
    # The fused projection's rows: h query heads, then kvh key heads, then kvh value heads.
    starts = np.cumsum((h, kvh)) * d
    weights = np.split(_np(m.qkv.weight), starts)
    biases = (None,) * 3 if m.qkv.bias is None else np.split(_np(m.qkv.bias), starts)
    dense = (layer.query_dense, layer.key_dense, layer.value_dense)
    for proj, heads, w, b in zip(dense, (h, kvh, kvh), weights, biases, strict=True):
        proj.kernel.assign(w.reshape(heads, d, width).transpose(2, 0, 1))  # (D, heads, d)
        if b is not None:
            proj.bias.assign(b.reshape(heads, d))
    layer.output_dense.kernel.assign(_np(m.out.weight).T.reshape(h, d, width))
    if m.out.bias is not None:
        layer.output_dense.bias.assign(_np(m.out.bias))
    for name, p in m.scheme.named_parameters():
        weight, value = _scheme_weight(layer.position_scheme, name, _np(p))
        weight.assign(value)
    return layer


def _scheme_weight(scheme, name: str, value: np.ndarray):
    """The Keras weight of a PyTorch scheme parameter, and the value in its layout. Tables,
    learned frequencies, slopes and KERPLE's ``r1``, ``r2`` have the same name and layout on
    both sides (CoPE's ``pos_emb``, FIRE's ``c`` and ``threshold_scale`` too); the dynamic
    position bias's and FIRE's ``mlp.{i}.*``, Transformer-XL's ``W_R``, DeBERTa's LayerNorm and
    projections (``nn.Linear`` weights transposed) and the forget gate's ``gate`` do not.
    Sandwich has no weights."""
    if scheme.scheme_name == "dpb":
        index, kind = name.removeprefix("mlp.").split(".")
        layer, norm = divmod(int(index), 3)  # Linear at 0, 3, 6, ...; LayerNorm at 1, 4, ...
        if norm:
            return (scheme.gammas if kind == "weight" else scheme.betas)[layer], value
        if kind == "weight":
            return scheme.kernels[layer], value.T  # (out, in) -> (in, out)
        return scheme.biases[layer], value
    if scheme.scheme_name == "fire" and name.startswith("mlp."):  # mlp.{0,2}.{weight,bias}
        index, kind = name.removeprefix("mlp.").split(".")
        if kind == "weight":
            return getattr(scheme, f"mlp_{index}_kernel"), value.T  # (out, in) -> (in, out)
        return getattr(scheme, f"mlp_{index}_bias"), value
    if scheme.scheme_name == "transformer_xl" and name == "position_proj.weight":
        h, d = scheme.num_heads, scheme.head_dim
        return scheme.position_kernel, value.T.reshape(-1, h, d)  # (h·d, w) -> (w, h, d)
    if scheme.scheme_name == "deberta" and name != "rel_embeddings":
        if name.startswith("layer_norm."):  # LayerNorm's weight, bias -> gamma, beta
            kind = name.removeprefix("layer_norm.")
            return getattr(scheme, f"layer_norm_{'gamma' if kind == 'weight' else 'beta'}"), value
        proj, kind = name.removeprefix("projections.").split(".")
        if kind == "weight":
            return getattr(scheme, f"{proj}_kernel"), value.T  # (out, in) -> (in, out)
        return getattr(scheme, f"{proj}_bias"), value
    if scheme.scheme_name == "forgetting":  # gate.weight (h, D), gate.bias (h,)
        if name == "gate.weight":
            return scheme.gate_kernel, value.T
        return scheme.gate_bias, value
    return getattr(scheme, name), value


def from_torch(module, *, dtype=None):
    """The Keras layer equivalent to a relpos PyTorch module, with its weights copied.

    Supported: :class:`relpos.MultiheadAttention` (any scheme Keras has, grouped-query too, the
    scheme's learned weights included: FIRE's MLP, ``c`` and threshold among them) →
    :class:`RelativeMultiHeadAttention`; :class:`relpos.TokenPositionEmbedding` with a learned
    table and unscaled tokens → :class:`TokenAndPositionEmbedding`; the schemes ``learned`` →
    :class:`PositionEmbedding`, ``sinusoidal`` → :class:`SinePositionEncoding`, ``t5`` →
    :class:`T5RelativeBias`, ``alibi`` → :class:`AlibiBias`.

    Outputs agree to float32 rounding on every Keras backend (the test suite checks 1e-5).
    """
    from ..attention.mha import MultiheadAttention
    from ..embedding import TokenPositionEmbedding
    from ..schemes import ALiBi, LearnedAbsolute, Sinusoidal, T5Bias

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
            num_heads=module.num_heads,
            causal=module.causal,
            slopes=module.config.slopes,
            dtype=dtype,
        )
    raise TypeError(f"from_torch does not convert {type(module).__name__}")
