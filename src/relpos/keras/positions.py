"""Per-row token positions with ``keras.ops``: the Keras twin of :class:`relpos.Positions`.

Every Keras layer of relpos reads positions from here and never from array indices. A
:class:`Positions` is a pair of int32 tensors:

- ``pos`` ``(b|1, n)`` — the token's position inside its own sequence (0 for padding);
- ``seg`` ``(b|1, n)`` — the sequence (segment) it belongs to within its row, ``-1`` for padding.

Batch size 1 stands for every row (plain batches broadcast). It is a ``NamedTuple``, so it passes
through ``jit``, ``tf.function`` and Keras' tree utilities as two tensors.

Shape legend: ``b`` batch, ``n`` tokens, ``i`` queries, ``j`` keys.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, NamedTuple

import keras
from keras import ops

__all__ = [
    "PAD_SEGMENT",
    "Positions",
    "SameShapeLayer",
    "accumulation_dtype",
    "allowed_pairs",
    "check_finite_positive",
    "check_mask",
    "continue_positions",
    "dense_and_mask",
    "distance_range",
    "holds_values",
    "plain_positions",
    "positions_from_mask",
    "positions_from_segments",
    "resolve_positions",
    "restore_ragged",
    "segments_within_mask",
    "sequence_length",
    "sequence_lengths",
    "slot_log_decay",
    "token_positions",
    "value_bounds",
    "with_log_decay",
]

#: Segment id of padding tokens.
PAD_SEGMENT = -1


class Positions(NamedTuple):
    """``pos`` and ``seg``, int32 ``(b|1, n)``; see the module docstring. ``log_decay``, float
    ``(b, n, h)`` or None: each token's cumulative log forget gate over the earlier tokens of its
    own sequence (set by a contextual scheme, the Forgetting Transformer's; see
    :func:`with_log_decay`). ``compact``, a Python bool: every row's real positions are known to
    span at most ``n`` consecutive values (positions counted inside rows: from a mask, segments,
    a start index, a cache), so distance schemes take their static window without a
    data-dependent branch; False (unknown) for explicit ``positions=``."""

    pos: Any
    seg: Any
    log_decay: Any = None
    compact: bool = False

    @property
    def valid(self):
        """``(b|1, n)`` bool: True for real tokens."""
        return ops.not_equal(self.seg, PAD_SEGMENT)


def sequence_length(x, axis: int = 1):
    """``x.shape[axis]`` when static, else the dynamic length (a scalar tensor)."""
    return x.shape[axis] if x.shape[axis] is not None else ops.shape(x)[axis]


def dense_and_mask(inputs, mask=None):
    """Accept a ``tf.RaggedTensor`` ``(b, None, ...)`` on the TensorFlow backend: return it
    zero-padded, a ``(b, n)`` mask of its real tokens (combined with ``mask``), and its row
    lengths for :func:`restore_ragged`. Any other input passes through with lengths None."""
    if keras.backend.backend() != "tensorflow":
        return inputs, mask, None
    import tensorflow as tf

    if not isinstance(inputs, tf.RaggedTensor):
        return inputs, mask, None
    lengths = inputs.row_lengths()
    dense = inputs.to_tensor()
    valid = tf.sequence_mask(lengths, maxlen=tf.shape(dense)[1])
    if mask is not None:
        if isinstance(mask, tf.RaggedTensor):
            mask = mask.to_tensor(default_value=False)
        valid = tf.logical_and(valid, tf.cast(mask, tf.bool))
    return dense, valid, lengths


def holds_values(x) -> bool:
    """Whether ``x`` holds values now (eager) rather than standing for them while a function is
    traced (``jax.jit``, ``tf.function``, or Keras building a symbolic model on those backends),
    so that a data-dependent check can read it. Always True on the torch backend, which Keras
    runs eagerly by default."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and hasattr(x, "numpy")
    return True


