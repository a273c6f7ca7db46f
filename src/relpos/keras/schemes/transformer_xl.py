"""Transformer-XL's relative attention in Keras."""

from __future__ import annotations

import math

import keras
from keras import ops

from ..ops import gather_relative, relative_distance
from .base import AttentionScheme, register

__all__ = ["TransformerXLScheme"]


@register
class TransformerXLScheme(AttentionScheme):
    """Transformer-XL (Dai et al., 2019, §3.3): logits
    ``(q_i·k_j + q_i·W_R R_δ + u·k_j + v·W_R R_δ) / √d``, ``δ = clip(p_i - p_j)`` at
    ``max_distance``, ``R`` the sinusoidal encoding (halves ``[sin, cos]``, width ``h·d``),
    ``W_R`` a float32 weight ``position_kernel (h·d, h, d)`` (``nn.Linear``'s initialisation),
    ``u``, ``v`` float32 ``content_bias``, ``position_bias`` ``(h, d)`` starting at 0.

    ``rotate`` adds ``u`` to the queries (the content logits then carry ``u·k``);
    ``score_bias`` is ``(q - u + v)·(W_R R)ᵀ/√d`` over the table's rows (``max_distance + 1``
    causal, ``2·max_distance + 1`` otherwise; in self-attention only the rows the length can
    reach), gathered by each pair's clipped distance through a ``(b, h, i, j)`` int32 index: two
    ``(b, h, i, j)`` tensors beside the logits, never an ``(i, j, d)`` one.
    """

    scheme_name = "transformer_xl"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        # R_{p_i - p_j}: the PyTorch scheme's table, from the same spec (even width: checked)
        width = self.num_heads * self.head_dim
        self.encodings = config.encodings(width, causal=self.causal)

    def build(self, input_shape=None) -> None:
        h, d = self.num_heads, self.head_dim
        bound = (h * d) ** -0.5
        self.position_kernel = self.add_weight(
            name="position_kernel",
            shape=(h * d, h, d),
            initializer=keras.initializers.RandomUniform(-bound, bound),
            dtype="float32",
        )
        for name in ("content_bias", "position_bias"):
            weight = self.add_weight(name=name, shape=(h, d), initializer="zeros", dtype="float32")
            setattr(self, name, weight)
        self.built = True

    def rotate(self, q, k, q_positions, k_positions):
        return q + ops.cast(self.content_bias, q.dtype), k

    def score_bias(self, q, q_positions, k_positions):
        m = self.config.max_distance
        distance = relative_distance(q_positions.pos, k_positions.pos)
        index = ops.clip(distance, -m, 0 if self.causal else m) + m
        rows = self.encodings
        n = k_positions.pos.shape[1]
        if q_positions is k_positions and n is not None and n - 1 < m:
            # Self-attention: |distance| <= n - 1, so only rows M-(n-1) .. M(+n-1) are read.
            lo, hi = m - (n - 1), m + (0 if self.causal else n - 1)
            rows, index = rows[lo : hi + 1], ops.clip(index, lo, hi) - lo
        kernel = ops.cast(self.position_kernel, "float32")
        keys = ops.einsum("rw,whd->hrd", ops.convert_to_tensor(rows), kernel)
        shift = ops.cast(self.position_bias, "float32") - ops.cast(self.content_bias, "float32")
        rel = ops.einsum("bihd,hrd->bhir", ops.cast(q, "float32") + shift, keys)
        return gather_relative(rel / math.sqrt(self.head_dim), index)
