"""Absolute position layers, keras-hub compatible: ``PositionEmbedding``,
``SinePositionEncoding``, ``TokenAndPositionEmbedding``.

Same constructor arguments and ``call(inputs, start_index=0, positions=None)`` as keras-hub's, so
code switches by the import. Unlike keras-hub, every row's positions come from its own tokens:
the Keras mask (``mask_zero=True`` upstream), ``segment_ids`` of packed rows, or a
``start_index`` per row. Padding tokens read position 0.

``PositionEmbedding`` and ``SinePositionEncoding`` read the sequence from the axis before the
features, as keras-hub's do: ``(b, n, d)`` or ``(b, ..., n, d)`` (e.g. ``(b, a, n, d)``), every
leading axis after the batch sharing the row's positions.

Shape legend: ``b`` batch, ``n`` tokens, ``d`` features.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from .ops import sinusoidal_table
from .positions import (
    SameShapeLayer,
    check_finite_positive,
    dense_and_mask,
    resolve_positions,
    restore_ragged,
    sequence_length,
    value_bounds,
)

__all__ = [
    "PositionEmbedding",
    "SinePositionEncoding",
    "TokenAndPositionEmbedding",
    "check_token_ids",
]


def check_token_ids(ids, vocab_size: int, name: str = "inputs", size_name: str = "vocab_size"):
    """``ids`` as a tensor, after a ``ValueError`` naming ``name`` unless every id lies in
    ``[0, vocab_size)`` (``size_name``: the caller's word for ``vocab_size``), wherever the ids
    hold values (eagerly, on every backend; see :func:`~relpos.keras.positions.holds_values`).

    Under ``jit`` / ``tf.function`` traced ids cannot be read, so they are not checked: there
    the table lookup does what the backend's gather does with them. A negative id reads row
    ``id + vocab_size`` on every backend; an id ``>= vocab_size`` reads NaN on JAX, and fails when
    the function runs on TensorFlow's CPU (zeros on a GPU)."""
    ids = ops.convert_to_tensor(ids)
    if (bounds := value_bounds(ids)) is not None:
        lo, hi = bounds
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{name} (token ids) must lie in [0, {size_name}) = [0, {vocab_size}), got id "
                f"{lo if lo < 0 else hi}"
            )
    return ids


def _row_positions(inputs, **given):
    """The positions ``(b|1, n)`` of the tokens of ``inputs`` ``(b, ..., n, d)`` (the sequence
    before the features, keras-hub's layout), from the position arguments ``given``."""
    if len(inputs.shape) < 3:
        raise ValueError(
            f"inputs must have shape (b, n, d) or (b, ..., n, d), got {tuple(inputs.shape)}"
        )
    return resolve_positions(sequence_length(inputs, -2), batch=inputs.shape[0], **given).pos


def _spread(per_token, inputs):
    """``per_token`` ``(b|1, n, d)`` broadcast to ``inputs`` ``(b, ..., n, d)``."""
    for _ in range(len(inputs.shape) - 3):
        per_token = ops.expand_dims(per_token, 1)
    return ops.broadcast_to(per_token, ops.shape(inputs))


