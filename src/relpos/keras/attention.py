"""``RelativeMultiHeadAttention``: ``keras.layers.MultiHeadAttention`` with a positional scheme,
per-row positions and a decoding cache."""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

import keras
from keras import ops

from ..spec.base import check_causal, check_dropout, check_head_groups, check_int
from .positions import (
    PAD_SEGMENT,
    Positions,
    allowed_pairs,
    check_mask,
    dense_and_mask,
    positions_from_mask,
    resolve_positions,
    restore_ragged,
    sequence_length,
    slot_log_decay,
    value_bounds,
    with_log_decay,
)
from .schemes import make_attention_scheme, scheme_config

__all__ = ["RelativeMultiHeadAttention", "attend", "repeat_kv_heads", "zero_padding"]


def zero_padding(x, valid):
    """``x`` ``(b, n, ...)`` with exact zeros at the tokens ``valid`` ``(b|1, n)`` marks False.

    The layer applies it to its inputs before the projections (and the forget gate) read them,
    and to the keys and values before attention (masked keys, cache slots): then nothing a
    padding token holds, not even NaN or inf, reaches a real token or a weight's gradient (a
    masked probability is 0, but ``0·NaN`` is NaN). ``where``, not a product: NaN is dropped.
    The Keras twin of the PyTorch layer's ``zero_padding_tokens`` and its backends'
    ``zero_padding_keys``."""
    keep = ops.cast(valid, "bool")
    for _ in range(len(x.shape) - 2):
        keep = ops.expand_dims(keep, -1)
    return ops.where(keep, x, ops.zeros_like(x))


def attend(
    q,
    k,
    v,
    scheme,
    q_positions: Positions,
    k_positions: Positions,
    *,
    allowed,
    dropout=None,
    training=None,
    return_scores=False,
):
    """Attention of ``q`` over ``k, v`` with a scheme's terms, masked to ``allowed`` pairs.

    Schemes that add no logit or value term (``nope``, ``rope``) run
    ``keras.ops.dot_product_attention`` (the backend's fused kernel) unless scores or dropout are
    asked for; the others compute float32 logits ``q·kᵀ/√d + score_bias``, softmax, ``p·v +
    value_term`` (``+ key_bias`` for a scheme that reads the keys: DeBERTa's p2c, CoPE). A query
    with no key to attend to gets zeros, not NaN.

    Shapes:
        q: ``(b, i, h, d)``; k, v: ``(b, j, h, d)`` (rotated; grouped key/value heads already
        repeated); allowed: ``(b|1, i, j)`` bool.
        Returns ``(b, i, h, d)`` in ``q``'s dtype, and the probabilities ``(b, h, i, j)`` when
        ``return_scores``.
    """
    # A row with no allowed key attends everywhere (finite), then gets zeros.
    has_key = ops.any(allowed, axis=-1, keepdims=True)
    safe = ops.expand_dims(ops.logical_or(allowed, ops.logical_not(has_key)), 1)  # (b|1,1,i,j)
    use_dropout = dropout is not None and dropout.rate > 0 and bool(training)
    if not scheme.adds_terms and not return_scores and not use_dropout:
        scale = 1.0 / math.sqrt(q.shape[-1])
        mask = ops.broadcast_to(safe, (ops.shape(q)[0], 1, ops.shape(q)[1], ops.shape(k)[1]))
        out = ops.dot_product_attention(q, k, v, mask=mask, scale=scale)
        return ops.where(ops.expand_dims(has_key, -1), out, ops.zeros_like(out)), None
    qf, kf = ops.cast(q, "float32"), ops.cast(k, "float32")
    logits = ops.einsum("bihd,bjhd->bhij", qf, kf) / math.sqrt(q.shape[-1])
    bias = scheme.score_bias(q, q_positions, k_positions)
    if bias is not None:
        logits = logits + bias
    bias = scheme.key_bias(q, k, q_positions, k_positions)
    if bias is not None:
        logits = logits + bias
    logits = ops.where(safe, logits, -3.0e38)
    probs = ops.softmax(logits, axis=-1) * ops.cast(ops.expand_dims(allowed, 1), "float32")
    if use_dropout:
        probs = dropout(probs, training=training)
    out = ops.einsum("bhij,bjhd->bihd", probs, ops.cast(v, "float32"))
    term = scheme.value_term(probs, q_positions, k_positions)
    if term is not None:
        out = out + term
    return ops.cast(out, q.dtype), probs if return_scores else None