def value_bounds(x) -> tuple[int, int] | None:
    """``(min, max)`` of an integer tensor where it holds values (:func:`holds_values`) and is not
    empty, for the checks that read them; ``None`` where it is traced or empty."""
    if not holds_values(x) or 0 in tuple(x.shape):
        return None
    return int(ops.convert_to_numpy(ops.min(x))), int(ops.convert_to_numpy(ops.max(x)))


def restore_ragged(outputs, lengths):
    """The inverse of :func:`dense_and_mask` for an output with the input's token axis."""
    if lengths is None:
        return outputs
    import tensorflow as tf

    return tf.RaggedTensor.from_tensor(outputs, lengths=lengths)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer_tensor(name: str, x) -> Any:
    """``x`` as a tensor, or a TypeError naming it unless it holds integers."""
    x = ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    if "int" not in dtype:
        raise TypeError(f"{name} must hold integers, got dtype {dtype}")
    return x


def _check_integer_tensor(name: str, x, *, rank: int) -> Any:
    x = _integer_tensor(name, x)
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    return ops.cast(x, "int32")


def _offset(start_index, batch) -> Any:
    """``start_index`` (an int, or one offset per row ``(b,)``) as int32 ``(1|b, 1)``."""
    if _is_int(start_index):
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        return ops.full((1, 1), start_index, dtype="int32")
    if isinstance(start_index, bool) or isinstance(start_index, float):
        raise TypeError(
            f"start_index must be an int or an integer tensor, got {type(start_index).__name__}"
        )
    off = _integer_tensor("start_index", start_index)
    if len(off.shape) == 0:
        return ops.reshape(ops.cast(off, "int32"), (1, 1))
    rows = off.shape[0]
    if len(off.shape) != 1 or (rows is not None and batch is not None and rows not in (1, batch)):
        raise ValueError(
            f"start_index must be an int or have shape (b,) = ({batch},), got shape "
            f"{tuple(off.shape)}"
        )
    return ops.reshape(ops.cast(off, "int32"), (-1, 1))


def plain_positions(n, start_index=0, batch=None) -> Positions:
    """``start_index, start_index+1, …`` for ``n`` tokens, one sequence per row.

    ``start_index`` is an int (batch-1 result, broadcasts) or one offset per row ``(b,)``.
    """
    off = _offset(start_index, batch)
    pos = ops.expand_dims(ops.arange(n, dtype="int32"), 0) + off
    return Positions(pos, ops.zeros_like(pos), compact=True)


def positions_from_mask(mask, start_index=0) -> Positions:
    """Positions from a ``(b, n)`` mask, True (or 1) for real tokens, for any padding layout.

    A real token's position is the number of real tokens before it in its row (a cumulative sum),
    plus ``start_index``; padding gets segment -1.
    """
    mask = ops.convert_to_tensor(mask)
    if len(mask.shape) != 2:
        raise ValueError(f"mask must have shape (b, n), got shape {tuple(mask.shape)}")
    valid = ops.cast(mask, "bool")
    count = ops.cumsum(ops.cast(valid, "int32"), axis=1)
    pos = ops.where(valid, count - 1 + _offset(start_index, mask.shape[0]), 0)
    return Positions(pos, ops.where(valid, 0, PAD_SEGMENT), compact=True)


def _check_segment_ids(name: str, segment_ids) -> Any:
    """``segment_ids`` as int32 ``(b, n)``: integers of rank 2, and ``>= 0`` or ``-1`` (padding)
    wherever they hold values (:func:`holds_values`), with the message of the PyTorch
    :meth:`relpos.Positions.from_segments`. Under ``jit`` / ``tf.function`` traced ids cannot be
    read: an id below -1 is not checked there and is one more document (its tokens attend to each
    other, as any other id's)."""
    seg = _check_integer_tensor(name, segment_ids, rank=2)
    if holds_values(seg) and 0 not in tuple(seg.shape):
        lowest = int(ops.convert_to_numpy(ops.min(seg)))
        if lowest < PAD_SEGMENT:
            raise ValueError(f"{name} must be >= 0, or -1 for padding (got {lowest})")
    return seg