@keras.saving.register_keras_serializable(package="relpos")
class PositionEmbedding(SameShapeLayer):
    """A learned table of ``sequence_length`` position embeddings (Devlin et al., 2019).

    Args:
        sequence_length: positions in the table. A position outside ``[0, sequence_length)`` is
            a ``ValueError`` naming ``start_index`` or ``positions`` wherever it is known: always
            for an int ``start_index``, and eagerly for a tensor one or explicit ``positions``.
            Under ``jit`` / ``tf.function`` a traced ``start_index`` or ``positions`` cannot be
            checked: there positions are clamped into the table (past the end reads its last
            row), never an out-of-range gather.
        initializer: for the table (keras-hub's default, ``"glorot_uniform"``).

    Call arguments:
        inputs: ``(b, n, d)``, or ``(b, ..., n, d)`` (keras-hub's: the sequence is the axis
            before the features); only its shape and Keras mask are read.
        start_index: int or ``(b,)`` integer tensor, the position of the first token.
        positions: ``(n,)`` or ``(b, n)`` integers (overrides ``start_index``).
        mask: ``(b, n)`` True for tokens (default: the inputs' Keras mask).
        segment_ids: ``(b, n)`` int, packed documents, -1 for padding.

    Returns:
        the embeddings ``(b|1, n, d)`` broadcast to the inputs' shape.
    """

    def __init__(self, sequence_length: int, initializer="glorot_uniform", **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(sequence_length, bool) or not isinstance(sequence_length, int):
            raise ValueError(f"sequence_length must be an int, got {sequence_length!r}")
        if sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
        self.sequence_length = sequence_length
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, input_shape) -> None:
        self.position_embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, input_shape[-1]),
            initializer=self.initializer,
        )
        self.built = True

    def call(self, inputs, start_index=0, positions=None, mask=None, segment_ids=None):
        inputs, mask, lengths = dense_and_mask(inputs, mask)
        pos = _row_positions(
            inputs,
            mask=mask,
            segment_ids=segment_ids,
            positions=positions,
            start_index=start_index,
        )
        n = inputs.shape[-2]
        top = None if n is None else n + (start_index if isinstance(start_index, int) else 0)
        if top is not None and positions is None and top > self.sequence_length:
            raise ValueError(
                f"a sequence of {n} tokens starting at position {top - n} is longer than the "
                f"learned table (sequence_length={self.sequence_length})"
            )
        if positions is not None or not isinstance(start_index, int):
            pos = self._inside_table(pos, "start_index" if positions is None else "positions")
        table = ops.convert_to_tensor(self.position_embeddings)
        return restore_ragged(_spread(ops.take(table, pos, axis=0), inputs), lengths)

    def _inside_table(self, pos, name: str):
        """``pos`` checked against the table where it holds values, and clamped into it."""
        size = self.sequence_length
        if (bounds := value_bounds(pos)) is not None:
            lo, hi = bounds
            if lo < 0 or hi >= size:
                raise ValueError(
                    f"{name} gives position {lo if lo < 0 else hi}, outside the learned table "
                    f"(sequence_length={size}: positions 0..{size - 1})"
                )
        return ops.clip(pos, 0, size - 1)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            sequence_length=self.sequence_length,
            initializer=keras.initializers.serialize(self.initializer),
        )
        return config


