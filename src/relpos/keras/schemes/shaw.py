"""Shaw et al. (2018) relative position representations in Keras."""

from __future__ import annotations

import math

import keras
from keras import ops

from ..ops import clipped_relative_index, gather_relative, relative_distance, scatter_relative
from .base import AttentionScheme, register

__all__ = ["ShawScheme"]


@register
class ShawScheme(AttentionScheme):
    """Shaw et al. (2018): ``e_ij = q_i·(k_j + a^K_ij)/√d``, ``z_i = Σ_j α_ij (v_j + a^V_ij)``,
    ``a_ij`` from ``2k+1``-row tables by clipped distance.

    The key term is ``q·Wᵀ`` ``(b, h, i, 2k+1)`` gathered into a ``(b, h, i, j)`` bias, through a
    ``(b, h, i, j)`` int32 index (``take_along_axis`` wants it full size). The value term sums the
    probabilities per table row with one segment sum (another ``(b, h, i, j)`` index), then
    multiplies by the table. So up to three ``(b, h, i, j)`` tensors beside the logits; never an
    ``(i, j, d)`` one.
    """

    scheme_name = "shaw"

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.adds_terms = config.keys or config.values
        self.has_value_term = config.values
        self.rows = 2 * config.max_distance + 1

    def build(self, input_shape=None) -> None:
        c = self.config
        shape = (
            (self.num_heads, self.rows, self.head_dim) if c.per_head else (self.rows, self.head_dim)
        )

        # A fresh initializer per table: one instance would draw the same values for both.
        def init():
            return keras.initializers.RandomNormal(stddev=self.head_dim**-0.5)

        self.key_table = (
            self.add_weight(name="key_table", shape=shape, initializer=init(), dtype="float32")
            if c.keys
            else None
        )
        self.value_table = (
            self.add_weight(name="value_table", shape=shape, initializer=init(), dtype="float32")
            if c.values
            else None
        )
        self.built = True

    def _index(self, q_positions, k_positions):
        distance = relative_distance(q_positions.pos, k_positions.pos)
        return clipped_relative_index(distance, self.config.max_distance)

    def score_bias(self, q, q_positions, k_positions):
        if self.key_table is None:
            return None
        table = ops.cast(self.key_table, "float32") / math.sqrt(self.head_dim)
        qf = ops.cast(q, "float32")
        if self.config.per_head:
            rel = ops.einsum("bihd,hrd->bhir", qf, table)
        else:
            rel = ops.einsum("bihd,rd->bhir", qf, table)
        return gather_relative(rel, self._index(q_positions, k_positions))

    def value_term(self, probs, q_positions, k_positions):
        if self.value_table is None:
            return None
        index = ops.expand_dims(self._index(q_positions, k_positions), 1)  # (b|1, 1, i, j)
        mass = scatter_relative(ops.cast(probs, "float32"), index, self.rows)  # (b, h, i, R)
        table = ops.cast(self.value_table, "float32")
        if self.config.per_head:
            return ops.einsum("bhir,hrd->bihd", mass, table)
        return ops.einsum("bhir,rd->bihd", mass, table)