def positions_from_segments(segment_ids, start_index=0) -> Positions:
    """Positions for packed rows from ``(b, n)`` integer segment ids (``-1`` for padding).

    A token's position is the number of earlier tokens of its row with the same id, so positions
    restart at every document whatever the layout. Computed as a ``(b, n, n)`` comparison (no
    sort), vectorised over the batch. Ids below -1 are a ``ValueError`` where they hold values
    (eagerly); under ``jit`` such an id is one more document.
    """
    return _segment_positions(_check_segment_ids("segment_ids", segment_ids), start_index)


def _segment_positions(seg, start_index=0) -> Positions:
    """:func:`positions_from_segments` of int32 ``seg`` ``(b, n)`` already checked."""
    n = ops.shape(seg)[1]
    idx = ops.arange(n, dtype="int32")
    earlier = ops.expand_dims(idx, 1) > ops.expand_dims(idx, 0)  # (i, j): j before i
    same = ops.expand_dims(seg, 2) == ops.expand_dims(seg, 1)  # (b, i, j)
    rank = ops.sum(ops.cast(ops.logical_and(same, earlier), "int32"), axis=2)
    valid = ops.not_equal(seg, PAD_SEGMENT)
    pos = ops.where(valid, rank + _offset(start_index, seg.shape[0]), 0)
    return Positions(pos, ops.where(valid, seg, PAD_SEGMENT), compact=True)


def segments_within_mask(
    segment_ids, mask, batch=None, n=None, *, prefix: str = "", axis: str = "n"
):
    """``segment_ids`` ``(b, n)`` with padding (-1) wherever ``mask`` ``(b, n)`` is False: a token
    is real only where both say so. Lets packed ``segment_ids`` meet the Keras mask an upstream
    ``mask_zero`` layer attaches (Keras passes it to the attention layer by itself). ``prefix``
    goes before the argument names in error messages (``"value_"``: ``value_segment_ids``), and
    ``axis`` names their token axis there (an attention layer's ``"i"`` or ``"j"``)."""
    seg = _check_segment_ids(prefix + "segment_ids", segment_ids)
    _check_shape(prefix + "segment_ids", seg, batch, n, axis)
    return ops.where(check_mask(mask, batch, n, prefix + "mask", axis), seg, PAD_SEGMENT)


def continue_positions(cached: Positions, n) -> Positions:
    """Positions of ``n`` new tokens continuing each row's last sequence (KV-cache decoding).

    The new tokens join the segment of the row's last real token at the next positions; a row with
    no real token starts segment 0 at position 0.
    """
    valid = cached.valid
    length = ops.shape(cached.pos)[1]
    idx = ops.broadcast_to(ops.arange(length, dtype="int32"), ops.shape(cached.pos))
    last = ops.maximum(ops.max(ops.where(valid, idx, -1), axis=1, keepdims=True), 0)
    has_any = ops.any(valid, axis=1, keepdims=True)
    last_pos = ops.take_along_axis(cached.pos, last, axis=1)
    last_seg = ops.take_along_axis(cached.seg, last, axis=1)
    start = ops.where(has_any, last_pos + 1, 0)
    seg = ops.where(has_any, last_seg, 0)
    new = ops.expand_dims(ops.arange(n, dtype="int32"), 0)
    return Positions(
        start + new, ops.broadcast_to(seg, ops.shape(start + new)), compact=cached.compact
    )


def _common_batch(parts):
    """The batch size of ``parts`` together: that of a part whose batch is not 1 (static or
    dynamic), else 1."""
    for p in parts:
        if p.pos.shape[0] != 1:
            return ops.shape(p.pos)[0]
    return 1