@keras.saving.register_keras_serializable(package="relpos")
class SinePositionEncoding(SameShapeLayer):
    """Fixed sinusoidal encoding of each token's own position (Vaswani et al., 2017, §3.5):
    ``sin(p·ω_k), cos(p·ω_k)`` interleaved, ``ω_k = max_wavelength^(-2k/d)``. No weights;
    computed in float32, returned in the layer's compute dtype.

    Args:
        max_wavelength: the wavelength base (10000 in the paper).
        interleaved: ``sin, cos, sin, …`` (the paper, keras-hub) or ``[sin…, cos…]`` halves.

    Call arguments: as :class:`PositionEmbedding`.
    """

    def __init__(self, max_wavelength: float = 10000, interleaved: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        check_finite_positive("max_wavelength", max_wavelength)
        self.max_wavelength, self.interleaved = max_wavelength, bool(interleaved)
        self.supports_masking = True

    def call(self, inputs, start_index=0, positions=None, mask=None, segment_ids=None):
        inputs, mask, lengths = dense_and_mask(inputs, mask)
        dim = inputs.shape[-1]
        if dim is None or dim % 2:
            raise ValueError(f"the feature dim must be even (sin/cos pairs), got {dim}")
        pos = _row_positions(
            inputs,
            mask=mask,
            segment_ids=segment_ids,
            positions=positions,
            start_index=start_index,
        )
        table = sinusoidal_table(
            pos, dim, base=float(self.max_wavelength), interleaved=self.interleaved
        )
        return restore_ragged(_spread(ops.cast(table, self.compute_dtype), inputs), lengths)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(max_wavelength=self.max_wavelength, interleaved=self.interleaved)
        return config


def _own_draw(initializer, offset: int = 1):
    """A copy of ``initializer`` whose draw differs from its: the same instance, or a copy with
    the same seed, draws the same values (keras-hub's untied ``reverse_embeddings`` start as the
    token table, reshaped). An integer seed, or a ``SeedGenerator``'s, moves on by ``offset``
    (reproducible); an unseeded copy draws its own default seed."""
    config = keras.initializers.serialize(initializer)
    inner = config.get("config") if isinstance(config, dict) else None
    seed = inner.get("seed") if isinstance(inner, dict) else None
    if isinstance(seed, dict) and isinstance(seed.get("config"), dict):  # a SeedGenerator
        inner = seed["config"]
        seed = inner.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        inner["seed"] = seed + offset
    return keras.initializers.get(config)


@keras.saving.register_keras_serializable(package="relpos")
class ReversibleEmbedding(keras.layers.Embedding):
    """A token embedding that also maps features back to logits: ``call(x, reverse=True)`` is
    ``x·Eᵀ`` (tied) or ``x·W`` with a separate ``(d, vocab)`` matrix (``tie_weights=False``)."""

    def __init__(self, input_dim, output_dim, tie_weights: bool = True, **kwargs) -> None:
        super().__init__(input_dim, output_dim, **kwargs)
        self.tie_weights = bool(tie_weights)

    def build(self, input_shape=None) -> None:
        super().build(input_shape)
        if not self.tie_weights:
            self.reverse_embeddings = self.add_weight(
                name="reverse_embeddings",
                shape=(self.output_dim, self.input_dim),
                initializer=_own_draw(self.embeddings_initializer),
            )

    def call(self, inputs, reverse: bool = False):
        if not reverse:
            return super().call(inputs)
        kernel = (
            ops.transpose(ops.convert_to_tensor(self.embeddings))
            if self.tie_weights
            else self.reverse_embeddings
        )
        return ops.matmul(inputs, ops.cast(kernel, inputs.dtype))

    def compute_mask(self, inputs, mask=None):
        # Reverse mode maps features to logits: the token mask passes through unchanged.
        if "int" not in keras.backend.standardize_dtype(inputs.dtype):
            return mask
        return super().compute_mask(inputs, mask)

    def compute_output_shape(self, input_shape, reverse: bool = False):
        if reverse:
            return (*input_shape[:-1], self.input_dim)
        return super().compute_output_shape(input_shape)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(tie_weights=self.tie_weights)
        return config


@keras.saving.register_keras_serializable(package="relpos")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding, keras-hub's arguments.

    With ``mask_zero=True`` the Keras mask of token id 0 gives every row its own positions: a
    left-padded row embeds exactly as the same tokens alone (keras-hub shifts it).

    Args:
        vocabulary_size: token ids.
        sequence_length: positions in the learned table.
        embedding_dim: width ``d``.
        tie_weights: whether ``token_embedding(x, reverse=True)`` uses the embedding matrix.
        embeddings_initializer: for both tables.
        mask_zero: token id 0 is padding; the output carries a Keras mask.

    Call arguments: ``inputs`` ``(b, n)`` token ids in ``[0, vocabulary_size)``; ``start_index``,
    ``positions``, ``segment_ids`` as :class:`PositionEmbedding`. Returns ``(b, n, d)``.

    An id outside ``[0, vocabulary_size)`` is a ``ValueError`` naming ``inputs`` and the id
    wherever the ids hold values (eagerly, every backend). Under ``jit`` / ``tf.function`` they
    are traced and not checked: a negative id reads row ``id + vocabulary_size``, a larger one
    NaN on JAX, an error when run on TensorFlow's CPU (zeros on a GPU); see
    :func:`check_token_ids`.
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        embedding_dim: int,
        tie_weights: bool = True,
        embeddings_initializer="uniform",
        mask_zero: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (
            ("vocabulary_size", vocabulary_size),
            ("sequence_length", sequence_length),
            ("embedding_dim", embedding_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.vocabulary_size, self.sequence_length = vocabulary_size, sequence_length
        self.embedding_dim = embedding_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        init = keras.initializers.serialize(self.embeddings_initializer)
        self.token_embedding = ReversibleEmbedding(
            vocabulary_size,
            embedding_dim,
            tie_weights=tie_weights,
            embeddings_initializer=keras.initializers.get(init),
            mask_zero=mask_zero,
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.position_embedding = PositionEmbedding(
            sequence_length,
            initializer=_own_draw(self.embeddings_initializer, offset=2),
            dtype=self.dtype_policy,
            name="position_embedding",
        )
        self.supports_masking = mask_zero

    def build(self, input_shape) -> None:
        self.token_embedding.build(input_shape)
        self.position_embedding.build((*input_shape, self.embedding_dim))
        self.built = True

    def call(self, inputs, start_index=0, positions=None, segment_ids=None):
        inputs, ragged_mask, lengths = dense_and_mask(inputs)
        if len(inputs.shape) != 2:
            raise ValueError(f"inputs must be token ids of shape (b, n), got {tuple(inputs.shape)}")
        inputs = check_token_ids(inputs, self.vocabulary_size, size_name="vocabulary_size")
        tokens = self.token_embedding(inputs)
        mask = self.token_embedding.compute_mask(inputs)
        if ragged_mask is not None:
            mask = ragged_mask if mask is None else ops.logical_and(mask, ragged_mask)
        pe = self.position_embedding(
            tokens,
            start_index=start_index,
            positions=positions,
            mask=mask,
            segment_ids=segment_ids,
        )
        return restore_ragged(tokens + pe, lengths)

    def compute_mask(self, inputs, mask=None):
        return self.token_embedding.compute_mask(inputs)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.embedding_dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            vocabulary_size=self.vocabulary_size,
            sequence_length=self.sequence_length,
            embedding_dim=self.embedding_dim,
            tie_weights=self.token_embedding.tie_weights,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
            mask_zero=self.token_embedding.mask_zero,
        )
        return config
