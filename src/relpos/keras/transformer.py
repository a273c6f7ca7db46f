"""``Transformer``: a small Keras decoder that takes any relpos scheme, the twin of
:class:`relpos.Transformer` (pre-LayerNorm blocks, GELU MLP, final LayerNorm, LM head).

Read top to bottom: :class:`TransformerBlock` (attention + MLP) → :class:`Transformer`
(embedding, blocks, head). Token id 0 is padding: the embedding's Keras mask (``mask_zero``) gives
every row its own positions, so a left-padded row computes exactly what it computes alone.
Absolute schemes (``sinusoidal``, ``learned``) act at the input; the others in every attention
layer.

Shape legend: ``b`` batch, ``n`` tokens, ``D`` d_model, ``V`` vocab_size.
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from ..spec.base import ABSOLUTE_SCHEMES
from ..spec.model import ModelConfig
from .attention import RelativeMultiHeadAttention
from .embeddings import PositionEmbedding, SinePositionEncoding, check_token_ids

__all__ = ["ABSOLUTE_SCHEMES", "Transformer", "TransformerBlock"]


def _linear_init(fan_in: int):
    """PyTorch's ``nn.Linear`` default, ``U(±1/√fan_in)``: both frameworks' models start alike."""
    return keras.initializers.RandomUniform(-(fan_in**-0.5), fan_in**-0.5)


def _check_tokens_shape(shape) -> None:
    if len(shape) != 2:
        raise ValueError(f"tokens must have shape (b, n), got {tuple(shape)}")


@keras.saving.register_keras_serializable(package="relpos")
class TransformerBlock(keras.layers.Layer):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))``, dropout on both residual branches.

    ``num_kv_heads``: key/value heads of grouped-query attention (default ``num_heads``).

    Call arguments: ``x`` ``(b, n, D)``; ``mask`` ``(b, n)`` True for tokens (their positions;
    padding queries attend nowhere). Returns ``(b, n, D)``.
    """

    def __init__(
        self, d_model, num_heads, d_ff, scheme="nope", causal=True, dropout=0.0,
        num_kv_heads=None, **kwargs
    ):  # fmt: skip
        super().__init__(**kwargs)
        self.d_model, self.num_heads, self.d_ff = d_model, num_heads, d_ff
        self.scheme, self.causal, self.dropout_rate = scheme, causal, dropout
        self.num_kv_heads = num_kv_heads
        dtype, head_dim = self.dtype_policy, d_model // num_heads
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype, name="ln1")
        self.attn = RelativeMultiHeadAttention(
            num_heads, head_dim, dropout=dropout, scheme=scheme, causal=causal, dtype=dtype,
            kernel_initializer=_linear_init(d_model), num_key_value_heads=num_kv_heads,
        )  # fmt: skip
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype, name="ln2")
        self.mlp_in = keras.layers.Dense(
            d_ff, "gelu", kernel_initializer=_linear_init(d_model), dtype=dtype, name="mlp_in"
        )
        self.mlp_out = keras.layers.Dense(
            d_model, kernel_initializer=_linear_init(d_ff), dtype=dtype, name="mlp_out"
        )
        self.drop = keras.layers.Dropout(dropout, dtype=dtype)
        self.supports_masking = True  # the output keeps the input's Keras mask

    def build(self, input_shape) -> None:
        for layer in (self.ln1, self.attn, self.ln2, self.mlp_in):
            layer.build(input_shape)
        self.mlp_out.build((*input_shape[:-1], self.d_ff))
        self.built = True

    def call(self, x, mask=None, training=None):
        y = self.attn(self.ln1(x), query_mask=mask, training=training)
        x = x + self.drop(y, training=training)
        y = self.mlp_out(self.mlp_in(self.ln2(x)))
        return x + self.drop(y, training=training)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        names = ("d_model", "num_heads", "d_ff", "scheme", "causal", "num_kv_heads")
        config.update({k: getattr(self, k) for k in names}, dropout=self.dropout_rate)
        return config