def sequence_lengths(*parts: Positions) -> tuple[Any, ...]:
    """The length of the sequence every token belongs to, over the tokens of ``parts`` together
    (the Keras twin of :func:`relpos.sequence_lengths`).

    A sequence is one segment of one row; its length is one more than the largest position any of
    its tokens in ``parts`` has (the queries and keys of one call, or a KV cache's slots), so a
    packed document gets its own length and a decoded row its length so far. Padding tokens get
    0. Used by length-dependent RoPE scalings (dynamic NTK, LongRoPE).

    Segment ids are arbitrary integers, so tokens are grouped by sorting them (``argsort``: the
    order inside a group does not matter) and each group's largest position is one segment max:
    ``O(N log N)`` for ``N`` tokens in all, no ``(N, N)`` comparison.

    Returns:
        one int32 ``(b, n_p)`` tensor per part (``b`` the parts' common batch, 1 if all are 1).
    """
    b = _common_batch(parts)
    sizes = [p.pos.shape[1] if p.pos.shape[1] is not None else ops.shape(p.pos)[1] for p in parts]
    pos = ops.concatenate([ops.broadcast_to(p.pos, (b, ops.shape(p.pos)[1])) for p in parts], 1)
    seg = ops.concatenate([ops.broadcast_to(p.seg, (b, ops.shape(p.seg)[1])) for p in parts], 1)
    total = ops.shape(seg)[1]
    order = ops.argsort(seg, axis=1)
    back = ops.argsort(order, axis=1)  # the inverse permutation
    sorted_seg = ops.take_along_axis(seg, order, axis=1)
    changes = ops.cast(sorted_seg[:, 1:] != sorted_seg[:, :-1], "int32")
    starts = ops.concatenate([ops.ones_like(sorted_seg[:, :1]), changes], axis=1)
    # A group id per token, unique over the batch: row r's groups are r·N + 0, 1, ...
    rows = ops.expand_dims(ops.arange(b, dtype="int32"), 1) * total
    group = ops.take_along_axis(ops.cumsum(starts, axis=1) - 1, back, axis=1) + rows
    flat = ops.reshape(group, (-1,))
    last = ops.segment_max(ops.reshape(pos, (-1,)), flat, num_segments=b * total)
    lengths = ops.reshape(ops.take(last, flat), (b, total)) + 1
    lengths = ops.where(seg == PAD_SEGMENT, 0, lengths)
    out, start = [], 0
    for size in sizes:
        out.append(lengths[:, start : start + size])
        start = start + size
    return tuple(out)


def distance_range(queries: Positions, keys: Positions):
    """``(lo, hi)``, int32 ``(b|1,)``: every ``k_pos - q_pos`` between real tokens of a row lies
    in ``[lo, hi]`` (0, 0 for a row with no real query or key). Per row and over real tokens only,
    so a row's range does not grow with the other rows' offsets or its own padding: for positions
    counted inside rows (a mask, segments, a start index, a cache) ``hi - lo <= i + j - 2``.
    The Keras twin of :func:`relpos.positions.distance_range`, with no device sync."""
    far = 2**29  # beyond any position; sums of two stay inside int32

    def extremes(p: Positions):
        valid = p.valid
        lo = ops.min(ops.where(valid, p.pos, far), axis=1)
        hi = ops.max(ops.where(valid, p.pos, -far), axis=1)
        return lo, hi, ops.any(valid, axis=1)

    q_lo, q_hi, q_any = extremes(queries)
    k_lo, k_hi, k_any = extremes(keys)
    real = ops.logical_and(q_any, k_any)
    return ops.where(real, k_lo - q_hi, 0), ops.where(real, k_hi - q_lo, 0)


def accumulation_dtype() -> str:
    """The dtype cumulative log decays are summed and kept in: float64 where the backend has it
    (TensorFlow, PyTorch; JAX with ``jax_enable_x64``), else float32."""
    if keras.backend.backend() == "jax":
        import jax

        return "float64" if jax.config.read("jax_enable_x64") else "float32"
    return "float64"