def _write_cache(cache, new, index):
    """Write ``new (b, n, ...)`` into ``cache (b, S, ...)`` at slots ``index .. index+n-1`` of
    every row (``index`` ``(b|1, 1)`` int32), vectorised over rows."""
    n = ops.shape(new)[1]
    slots = ops.expand_dims(ops.arange(ops.shape(cache)[1], dtype="int32"), 0)
    t = slots - index  # (b|1, S): which new token lands in each slot
    write = ops.logical_and(t >= 0, t < n)
    take = ops.clip(t, 0, n - 1)
    take = ops.broadcast_to(take, (ops.shape(new)[0], ops.shape(cache)[1]))
    for _ in range(len(cache.shape) - 2):  # (b, S, 1, ...) against the trailing axes
        take, write = ops.expand_dims(take, -1), ops.expand_dims(write, -1)
    gathered = ops.take_along_axis(new, take, axis=1)
    return ops.where(write, gathered, cache)


def _same_size(got, want) -> bool:
    """Whether a static size ``got`` may be ``want`` (None, unknown, matches anything)."""
    return got is None or want is None or got == want


def _check_batch(name, x, batch, layout) -> None:
    if not _same_size(x.shape[0], batch):
        raise ValueError(
            f"{name} must have shape {layout} with the query's b = {batch}, got {tuple(x.shape)}"
        )


def _cache_index(index, n, slots, batch):
    """``cache_update_index`` (an int or one per row ``(b,)``) as int32 ``(b|1, 1)``, checked
    against the cache: ``0 <= index`` and ``index + n <= S`` wherever the index holds values (a
    Python int always, a tensor eagerly). Under ``jit`` a traced index is not checked: see
    :func:`_inside_cache` for what a write past the end does there."""
    if isinstance(index, bool) or isinstance(index, float):
        raise TypeError(
            f"cache_update_index must be an int or an integer tensor, got {type(index).__name__}"
        )
    bounds = (index, index) if isinstance(index, int) else None
    index = ops.convert_to_tensor(index)
    if "int" not in keras.backend.standardize_dtype(index.dtype):
        raise TypeError(f"cache_update_index must hold integers, got dtype {index.dtype}")
    rank = len(index.shape)
    if rank > 1 or (rank == 1 and index.shape[0] != 1 and not _same_size(index.shape[0], batch)):
        raise ValueError(
            f"cache_update_index must be an int or have shape (b,) = ({batch},), got shape "
            f"{tuple(index.shape)}"
        )
    index = ops.reshape(ops.cast(index, "int32"), (-1, 1))
    if bounds is None:
        bounds = value_bounds(index)
    if bounds is not None and isinstance(n, int) and isinstance(slots, int):
        lo, hi = bounds
        if lo < 0:
            raise ValueError(f"cache_update_index must be >= 0, got {lo}")
        if hi + n > slots:
            raise ValueError(
                f"cache_update_index + n must be <= S: {n} new token(s) written at slot {hi} "
                f"need {hi + n} slots, the cache has S={slots}"
            )
    return index


def _new_slots(index, n, b, slots):
    """``(b, n)`` int32: the slot of each new token, clamped into the cache."""
    new = index + ops.expand_dims(ops.arange(n, dtype="int32"), 0)
    return ops.broadcast_to(ops.clip(new, 0, slots - 1), (b, n))


def _inside_cache(index, n, slots):
    """``(b|1, n)`` bool: the new tokens whose slot lies inside the cache. Under ``jit`` a write
    past the end (not checked there) is defined: those tokens are not written and their outputs
    are zeros, as padding's."""
    new = index + ops.expand_dims(ops.arange(n, dtype="int32"), 0)
    return ops.logical_and(new >= 0, new < slots)


def _check_value_positions(
    value_segment_ids, value_positions, segment_ids, self_attention: bool
) -> None:
    """Refuse ``value_segment_ids`` / ``value_positions`` where they cannot apply (self-attention;
    a cache is self-attention only, :func:`_check_call_arguments`), and ``segment_ids`` on one
    side only of a cross-attention: the other side would be one document (0), so the queries of
    every other document would attend to nothing (zeros) or only to the keys of document 0.
    Static checks (which arguments are given): also under jit."""
    given = [
        name
        for name, v in (
            ("value_segment_ids", value_segment_ids),
            ("value_positions", value_positions),
        )
        if v is not None
    ]
    if given and self_attention:
        raise ValueError(
            f"{' and '.join(given)} need a distinct value sequence (cross-attention): in "
            "self-attention the keys are the query's tokens, at the query's positions "
            "(segment_ids=, positions=)"
        )
    if self_attention:
        return
    if segment_ids is not None and value_segment_ids is None:
        raise ValueError(
            "in cross-attention segment_ids needs value_segment_ids (b, j), the documents of the "
            "value sequence (query document s attends to value document s): without them every "
            "key is in document 0 and the queries of any other document attend to nothing. For "
            "padding alone pass query_mask"
        )
    if value_segment_ids is not None and segment_ids is None:
        raise ValueError(
            "in cross-attention value_segment_ids needs the queries' segment_ids (b, i) (query "
            "document s attends to value document s): without them every query is in document 0 "
            "and attends only to value document 0. For padding alone pass value_mask"
        )