@keras.saving.register_keras_serializable(package="relpos")
class Transformer(keras.Model):
    """Token embedding (+ absolute positions), ``num_layers`` blocks, final LayerNorm, LM head.

    The arguments are those of :class:`relpos.TransformerConfig` (less ``backend``,
    ``layer_schemes`` and ``share_relative``, not in Keras yet; checked by the same
    :class:`relpos.spec.model.ModelConfig`), so one config dict builds either framework's
    model. Kernels start as PyTorch's ``nn.Linear`` ones
    (``U(±1/√fan_in)``; biases at zero), embeddings at std 0.02; with the PyTorch model's weights
    the logits agree to float32 rounding. Trains with ``model.fit``; saves as ``.keras``.

    Args:
        vocab_size: token ids ``V``; id 0 is padding (masked, never attended to).
        d_model, num_heads, num_layers: width ``D``, heads, depth.
        d_ff: MLP hidden width (default ``4·d_model``).
        dropout: on the embedding, the residual branches and the attention probabilities.
        causal: decoder (True) or encoder (False).
        scheme: a scheme name or config dict, as :class:`RelativeMultiHeadAttention` takes.
            ``sinusoidal`` (fields ``base``, ``interleaved``) and ``learned`` (``max_len``: the
            table's length, the longest input) act at the input, with ``nope`` in attention.
        tie_weights: the head reuses the token embedding (default: its own ``(D, V)`` matrix, as
            :class:`relpos.Transformer`).
        num_kv_heads: key/value heads of grouped-query attention (default ``num_heads``; a
            divisor of it), as ``TransformerConfig.num_kv_heads``.

    Shapes:
        tokens ``(b, n)`` int; returns logits ``(b, n, V)`` carrying the Keras mask
        ``tokens != 0``, so a Keras loss skips padding inputs. For next-token training also pass
        ``sample_weight=(targets != 0)``: the last token of a right-padded row has a padding target.
        An id outside ``[0, vocab_size)`` is a ``ValueError`` naming ``tokens`` wherever the ids
        hold values (eagerly); traced ids (``jit``, ``tf.function``) are not checked, see
        :func:`relpos.keras.embeddings.check_token_ids`.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 256,
        num_heads: int = 8,
        num_layers: int = 4,
        d_ff: int | None = None,
        dropout: float = 0.1,
        causal: bool = True,
        scheme: Any = "nope",
        tie_weights: bool = False,
        num_kv_heads: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        cfg = ModelConfig(
            vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
            d_ff=d_ff, dropout=dropout, causal=causal, scheme=scheme, num_kv_heads=num_kv_heads,
        )  # fmt: skip
        self.cfg, self.tie_weights = cfg, bool(tie_weights)
        d_ff, dtype, name = cfg.d_ff or 4 * d_model, self.dtype_policy, cfg.scheme["name"]

        # A fixed sinusoid has unit amplitude: tokens get the same scale (×√D, initial std 1/√D),
        # as relpos.TokenPositionEmbedding does; otherwise std 0.02 and no scale.
        fixed = name == "sinusoidal"
        self.token_scale = math.sqrt(d_model) if fixed else 1.0
        init = keras.initializers.RandomNormal(stddev=d_model**-0.5 if fixed else 0.02)
        self.token_embedding = keras.layers.Embedding(
            vocab_size, d_model, init, mask_zero=True, dtype=dtype, name="token_embedding"
        )
        self.position_embedding = None
        if fixed:
            base, interleaved = cfg.scheme["base"], cfg.scheme["interleaved"]
            self.position_embedding = SinePositionEncoding(base, interleaved, dtype=dtype)
        elif name == "learned":
            init = keras.initializers.RandomNormal(stddev=0.02)
            self.position_embedding = PositionEmbedding(cfg.scheme["max_len"], init, dtype=dtype)
        self.drop = keras.layers.Dropout(dropout, dtype=dtype)
        layer_scheme = "nope" if name in ABSOLUTE_SCHEMES else cfg.scheme
        block = dict(causal=cfg.causal, dropout=dropout, num_kv_heads=num_kv_heads, dtype=dtype)
        self.blocks = [
            TransformerBlock(d_model, num_heads, d_ff, layer_scheme, name=f"block_{i}", **block)
            for i in range(num_layers)
        ]
        self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype, name="ln_f")
        self.head = None
        if not self.tie_weights:
            self.head = keras.layers.Dense(
                vocab_size, use_bias=False, kernel_initializer=_linear_init(d_model), dtype=dtype,
                name="head",
            )  # fmt: skip
        self.supports_masking = True  # the logits carry the tokens' mask (compute_mask)

    def build(self, input_shape) -> None:
        _check_tokens_shape(input_shape)
        self.token_embedding.build(input_shape)
        features = (*input_shape, self.cfg.d_model)
        if self.position_embedding is not None:
            self.position_embedding.build(features)
        for layer in (*self.blocks, self.ln_f, *([self.head] if self.head else [])):
            layer.build(features)
        self.built = True

    def call(self, tokens, training=None):
        _check_tokens_shape(tokens.shape)
        tokens = check_token_ids(tokens, self.token_embedding.input_dim, "tokens")
        mask = self.token_embedding.compute_mask(tokens)  # (b, n): True for tokens (id != 0)
        x = self.token_embedding(tokens)
        if self.token_scale != 1.0:
            x = x * self.token_scale
        if self.position_embedding is not None:  # each row's own positions, from the mask
            x = x + self.position_embedding(x, mask=mask)
        x = self.drop(x, training=training)
        for block in self.blocks:
            x = block(x, mask=mask, training=training)
        x = self.ln_f(x)
        if self.head is not None:
            return self.head(x)  # (b, n, V)
        return ops.matmul(x, ops.transpose(ops.cast(self.token_embedding.embeddings, x.dtype)))

    def compute_mask(self, tokens, mask=None):
        """``(b, n)`` True for tokens: Keras losses and metrics skip padding positions."""
        return ops.not_equal(tokens, 0)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.cfg.vocab_size)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        names = ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "dropout", "causal")
        config.update({k: getattr(self.cfg, k) for k in names}, scheme=self.cfg.scheme)
        # Not the PyTorch-only fields (backend, layer_schemes, share_relative).
        config.update(tie_weights=self.tie_weights, num_kv_heads=self.cfg.num_kv_heads)
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)