def with_log_decay(positions: Positions, log_f) -> Positions:
    """``positions`` whose tokens carry ``c_t = Σ log_f_l`` over the real tokens ``l`` of their
    own segment at positions ``<= p_t`` (the Keras twin of
    :meth:`relpos.Positions.with_log_decay`, without a cache): the sums restart at every document
    and skip padding (its ``log_f`` is ignored, its ``c`` is 0), whatever the order of the tokens
    along the axis. One ``(b, n, n)`` comparison and a matmul over it (``O(b·n²·h)``, a ``d``-th
    of the attention's), summed in :func:`accumulation_dtype`.

    Shapes: ``log_f`` ``(b, n, h)`` float → ``log_decay`` ``(b, n, h)``.
    """
    acc = accumulation_dtype()
    b, n = ops.shape(log_f)[0], ops.shape(log_f)[1]
    pos = ops.broadcast_to(positions.pos, (b, n))
    seg = ops.broadcast_to(positions.seg, (b, n))
    valid = ops.not_equal(seg, PAD_SEGMENT)
    same = ops.logical_and(
        ops.expand_dims(seg, 2) == ops.expand_dims(seg, 1),
        ops.expand_dims(pos, 2) >= ops.expand_dims(pos, 1),
    )  # (b, t, l): l is of t's segment, at or before it
    same = ops.logical_and(same, ops.expand_dims(valid, 1))
    step = ops.where(ops.expand_dims(valid, -1), ops.cast(log_f, acc), 0.0)
    decay = ops.einsum("btl,blh->bth", ops.cast(same, acc), step)
    decay = ops.where(ops.expand_dims(valid, -1), decay, 0.0)
    return Positions(pos, seg, decay, compact=positions.compact)


def slot_log_decay(log_f, valid):
    """``c`` of every cache slot: the running sum of ``log_f (b, S, h)`` over the real slots
    ``valid (b, S)`` of each row, in slot order (a keras-hub cache holds one sequence per row, in
    position order), in :func:`accumulation_dtype`; 0 at padding slots."""
    acc = accumulation_dtype()
    mask = ops.expand_dims(valid, -1)
    decay = ops.cumsum(ops.where(mask, ops.cast(log_f, acc), 0.0), axis=1)
    return ops.where(mask, decay, 0.0)


def allowed_pairs(queries: Positions, keys: Positions, *, causal: bool):
    """``(b|1, i, j)`` bool: both real, same segment, and ``k_pos <= q_pos`` when causal."""
    q_seg, k_seg = ops.expand_dims(queries.seg, 2), ops.expand_dims(keys.seg, 1)
    ok = ops.logical_and(q_seg == k_seg, q_seg != PAD_SEGMENT)
    if causal:
        ok = ops.logical_and(ok, ops.expand_dims(keys.pos, 1) <= ops.expand_dims(queries.pos, 2))
    return ok


