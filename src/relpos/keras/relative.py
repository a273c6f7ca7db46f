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

from ..spec.alibi import ALiBiConfig, alibi_slopes
from ..spec.base import check_bool
from ..spec.t5 import T5Config
from .ops import alibi_bias, clipped_relative_index, relative_distance, t5_buckets
from .positions import (
    allowed_pairs,
    check_finite_positive,
    dense_and_mask,
    resolve_positions,
    sequence_length,
    sequence_lengths,
    token_positions,
)

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
    """ALiBi (Press et al., 2022): a linear bias on the attention logits, in two forms.

    keras-hub's (``keras_hub.layers.AlibiBias``, the default): ``call(attention_scores)``
    returns the scores ``(b, h, i, j)`` with ``slope_h·(p_j - p_last)`` added, ``p_last`` the
    last position of key ``j``'s own sequence: keras-hub's ``slope_h·(j - (j_len - 1))`` on
    plain input (the same numbers), the causal bias ``slope_h·(p_j - p_i)`` up to a constant per
    query (the same softmax). relpos adds per-row key positions (``mask``, ``segment_ids``,
    ``positions``, each ``(b, j)``): a left-padded row or a packed document gets the numbers of
    its keys alone; padding keys get no bias (mask them as usual).

    relpos' ``num_heads`` form (``AlibiBias(num_heads=h, causal=...)``): ``call(inputs (b, n,
    ...))`` returns the bias alone, float32 ``(b, h, i, j)``: ``slope_h·(p_j - p_i)`` when
    causal, ``-slope_h·|p_j - p_i|`` otherwise, 0 for pairs with padding or across segments.

    Slopes: ``2^(-m/h), 2^(-2m/h), …`` with ``m = alibi_bias_max`` (8: the paper's; for ``h``
    not a power of two, the paper's recipe, as keras-hub), or ``slopes``, one per head (0: no
    bias on that head).

    Args:
        alibi_bias_max: ``m``, keras-hub's (a finite number > 0).
        num_heads: relpos' form (keyword only); None for keras-hub's.
        causal: the num_heads form's bias (keyword only; default False).
        slopes: one per head, instead of ``alibi_bias_max``'s (keyword only).

    Call arguments:
        inputs: keras-hub's ``attention_scores`` ``(b, h, i, j)``; with ``num_heads``, the
            tokens ``(b, n, ...)`` (shape and Keras mask only).
        mask, segment_ids, positions: per-row positions (of the keys ``j``, or the tokens
            ``n``); ``start_index``: the tokens' first position (no effect on the scores form,
            whose bias does not change when every position shifts).
    """

    def __init__(
        self,
        alibi_bias_max: float = 8,
        *,
        num_heads: int | None = None,
        causal: bool | None = None,
        slopes: Sequence[float] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        check_finite_positive("alibi_bias_max", alibi_bias_max)
        if num_heads is not None:
            _positive_int("num_heads", num_heads)
        elif causal is not None:
            raise ValueError(
                f"causal={causal!r} is read only with num_heads=: keras-hub's form (no "
                "num_heads) adds slope·(p_j - p_last), the causal bias up to a constant per query"
            )
        self.alibi_bias_max, self.num_heads = alibi_bias_max, num_heads
        self.causal = bool(causal)
        self.given_slopes = None if slopes is None else ALiBiConfig(slopes=slopes).slopes
        self.slopes = None if num_heads is None else self.head_slopes(num_heads)
        self.built = True

    def head_slopes(self, num_heads: int) -> tuple[float, ...]:
        """The slope of each of ``num_heads`` heads: ``slopes``, or ``alibi_bias_max``'s."""
        if self.given_slopes is not None and len(self.given_slopes) != num_heads:
            raise ValueError(
                f"slopes has {len(self.given_slopes)} entries; the input has {num_heads} heads"
            )
        paper = alibi_slopes(num_heads, self.given_slopes).tolist()  # alibi_bias_max = 8
        if self.given_slopes is not None or self.alibi_bias_max == 8:
            return tuple(paper)
        return tuple(s ** (self.alibi_bias_max / 8) for s in paper)  # 2^(-8k/h) → 2^(-mk/h)

    def pair_term(self, distance):
        slopes = ops.convert_to_tensor(self.slopes, dtype="float32")
        return alibi_bias(slopes, distance, causal=self.causal)

    def call(self, inputs, mask=None, segment_ids=None, positions=None, start_index=0):
        if self.num_heads is not None:
            return super().call(inputs, mask, segment_ids, positions, start_index)
        return self.add_to_scores(inputs, mask=mask, segment_ids=segment_ids, positions=positions)

    def add_to_scores(self, attention_scores, *, mask=None, segment_ids=None, positions=None):
        """keras-hub's call: ``attention_scores`` ``(b, h, i, j)`` plus the bias, same dtype."""
        shape = tuple(attention_scores.shape)
        if len(shape) != 4 or shape[1] is None:
            raise ValueError(
                "attention_scores must have shape (b, h, i, j) with a known h (keras-hub's "
                f"AlibiBias adds the bias to them), got {shape}. For the bias of tokens "
                "(b, n, ...) alone, relpos' earlier AlibiBias(h), pass num_heads by keyword: "
                "AlibiBias(num_heads=h)"
            )
        j = ops.shape(attention_scores)[-1]
        if mask is None and segment_ids is None and positions is None:  # keras-hub's
            offset = ops.expand_dims(ops.arange(j, dtype="int32") - (j - 1), 0)
        else:
            p = resolve_positions(
                sequence_length(attention_scores, -1),
                batch=shape[0],
                mask=mask,
                segment_ids=segment_ids,
                positions=positions,
                axis="j",
            )
            (length,) = sequence_lengths(p)
            offset = ops.where(p.valid, p.pos - (length - 1), 0)
        slopes = ops.convert_to_tensor(self.head_slopes(shape[1]), dtype="float32")
        bias = ops.reshape(slopes, (1, -1, 1, 1)) * ops.cast(offset, "float32")[:, None, None, :]
        return attention_scores + ops.cast(bias, attention_scores.dtype)

    def compute_output_shape(self, input_shape):
        if self.num_heads is None:
            return input_shape
        return super().compute_output_shape(input_shape)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        slopes = None if self.given_slopes is None else list(self.given_slopes)
        config.update(alibi_bias_max=self.alibi_bias_max, slopes=slopes)
        if self.num_heads is not None:
            config.update(num_heads=self.num_heads, causal=self.causal)
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
        check_bool("bidirectional", bidirectional)
        # The T5 scheme's own checks (relpos.spec), with its messages; its bias reads no head width.
        T5Config(num_buckets=num_buckets, max_distance=max_distance).check_dims(
            num_heads=num_heads, head_dim=1, causal=not bidirectional
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
