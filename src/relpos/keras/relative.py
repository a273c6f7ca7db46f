"""Relative position layers: ``RelativePositionEmbedding`` (Shaw et al.), ``AlibiBias``,
``T5RelativeBias`` — computed per row from positions, vectorised over the batch (no ``map_fn``).

Each takes the token tensor ``inputs (b, n, ...)`` for its shape and Keras mask, and the same
position arguments as the absolute layers (``mask``, ``segment_ids``, ``positions``,
``start_index``). Pairs that may not attend (padding, different segments) get zeros.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from ..functional.alibi import alibi_slopes
from ..schemes import ALiBiConfig
from .ops import alibi_bias, clipped_relative_index, relative_distance, t5_buckets
from .positions import allowed_pairs, dense_and_mask, token_positions

__all__ = ["AlibiBias", "RelativePositionEmbedding", "T5RelativeBias"]


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class _PairLayer(keras.layers.Layer):
    """Shared call plumbing: positions of ``inputs``, the pair term, zeros where not allowed;
    broadcast to the batch."""

    def pair_term(self, distance):
        """The term of every pair from its distance ``(b|1, i, j)``."""
        raise NotImplementedError

    def expand_allowed(self, allowed):
        """``allowed (b|1, i, j)`` expanded to broadcast against the pair term."""
        raise NotImplementedError

    def call(self, inputs, mask=None, segment_ids=None, positions=None, start_index=0):
        inputs, mask, _ = dense_and_mask(inputs, mask)  # a ragged batch gives a dense term
        p = token_positions(
            inputs,
            mask=mask,
            segment_ids=segment_ids,
            positions=positions,
            start_index=start_index,
        )
        term = self.pair_term(relative_distance(p.pos, p.pos))
        term = ops.where(self.expand_allowed(allowed_pairs(p, p, causal=False)), term, 0.0)
        return ops.broadcast_to(term, (ops.shape(inputs)[0], *ops.shape(term)[1:]))

    def compute_mask(self, inputs, mask=None):
        return None


@keras.saving.register_keras_serializable(package="relpos")
class RelativePositionEmbedding(_PairLayer):
    """Shaw et al. (2018) relative position representations ``a_ij = w[clip(p_j - p_i, ±k)]``
    for every pair of tokens of each row.

    Returns the full ``(b, i, j, d)`` tensor, the paper's formulation: ``b·n²·d`` numbers. To
    use them inside attention without it, use ``RelativeMultiHeadAttention(scheme="shaw")``.

    Args:
        max_distance: ``k``; farther pairs share the edge rows (``2k+1`` rows in all).
        output_dim: ``d``.
        embeddings_initializer: for the table.

    Call arguments:
        inputs: ``(b, n, ...)`` (shape and Keras mask only); ``mask``, ``segment_ids``,
        ``positions``, ``start_index``: per-row positions.

    Returns:
        ``(b, n, n, output_dim)``; 0 for pairs with padding or across segments.
    """

    def __init__(
        self, max_distance: int, output_dim: int, embeddings_initializer="glorot_uniform", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
            raise ValueError(f"max_distance must be an int >= 0, got {max_distance!r}")
        _positive_int("output_dim", output_dim)
        self.max_distance, self.output_dim = max_distance, output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape=None) -> None:
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(2 * self.max_distance + 1, self.output_dim),
            initializer=self.embeddings_initializer,
        )
        self.built = True

    def relative_index(self, distance):
        """Table row of every pair ``(b|1, i, j)``."""
        return clipped_relative_index(distance, self.max_distance)

    def pair_term(self, distance):
        return ops.take(ops.convert_to_tensor(self.embeddings), self.relative_index(distance), 0)

    def expand_allowed(self, allowed):
        return ops.expand_dims(allowed, -1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], input_shape[1], self.output_dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            max_distance=self.max_distance,
            output_dim=self.output_dim,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config


class _HeadBias(_PairLayer):
    """A per-head bias ``(b, h, i, j)``."""

    num_heads: int

    def expand_allowed(self, allowed):
        return ops.expand_dims(allowed, 1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_heads, input_shape[1], input_shape[1])


@keras.saving.register_keras_serializable(package="relpos")
class AlibiBias(_HeadBias):
    """The ALiBi bias (Press et al., 2022) from positions: ``slope_h·(p_j - p_i)`` when causal,
    ``-slope_h·|p_j - p_i|`` otherwise; slopes ``2^(-8/h)…`` (the paper's recipe for any ``h``),
    or ``slopes``, one per head (0: no bias on that head).

    Returns float32 ``(b, h, i, j)`` to add to the scaled logits.
    """

    def __init__(
        self, num_heads: int, causal: bool = False, slopes: Sequence[float] | None = None, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        _positive_int("num_heads", num_heads)
        self.num_heads, self.causal = num_heads, bool(causal)
        given = None if slopes is None else ALiBiConfig(slopes=slopes).slopes  # validated
        self.given_slopes = given
        self.slopes = tuple(alibi_slopes(num_heads, given).tolist())  # fixed: computed once
        self.built = True

    def pair_term(self, distance):
        slopes = ops.convert_to_tensor(self.slopes, dtype="float32")
        return alibi_bias(slopes, distance, causal=self.causal)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        slopes = None if self.given_slopes is None else list(self.given_slopes)
        config.update(num_heads=self.num_heads, causal=self.causal, slopes=slopes)
        return config


@keras.saving.register_keras_serializable(package="relpos")
class T5RelativeBias(_HeadBias):
    """The T5 bias (Raffel et al., 2020, §2.1): a learned scalar per (bucket, head), buckets of
    ``p_j - p_i`` exact near the query and log-spaced up to ``max_distance``.

    Args:
        num_heads: heads ``h``.
        num_buckets, max_distance: the bucketing (T5's 32 and 128).
        bidirectional: buckets for both directions (encoders); False for decoders.

    Returns float32 ``(b, h, i, j)``.
    """

    def __init__(
        self,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        _positive_int("num_heads", num_heads)
        _positive_int("max_distance", max_distance)
        if (
            isinstance(num_buckets, bool)
            or not isinstance(num_buckets, int)
            or num_buckets < 2
            or (bidirectional and (num_buckets % 2 or num_buckets < 4))
        ):
            raise ValueError(
                "num_buckets must be an int >= 2 (even and >= 4 when bidirectional), "
                f"got {num_buckets!r}"
            )
        per_direction = num_buckets // (2 if bidirectional else 1)
        if max_distance <= per_direction // 2:
            raise ValueError(
                f"max_distance ({max_distance}) must exceed the exact buckets per direction "
                f"({per_direction // 2})"
            )
        self.num_heads, self.num_buckets = num_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bool(bidirectional)

    def build(self, input_shape=None) -> None:
        self.table = self.add_weight(
            name="table",
            shape=(self.num_buckets, self.num_heads),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype="float32",
        )
        self.built = True

    def pair_term(self, distance):
        buckets = t5_buckets(
            distance,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return ops.transpose(ops.take(ops.cast(self.table, "float32"), buckets, 0), (0, 3, 1, 2))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
            bidirectional=self.bidirectional,
        )
        return config