def resolve_positions(
    n,
    *,
    batch=None,
    mask=None,
    segment_ids=None,
    positions=None,
    start_index=0,
    prefix: str = "",
    axis: str = "n",
) -> Positions:
    """The :class:`Positions` of ``n`` tokens from whichever the caller gave.

    Explicit ``positions`` (``(n,)`` or ``(b, n)`` integers: every token real, one sequence; a
    ``mask`` still marks padding), or ``segment_ids``, not both (a ``ValueError``: explicit
    positions hold one sequence per row, so the segments would be dropped); else ``mask`` (the
    Keras mask or a padding mask), else ``0..n-1``. ``segment_ids`` with a ``mask`` combine: a
    token is real only where both say so (:func:`segments_within_mask`). ``start_index`` (an int
    or one offset per row) is added to positions derived from a mask, segments or the length.
    ``prefix`` goes before the argument names in error messages, for a caller whose arguments
    are called e.g. ``value_segment_ids`` (``prefix="value_"``), as the PyTorch
    :func:`relpos.positions.resolve_positions` does; ``axis`` names the token axis in shape
    errors (``"n"``; an attention layer's queries ``"i"``, its value sequence ``"j"``).
    ``segment_ids`` must be ``>= 0`` or -1 (see :func:`positions_from_segments`).
    """
    if positions is not None and segment_ids is not None:
        raise ValueError(
            f"pass at most one of {prefix}positions and {prefix}segment_ids: explicit positions "
            "are one sequence per row, so the segments would be ignored"
        )
    seg = None
    if segment_ids is not None and mask is not None:  # checked there
        seg = segments_within_mask(segment_ids, mask, batch, n, prefix=prefix, axis=axis)
        mask = None
    if positions is not None:
        pos = _integer_tensor(prefix + "positions", positions)
        if len(pos.shape) == 1:
            pos = ops.expand_dims(pos, 0)
        rows = pos.shape[0] if len(pos.shape) == 2 else None
        if (
            len(pos.shape) != 2
            or (pos.shape[1] is not None and _is_int(n) and pos.shape[1] != n)
            or (_is_int(rows) and _is_int(batch) and rows not in (1, batch))
        ):
            raise ValueError(
                f"{prefix}positions must have shape ({axis},) or (b, {axis}) = ({batch}, {n}), "
                f"got {tuple(pos.shape)}"
            )
        pos = ops.cast(pos, "int32")
        if mask is None:
            return Positions(pos, ops.zeros_like(pos))
        valid = check_mask(mask, batch, n, prefix + "mask", axis)
        return Positions(ops.where(valid, pos, 0), ops.where(valid, 0, PAD_SEGMENT))
    if segment_ids is not None:
        if seg is None:
            seg = _check_segment_ids(prefix + "segment_ids", segment_ids)
            _check_shape(prefix + "segment_ids", seg, batch, n, axis)
        return _segment_positions(seg, start_index)
    if mask is not None:
        return positions_from_mask(check_mask(mask, batch, n, prefix + "mask", axis), start_index)
    return plain_positions(n, start_index, batch)


def _check_shape(name, x, batch, n, axis: str = "n") -> None:
    """``x`` of shape ``(b, n)`` where those are known; the message calls the token axis
    ``axis`` (an attention layer's ``"i"`` for the queries, ``"j"`` for the value sequence)."""
    shape = tuple(x.shape)
    ok = len(shape) == 2 and all(
        not _is_int(want) or got is None or got == want
        for got, want in zip(shape, (batch, n), strict=True)
    )
    if not ok:
        raise ValueError(f"{name} must have shape (b, {axis}) = ({batch}, {n}), got {shape}")


def check_mask(mask, batch, n, name="mask", axis: str = "n"):
    """``mask`` as bool ``(b, n)``, its shape checked where known (:func:`_check_shape`)."""
    mask = ops.convert_to_tensor(mask)
    _check_shape(name, mask, batch, n, axis)
    return ops.cast(mask, "bool")


def token_positions(inputs, *, mask=None, segment_ids=None, positions=None, start_index=0):
    """The :class:`Positions` of the tokens of ``inputs (b, n, ...)``, from whichever the caller
    gave (see :func:`resolve_positions`)."""
    if len(inputs.shape) < 2:
        raise ValueError(f"inputs must have shape (b, n, ...), got {tuple(inputs.shape)}")
    return resolve_positions(
        sequence_length(inputs),
        batch=inputs.shape[0],
        mask=mask,
        segment_ids=segment_ids,
        positions=positions,
        start_index=start_index,
    )


def check_finite_positive(name: str, value: Any) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a finite real number ``> 0``
    (NaN and inf refused, as :func:`relpos.schemes.base.check_positive_float` does)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class SameShapeLayer(keras.layers.Layer):
    """A position layer whose output has its input's shape and keeps its Keras mask."""

    def compute_mask(self, inputs, mask=None):
        return mask

    def compute_output_shape(self, input_shape):
        return input_shape