def _start_index_given(start_index) -> bool:
    """Whether the caller passed a ``start_index``: anything but the default, the int 0. Decided
    on the argument as passed, never on its values: a tensor counts as given (even one holding 0),
    so the answer is the same eagerly and under ``jit`` / ``tf.function``, where it is traced."""
    return not (
        isinstance(start_index, Integral)
        and not isinstance(start_index, bool)
        and int(start_index) == 0
    )


def _check_call_arguments(
    positions, start_index, segment_ids, self_attention: bool, cached: bool
) -> None:
    """Refuse what would be silently ignored or meaningless; static checks (which arguments are
    given), so also under jit. A cache in cross-attention: a cross-attention layer takes the whole
    value sequence (the encoder's output) at every step, so there are no keys of its own to cache
    (the layer would write the value tokens into slots sized by the query). ``start_index`` beside
    explicit ``positions`` (which place every token) or a cache (``cache_mask`` places the
    slots) would be ignored."""
    if cached and not self_attention:
        raise ValueError(
            "a cache cannot be combined with cross-attention (a distinct value): a "
            "cross-attention layer takes the whole context at every step, so it has no keys of "
            "its own to cache; pass the value sequence at every decoding step and no cache"
        )
    start = _start_index_given(start_index)
    if cached:
        given = [
            name
            for name, v in (("positions", positions), ("segment_ids", segment_ids))
            if v is not None
        ] + (["start_index"] if start else [])
        if given:
            raise ValueError(
                f"with a cache, positions come from cache_mask; do not pass {' or '.join(given)}"
            )
    elif start and positions is not None:
        raise ValueError(
            "pass at most one of positions and start_index: explicit positions place every "
            "token, so start_index would be ignored (add the offset to positions)"
        )


def repeat_kv_heads(x, groups: int):
    """Grouped-query attention: each of the ``h_kv`` key/value heads of ``x (b, j, h_kv, d)``
    repeated ``groups`` times in place, ``(b, j, h_kv·groups, d)``, so query head ``i`` reads
    key/value head ``i // groups`` (PyTorch's ``repeat_interleave``)."""
    return x if groups == 1 else ops.repeat(x, groups, axis=2)


