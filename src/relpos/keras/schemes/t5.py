"""T5's relative position bias in Keras."""

from __future__ import annotations

import keras
from keras import ops

from ...spec.base import head_mask
from ..ops import relative_distance, t5_buckets
from .base import AttentionScheme, register

__all__ = ["T5Scheme"]


@register
class T5Scheme(AttentionScheme):
    """T5 (Raffel et al., 2020): a learned scalar per (bucket, head), ``table (R, h)``.

    Materialises two ``(b|1, i, j)``-sized tensors per head: the gathered ``(b|1, i, j, h)`` values
    and their transpose, the ``(b|1, h, i, j)`` bias (plus one ``(b|1, i, j)`` bucket index)."""

    scheme_name = "t5"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)  # bucket checks: T5Config.validate_dims
        # per-head control: 1 for the heads that get the bias, 0 for the others
        mask = head_mask(config.heads, self.num_heads)
        self.head_scale = None if mask is None else tuple(float(x) for x in mask)

    def build(self, input_shape=None) -> None:
        self.table = self.add_weight(
            name="table",
            shape=(self.config.num_buckets, self.num_heads),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype="float32",
        )
        self.built = True

    def score_bias(self, q, q_positions, k_positions):
        c = self.config
        buckets = t5_buckets(
            relative_distance(q_positions.pos, k_positions.pos),
            bidirectional=not self.causal,
            num_buckets=c.num_buckets,
            max_distance=c.max_distance,
        )
        table = ops.cast(self.table, "float32")
        if self.head_scale is not None:
            table = table * ops.convert_to_tensor(self.head_scale, dtype="float32")
        values = ops.take(table, buckets, axis=0)  # (b, i, j, h)
        return ops.transpose(values, (0, 3, 1, 2))
