"""The Music Transformer's relative attention in Keras."""

from __future__ import annotations

import math

import keras
from keras import ops

from ..ops import gather_relative, relative_distance
from .base import AttentionScheme, register

__all__ = ["MusicScheme"]


@register
class MusicScheme(AttentionScheme):
    """The Music Transformer (Huang et al., 2018): ``S_rel[i, j] = q_i·Er[clip(p_j - p_i)]/√d``
    with a per-head table ``Er`` (``M+1`` rows causal, ``2M+1`` bidirectional).

    ``q·Erᵀ`` over the rows the batch can reach (sliced to the sequence length when it is
    static), gathered by clipped distance into a ``(b, h, i, j)`` bias through a ``(b, h, i, j)``
    int32 index: two ``(b, h, i, j)`` tensors beside the logits.
    """

    scheme_name = "music"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        m = config.max_distance
        self.rows = m + 1 if self.causal else 2 * m + 1

    def build(self, input_shape=None) -> None:
        self.table = self.add_weight(
            name="table",
            shape=(self.num_heads, self.rows, self.head_dim),
            initializer=keras.initializers.RandomNormal(stddev=self.head_dim**-0.5),
            dtype="float32",
        )
        self.built = True

    def score_bias(self, q, q_positions, k_positions):
        m = self.config.max_distance
        distance = relative_distance(q_positions.pos, k_positions.pos)
        index = ops.clip(distance, -m, 0 if self.causal else m) + m
        keys = ops.cast(self.table, "float32") / math.sqrt(self.head_dim)
        n = k_positions.pos.shape[1]
        if q_positions is k_positions and n is not None and n - 1 < m:
            # Self-attention: positions are ranks inside a row, so |distance| <= n - 1 and only
            # rows M-(n-1) .. M(+n-1) can be read; multiply q by those rows only.
            lo, hi = m - (n - 1), m + (0 if self.causal else n - 1)
            keys, index = keys[:, lo : hi + 1], ops.clip(index, lo, hi) - lo
        rel = ops.einsum("bihd,hrd->bhir", ops.cast(q, "float32"), keys)
        return gather_relative(rel, index)