@keras.saving.register_keras_serializable(package="relpos")
class RelativeMultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with any relpos attention scheme; a drop-in for
    ``keras.layers.MultiHeadAttention`` on ``(b, n, D)`` inputs: its constructor and call
    arguments, except ``attention_axes`` (other than the sequence axis) and a multi-axis
    ``output_shape``, which are refused by name.

    Positions come from each token's place in its own sequence: the Keras mask (or
    ``query_mask``), ``segment_ids`` of packed rows, ``positions``, or ``start_index`` (an int or
    one offset per row). Padding queries output zeros; tokens of different segments never attend
    to each other. In cross-attention the value sequence has its own positions: ``value_mask``,
    ``value_segment_ids`` (packed encoder-decoder rows) or ``value_positions``. Keys masked by
    ``value_mask`` or ``key_mask`` are not attended, in self- and cross-attention, as in Keras'
    layer; a query left with no key outputs zeros.

    Args:
        num_heads: query heads ``h``.
        key_dim: size of each query/key head ``d``.
        value_dim: size of each value head (default ``key_dim``; must equal it for a scheme with a
            value term, and with a cache).
        dropout: dropout on the attention probabilities in training.
        use_bias: biases in the projections.
        output_shape: output width, an int or a 1-tuple (default: the query's).
        scheme: a scheme name (``"nope"``, ``"rope"``, ``"alibi"``, ``"learned_alibi"``,
            ``"kerple"``, ``"dpb"``, ``"t5"``, ``"shaw"``, ``"music"``, ``"transformer_xl"``,
            ``"deberta"``, ``"cope"``, ``"forgetting"``),
            config dict or :class:`relpos.schemes.SchemeConfig`.
        causal: causal attention; ``use_causal_mask=True`` at call time also masks. It decides
            the scheme's geometry (T5 bucketing, the Music Transformer's table), so set it here
            for a decoder.
        kernel_initializer, bias_initializer: for the projections.
        num_key_value_heads: key/value heads ``h_kv`` (default ``num_heads``; keras-hub's name),
            a divisor of ``num_heads``: grouped-query attention (Ainslie et al., 2023; 1 is
            multi-query attention, Shazeer, 2019). Query head ``i`` reads key/value head
            ``i // (h / h_kv)``, as :class:`relpos.MultiheadAttention` with ``num_kv_heads``.
        kernel_regularizer, bias_regularizer, kernel_constraint, bias_constraint: for the
            projections (a scheme's own weights take none), as Keras'.
        seed: of the attention dropout.
        attention_axes: None, or the sequence axis (1 or -2); anything else is refused.

    Call arguments:
        query: ``(b, i, D)``. value: ``(b, j, D)``, or None (or the very object passed as
            ``query``) for self-attention, where keys share the query's positions. key: default
            ``value``; not without ``value`` (a ``ValueError``). Self-attention is decided on
            the arguments as passed, before Keras converts or casts each of them (numpy inputs,
            float32 under ``mixed_*``): ``attn(x, x)`` is ``attn(x)``; an equal but distinct
            tensor is cross-attention.
        query_mask, value_mask, key_mask: ``(b, i)``/``(b, j)``/``(b, j)`` True for tokens
            (filled from Keras masks; ``mask`` is the query's when the layer is called on one
            tensor, ``attn(x)``). A key that ``value_mask`` or ``key_mask`` marks False is not
            attended, as in ``keras.layers.MultiHeadAttention``. Positions: in self-attention
            every token keeps the query's position (``query_mask``, ``segment_ids``, ...), so
            ``value_mask`` and ``key_mask`` only mask keys; in cross-attention the keys are
            numbered among the real tokens of ``value_mask`` (else ``key_mask``), the value
            sequence's padding mask, unless ``value_segment_ids`` or ``value_positions`` place
            them. Not with a cache (``cache_mask`` says which slots hold tokens;
            ``attention_mask`` masks pairs).
        attention_mask: ``(b, i, j)`` bool, pairs that may attend (combined with the positions').
        use_causal_mask: mask future keys (by position, not index).
        return_attention_scores: also return the probabilities ``(b, h, i, j)``.
        positions: ``(i,)`` or ``(b, i)`` integer positions. segment_ids: ``(b, i)`` int, ``>= 0``
            or -1 for padding; with a query mask (an upstream ``mask_zero`` layer's, which Keras
            passes by itself, or ``query_mask``) a token is real only where both say so. An id
            below -1 is a ``ValueError`` wherever the ids hold values (eagerly, as PyTorch's
            ``Positions.from_segments``); under ``jit`` / ``tf.function`` traced ids are not
            checked, and such an id is one more document (as the cache index and a learned
            table's positions, a traced value is not checked but gives a defined result).
            start_index: int or ``(b,)`` offset of the first token. ``positions`` and
            ``segment_ids`` together are refused (explicit positions are one sequence per row),
            and so is ``positions`` with a ``start_index`` other than the default int 0 (it
            would be ignored; decided on the arguments given, so a tensor ``start_index``
            counts as given, also under ``jit``).
        value_segment_ids, value_positions: cross-attention only (a distinct ``value``; refused
            in self-attention, where keys are the query's tokens, and with a cache): the value
            sequence's own ``segment_ids`` ``(b, j)`` (-1 for padding) or ``positions`` ``(j,)``
            / ``(b, j)``, resolved as the query's (with ``value_mask``, else ``key_mask``, as
            their mask), at most one of them. Packed encoder-decoder rows: query document ``s``
            attends to value document ``s`` only, each token at its position in its own
            document; the scheme sees ``k_pos - q_pos`` (``causal``: ``k_pos <= q_pos``). As
            :class:`relpos.MultiheadAttention`'s ``context_segment_ids`` /
            ``context_positions``, same numbers. In cross-attention ``segment_ids`` and
            ``value_segment_ids`` go together (a ``ValueError`` for either alone: the other side
            would be one document, 0, and the queries of any other document would attend to
            nothing); a query whose document has no key outputs zeros.
        cache: ``(b, 2, S, h_kv, d)`` keys and values of ``S`` slots (keras-hub's layout), in
            self-attention only: with a distinct ``value`` it is a ``ValueError``, as
            :class:`relpos.MultiheadAttention` refuses a cache with ``context=`` (a
            cross-attention layer takes the whole context at every step). ``positions``,
            ``segment_ids`` and ``start_index`` are refused with it (``cache_mask`` places the
            tokens). Keys are stored rotated, except for a scheme that ``rotates_cached_keys``
            (RoPE with a ``dynamic`` or ``longrope`` scaling): it stores raw keys and rotates
            every cached key at each call with the length its sequence has now, so decoding step
            ``t`` equals the forward over the row's first ``t`` tokens.
            A ``contextual`` scheme (``forgetting``) takes the pair ``(that, log_gates)``,
            ``log_gates`` float32 ``(b, S, h)``: each slot's log forget gate per head, written
            with its key (:meth:`empty_cache` builds either kind).
        cache_update_index: slot of the first new token, an int or one per row ``(b,)``; the
            ``i`` new tokens must fit, ``index + i <= S``: a ``ValueError`` for an int, and for a
            tensor eagerly. Under ``jit`` a traced index is not checked: new tokens past the
            last slot are not written and output zeros, as padding.
        cache_mask: ``(b, S)`` True for slots holding tokens after this write (default: slots
            before ``cache_update_index + i``). Slot positions are counted from it per row, so a
            left-padded prompt continues at its own positions. With a cache, ``query_mask`` is
            not read: ``cache_mask`` says which of the new tokens are real.

    Returns:
        ``(b, i, output_shape)``; then the scores if asked, then the updated cache if given
        (symbolically too, in a functional model).
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | None = None,
        scheme: Any = None,
        causal: bool = False,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        num_key_value_heads: int | None = None,
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        seed: int | None = None,
        attention_axes=None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if attention_axes is not None and tuple(
            attention_axes if isinstance(attention_axes, list | tuple) else (attention_axes,)
        ) not in ((1,), (-2,)):
            raise ValueError(
                "attention_axes is not supported: relpos attends over the sequence axis of "
                f"(b, n, D) inputs (axis 1) only, got {attention_axes!r}"
            )
        if isinstance(output_shape, list | tuple):
            if len(output_shape) != 1:
                raise ValueError(
                    "output_shape must be an int or a 1-tuple (the output width): outputs are "
                    f"(b, i, output_shape), got {tuple(output_shape)!r}"
                )
            output_shape = output_shape[0]
        if output_shape is not None and (
            isinstance(output_shape, bool) or not isinstance(output_shape, int) or output_shape < 1
        ):
            raise ValueError(f"output_shape must be a positive int, got {output_shape!r}")
        num_key_value_heads = num_heads if num_key_value_heads is None else num_key_value_heads
        check_int("num_heads", num_heads, minimum=1)
        check_int("key_dim", key_dim, minimum=1)
        check_head_groups(num_heads, num_key_value_heads, name="num_key_value_heads")
        self.num_key_value_heads = num_key_value_heads
        dropout = check_dropout(dropout)
        self.num_heads, self.key_dim = num_heads, key_dim
        self.value_dim = key_dim if value_dim is None else value_dim
        self.dropout_rate, self.use_bias = dropout, use_bias
        self.causal = check_causal(causal)  # a bool: "false" would run causal
        self.output_dim = output_shape
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        config = scheme_config(scheme)
        self.scheme_spec = config.to_dict()
        self.position_scheme = make_attention_scheme(
            config,
            num_heads=num_heads,
            head_dim=key_dim,
            causal=self.causal,
            dtype=self.dtype_policy,
        )
        if self.position_scheme.has_value_term and self.value_dim != key_dim:
            raise ValueError(
                f"scheme {config.name!r} with values needs value_dim == key_dim ({key_dim}), "
                f"got {self.value_dim}"
            )
        self.dropout = keras.layers.Dropout(dropout, seed=seed, dtype="float32")
        self.supports_masking = True

    def _dense(self, equation, shape, bias_axes, name):
        def fresh(module, obj):  # each projection gets its own copy (seeds, state)
            return None if obj is None else module.get(module.serialize(obj))

        dense = keras.layers.EinsumDense(
            equation,
            output_shape=shape,
            bias_axes=bias_axes if self.use_bias else None,
            kernel_initializer=keras.initializers.get(
                keras.initializers.serialize(self.kernel_initializer)
            ),
            bias_initializer=keras.initializers.get(
                keras.initializers.serialize(self.bias_initializer)
            ),
            kernel_regularizer=fresh(keras.regularizers, self.kernel_regularizer),
            bias_regularizer=fresh(keras.regularizers, self.bias_regularizer),
            kernel_constraint=fresh(keras.constraints, self.kernel_constraint),
            bias_constraint=fresh(keras.constraints, self.bias_constraint),
            dtype=self.dtype_policy,
            name=name,
        )
        # The inputs' Keras masks were read by this layer; let them pass without a warning.
        dense.supports_masking = True
        return dense

    def build(self, query_shape, value_shape=None, key_shape=None) -> None:
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape is not None and len(shape) != 3:
                raise ValueError(f"{name} must have shape (b, i, D), got {tuple(shape)}")
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        h, kvh = self.num_heads, self.num_key_value_heads
        out = query_shape[-1] if self.output_dim is None else self.output_dim
        self.query_dense = self._dense("abc,cde->abde", (None, h, self.key_dim), "de", "query")
        self.key_dense = self._dense("abc,cde->abde", (None, kvh, self.key_dim), "de", "key")
        self.value_dense = self._dense("abc,cde->abde", (None, kvh, self.value_dim), "de", "value")
        self.output_dense = self._dense("abcd,cde->abe", (None, out), "e", "attention_output")
        self.query_dense.build(query_shape)
        self.key_dense.build(key_shape)
        self.value_dense.build(value_shape)
        self.output_dense.build((*query_shape[:-1], h, self.value_dim))
        self.position_scheme.build(query_shape)
        self.built = True

    def __call__(self, *args, **kwargs):
        """Decides self-attention on the arguments as given, before Keras converts or casts each
        of them into a new tensor (numpy inputs; float32 inputs under a ``mixed_*`` policy): a
        ``value`` that is the very object passed as ``query`` becomes None, and so does a
        ``key`` that is either, so ``attn(x, x)`` and ``attn(x, x, x)`` are ``attn(x)``."""
        args, kwargs = list(args), dict(kwargs)
        slots = {name: i for i, name in enumerate(("query", "value", "key"))}

        def get(name):
            i = slots[name]
            return args[i] if i < len(args) else kwargs.get(name)

        def clear(name):
            i = slots[name]
            if i < len(args):
                args[i] = None
            else:
                kwargs.pop(name, None)

        query, value, key = get("query"), get("value"), get("key")
        if query is not None and value is query:
            clear("value")
            if key is query:
                clear("key")
        elif value is None and key is query and query is not None:
            clear("key")
        return super().__call__(*args, **kwargs)

    def call(
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        positions=None,
        segment_ids=None,
        start_index=0,
        cache=None,
        cache_update_index=None,
        cache_mask=None,
        value_segment_ids=None,
        value_positions=None,
        mask=None,
    ):
        query_mask = mask if query_mask is None else query_mask  # `attn(x)`: Keras fills `mask`
        # `__call__` already turned `value` that was the query's object into None; `is` here
        # serves direct `call()` use.
        self_attention = value is None or value is query
        if value is None and key is not None and key is not query:
            raise ValueError(
                "key given without value: pass value= too (keys and values come from one "
                "sequence), or neither for self-attention"
            )
        _check_call_arguments(
            positions, start_index, segment_ids, self_attention, cache is not None
        )
        _check_value_positions(value_segment_ids, value_positions, segment_ids, self_attention)
        query, query_mask, lengths = dense_and_mask(query, query_mask)
        if len(query.shape) != 3:
            raise ValueError(f"query must have shape (b, i, D), got {tuple(query.shape)}")
        if not self_attention:
            value, value_mask, _ = dense_and_mask(value, value_mask)
            if key is not None:
                key, key_mask, _ = dense_and_mask(key, key_mask)
        value = query if value is None or self_attention else value
        key = value if key is None else key
        for name, t in (("value", value), ("key", key)):
            if len(t.shape) != 3:
                raise ValueError(f"{name} must have shape (b, j, D), got {tuple(t.shape)}")
        _check_batch("value", value, query.shape[0], "(b, j, D)")
        _check_batch("key", key, query.shape[0], "(b, j, D)")
        if key is not value and not _same_size(key.shape[1], value.shape[1]):
            raise ValueError(
                f"key must have shape (b, j, D) with value's j = {value.shape[1]}, got "
                f"{tuple(key.shape)}"
            )
        if cache is None:  # with a cache they are refused below
            if value_mask is not None:
                value_mask = check_mask(value_mask, query.shape[0], key.shape[1], "value_mask", "j")
            if key_mask is not None:
                key_mask = check_mask(key_mask, query.shape[0], key.shape[1], "key_mask", "j")
        b, n = ops.shape(query)[0], sequence_length(query)
        causal = self.causal or bool(use_causal_mask)
        scheme = self.position_scheme
        if scheme.contextual and not self_attention:
            raise ValueError(
                f"scheme {scheme.scheme_name!r} computes its positions from the layer's own "
                "tokens (self-attention only): call the layer without value= / key="
            )
        gates = None
        if isinstance(cache_mask, tuple | list) and all(m is None for m in cache_mask):
            cache_mask = None  # Keras fills `cache_mask` with the Keras masks of a pair cache
        if cache is not None:
            if value_mask is not None or key_mask is not None:
                raise ValueError(
                    "with a cache, cache_mask says which slots hold tokens; do not pass "
                    "value_mask or key_mask (attention_mask (b, i, S) masks pairs)"
                )
            cache, gates = self._split_cache(cache)
            self._check_cache(cache, query.shape[0])  # before projecting: a wrong cache fails fast
        if cache is not None:
            q_pos, k_pos, index = self._cache_positions(cache, cache_update_index, cache_mask, n, b)
            new_keys = q_pos  # self-attention: the new tokens are the keys written
        else:
            if cache_update_index is not None or cache_mask is not None:
                raise ValueError("cache_update_index and cache_mask need a cache")
            # segment_ids with query_mask (Keras fills it from an upstream mask_zero): both mark
            # padding, a token is real where both say so.
            q_pos = resolve_positions(
                n,
                batch=query.shape[0],
                mask=query_mask,
                segment_ids=segment_ids,
                positions=positions,
                start_index=start_index,
                axis="i",
            )
            if self_attention:
                k_pos = q_pos
            else:  # the value sequence's own positions, resolved as the query's
                k_pos = resolve_positions(
                    sequence_length(key),
                    batch=query.shape[0],
                    mask=value_mask if value_mask is not None else key_mask,
                    segment_ids=value_segment_ids,
                    positions=value_positions,
                    prefix="value_",
                    axis="j",
                )
            new_keys = k_pos
        # Padding tokens are dropped (zeros) before anything reads them, as the PyTorch layer
        # does: no NaN or inf there reaches a real token, nor a weight's gradient (a projection
        # weight's gradient sums every token's input times its output gradient; NaN·0 is NaN).
        same_value, same_key = value is query, key is value
        query = zero_padding(query, q_pos.valid)
        value = query if same_value else zero_padding(value, new_keys.valid)
        key = value if same_key else zero_padding(key, new_keys.valid)
        q = self.query_dense(query)
        k = self.key_dense(key)
        v = self.value_dense(value)
        if cache is not None:
            if gates is not None:  # per-token log gates beside the keys; c over every slot
                gates = _write_cache(gates, scheme.token_log_decay(query), index)
                decay = slot_log_decay(gates, ops.broadcast_to(k_pos.valid, ops.shape(gates)[:2]))
                new = _new_slots(index, n, b, ops.shape(gates)[1])
                q_decay = ops.take_along_axis(decay, ops.expand_dims(new, -1), axis=1)
                q_pos, k_pos = q_pos._replace(log_decay=q_decay), k_pos._replace(log_decay=decay)
            if not scheme.rotates_cached_keys:  # rotate the new keys once, then cache them
                q, k = scheme.rotate(q, k, q_pos, q_pos)
            k = _write_cache(cache[:, 0], k, index)
            v = _write_cache(cache[:, 1], v, index)
            cache = ops.stack([k, v], axis=1)
            if gates is not None:
                cache = (cache, gates)
            if scheme.rotates_cached_keys:  # the cache holds raw keys: rotate all of them
                q, k = scheme.rotate(q, k, q_pos, k_pos)
        else:
            if scheme.contextual:  # per-document sums of the gates of x's tokens (FoX)
                q_pos = with_log_decay(q_pos, scheme.token_log_decay(query))
                k_pos = q_pos  # self-attention only (checked above)
            q, k = self.position_scheme.rotate(q, k, q_pos, k_pos)
        allowed = allowed_pairs(q_pos, k_pos, causal=causal)
        if attention_mask is not None:
            want = (query.shape[0], query.shape[1], k.shape[1])
            got = tuple(attention_mask.shape)
            if len(got) != 3 or any(
                g is not None and w is not None and g != w for g, w in zip(got, want, strict=True)
            ):
                raise ValueError(f"attention_mask must have shape (b, i, j) = {want}, got {got}")
            allowed = ops.logical_and(allowed, ops.cast(attention_mask, "bool"))
        # Keys that value_mask or key_mask rules out are not attended (Keras ANDs both), also in
        # self-attention, where they keep the query's positions (a masked key is not padding).
        key_valid = k_pos.valid
        for kmask in (value_mask, key_mask):
            if kmask is not None:
                allowed = ops.logical_and(allowed, ops.expand_dims(kmask, 1))
                key_valid = ops.logical_and(key_valid, kmask)
        # Keys ruled out (masked keys, cache slots cache_mask leaves out) are zeroed too.
        q = zero_padding(q, q_pos.valid)
        k, v = zero_padding(k, key_valid), zero_padding(v, key_valid)
        groups = self.num_heads // self.num_key_value_heads
        y, scores = attend(
            q,
            repeat_kv_heads(k, groups),
            repeat_kv_heads(v, groups),
            self.position_scheme,
            q_pos,
            k_pos,
            allowed=allowed,
            dropout=self.dropout,
            training=training,
            return_scores=return_attention_scores,
        )
        y = self.output_dense(y)
        # A query that attends nowhere (padding, or every key masked) outputs exactly zero (not
        # the bias).
        attends = ops.any(allowed, axis=-1, keepdims=True)  # (b|1, i, 1)
        y = ops.where(attends, y, ops.zeros_like(y))
        outputs = (restore_ragged(y, lengths),)
        if return_attention_scores:
            outputs += (scores,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def empty_cache(self, batch_size: int, num_slots: int, dtype=None):
        """A zero cache of ``num_slots`` slots for this layer: keras-hub's ``(b, 2, S, h_kv, d)``
        keys and values in ``dtype`` (default: the layer's compute dtype); for a ``contextual``
        scheme (``forgetting``) the pair ``(that, log_gates)``, ``log_gates`` float32
        ``(b, S, h)``: each slot's ``log f`` per head, from which every call sums the cumulative
        log decays of the cached tokens."""
        dtype = self.compute_dtype if dtype is None else dtype
        shape = (batch_size, 2, num_slots, self.num_key_value_heads, self.key_dim)
        kv = ops.zeros(shape, dtype=dtype)
        if not self.position_scheme.contextual:
            return kv
        return kv, ops.zeros((batch_size, num_slots, self.num_heads), dtype="float32")

    def _split_cache(self, cache):
        """``(keys and values, log gates or None)``: a contextual scheme's cache is the pair of
        :meth:`empty_cache`, every other scheme's keras-hub's tensor."""
        contextual = self.position_scheme.contextual
        pair = isinstance(cache, (tuple, list))
        if contextual != pair:
            name = self.position_scheme.scheme_name
            want = "a pair (keys and values, log gates)" if contextual else "one tensor"
            raise ValueError(
                f"scheme {name!r} needs its cache as {want}, as empty_cache() builds it; got "
                f"{'a pair' if pair else 'one tensor'}"
            )
        if not pair:
            return cache, None
        kv, gates = cache
        if (
            len(gates.shape) != 3
            or gates.shape[2] != self.num_heads
            or (gates.shape[1] is not None and gates.shape[1] != kv.shape[2])
        ):
            raise ValueError(
                f"the log gates of the cache must have shape (b, S={kv.shape[2]}, "
                f"h={self.num_heads}), got {tuple(gates.shape)}"
            )
        return kv, gates

    def _check_cache(self, cache, batch) -> None:
        kvh = self.num_key_value_heads
        if (
            len(cache.shape) != 5
            or any(
                got is not None and got != want
                for got, want in zip(cache.shape[1:], (2, None, kvh, self.key_dim), strict=True)
                if want is not None
            )
            or not _same_size(cache.shape[0], batch)
        ):
            heads = f"h={kvh}" if kvh == self.num_heads else f"num_key_value_heads={kvh}"
            rows = "b" if batch is None else f"b={batch}"
            raise ValueError(
                f"cache must have shape ({rows}, 2, S, {heads}, d={self.key_dim}), "
                f"got {tuple(cache.shape)}"
            )
        if self.value_dim != self.key_dim:
            raise ValueError("a cache needs value_dim == key_dim")

    def _cache_positions(self, cache, index, cache_mask, n, b):
        if index is None:
            raise ValueError("a cache needs cache_update_index (the slot of the first new token)")
        slots = sequence_length(cache, 2)
        batch = cache.shape[0]
        index = _cache_index(index, n, slots, batch)
        slot = ops.expand_dims(ops.arange(slots, dtype="int32"), 0)
        if cache_mask is None:
            cache_mask = ops.broadcast_to(slot < index + n, (b, slots))
        else:
            cache_mask = ops.convert_to_tensor(cache_mask)
            if (
                len(cache_mask.shape) != 2
                or not _same_size(cache_mask.shape[1], cache.shape[2])
                or not _same_size(cache_mask.shape[0], batch)
            ):
                raise ValueError(
                    f"cache_mask must have shape (b, S) = ({batch}, {slots}), got "
                    f"{tuple(cache_mask.shape)}"
                )
        k_pos = positions_from_mask(cache_mask)
        new = _new_slots(index, n, b, slots)
        inside = _inside_cache(index, n, slots)
        q_pos = Positions(
            ops.take_along_axis(ops.broadcast_to(k_pos.pos, (b, slots)), new, axis=1),
            ops.where(
                inside,
                ops.take_along_axis(ops.broadcast_to(k_pos.seg, (b, slots)), new, axis=1),
                PAD_SEGMENT,
            ),
            compact=True,
        )
        return q_pos, k_pos, index

    def compute_mask(self, query, previous_mask=None):
        """The output keeps the query's Keras mask (padding queries output zeros)."""
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        """The output's shape alone; :meth:`compute_output_spec` adds the scores and cache."""
        out = query_shape[-1] if self.output_dim is None else self.output_dim
        return (*query_shape[:-1], out)

    def compute_output_spec(
        self, query, value=None, key=None, return_attention_scores=False, cache=None, **kwargs
    ):
        """What :meth:`call` returns, symbolically (a functional model): the output, then the
        float32 scores ``(b, h, i, j)`` if asked, then the cache as given, as
        ``keras.layers.MultiHeadAttention`` does for its scores."""
        spec = keras.KerasTensor(self.compute_output_shape(query.shape), dtype=self.compute_dtype)
        outputs = (spec,)
        if return_attention_scores:
            if cache is not None:
                kv = cache[0] if isinstance(cache, tuple | list) else cache
                keys = kv.shape[2]
            else:
                keys = (query if value is None else value if key is None else key).shape[1]
            shape = (query.shape[0], self.num_heads, query.shape[1], keys)
            outputs += (keras.KerasTensor(shape, dtype="float32"),)
        if cache is not None:
            spec = lambda t: keras.KerasTensor(t.shape, t.dtype)  # noqa: E731
            pair = isinstance(cache, tuple | list)  # forgetting's (kv, log gates)
            outputs += (tuple(spec(t) for t in cache) if pair else spec(cache),)
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            dropout=self.dropout_rate,
            use_bias=self.use_bias,
            output_shape=self.output_dim,
            scheme=self.scheme_spec,
            causal=self.causal,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            num_key_value_heads=self.num_key_value_heads,
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
            bias_regularizer=keras.regularizers.serialize(self.bias_regularizer),
            kernel_constraint=keras.constraints.serialize(self.kernel_constraint),
            bias_constraint=keras.constraints.serialize(self.bias_constraint),
            seed=self.seed,
        )
        return config
