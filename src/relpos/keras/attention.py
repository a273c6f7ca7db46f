"""``RelativeMultiHeadAttention``: ``keras.layers.MultiHeadAttention`` with a positional scheme,
per-row positions and a decoding cache."""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from .positions import (
    Positions,
    allowed_pairs,
    dense_and_mask,
    positions_from_mask,
    resolve_positions,
    restore_ragged,
    sequence_length,
    slot_log_decay,
    with_log_decay,
)
from .schemes import make_attention_scheme, scheme_config

__all__ = ["RelativeMultiHeadAttention", "attend", "repeat_kv_heads"]


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
    # A row with no allowed key attends everywhere (finite, then zeroed by the caller's mask).
    has_key = ops.any(allowed, axis=-1, keepdims=True)
    safe = ops.expand_dims(ops.logical_or(allowed, ops.logical_not(has_key)), 1)  # (b|1,1,i,j)
    use_dropout = dropout is not None and dropout.rate > 0 and bool(training)
    if not scheme.adds_terms and not return_scores and not use_dropout:
        scale = 1.0 / math.sqrt(q.shape[-1])
        mask = ops.broadcast_to(safe, (ops.shape(q)[0], 1, ops.shape(q)[1], ops.shape(k)[1]))
        return ops.dot_product_attention(q, k, v, mask=mask, scale=scale), None
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


def repeat_kv_heads(x, groups: int):
    """Grouped-query attention: each of the ``h_kv`` key/value heads of ``x (b, j, h_kv, d)``
    repeated ``groups`` times in place, ``(b, j, h_kv·groups, d)``, so query head ``i`` reads
    key/value head ``i // groups`` (PyTorch's ``repeat_interleave``)."""
    return x if groups == 1 else ops.repeat(x, groups, axis=2)


@keras.saving.register_keras_serializable(package="relpos")
class RelativeMultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with any relpos attention scheme; a drop-in for
    ``keras.layers.MultiHeadAttention``.

    Positions come from each token's place in its own sequence: the Keras mask (or
    ``query_mask``), ``segment_ids`` of packed rows, ``positions``, or ``start_index`` (an int or
    one offset per row). Padding queries output zeros; tokens of different segments never attend
    to each other.

    Args:
        num_heads: query heads ``h``.
        key_dim: size of each query/key head ``d``.
        value_dim: size of each value head (default ``key_dim``; must equal it for a scheme with a
            value term, and with a cache).
        dropout: dropout on the attention probabilities in training.
        use_bias: biases in the projections.
        output_shape: output width (default: the query's).
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

    Call arguments:
        query: ``(b, i, D)``. value: ``(b, j, D)``, or None (or ``query`` itself) for
            self-attention, where keys share the query's positions. key: default ``value``.
        query_mask, value_mask: ``(b, i)``/``(b, j)`` True for tokens (filled from Keras masks;
            ``mask`` is the query's when the layer is called on one tensor, ``attn(x)``).
        attention_mask: ``(b, i, j)`` bool, pairs that may attend (combined with the positions').
        use_causal_mask: mask future keys (by position, not index).
        return_attention_scores: also return the probabilities ``(b, h, i, j)``.
        positions: ``(i,)`` or ``(b, i)`` integer positions. segment_ids: ``(b, i)`` int, -1 for
            padding. start_index: int or ``(b,)`` offset of the first token.
        cache: ``(b, 2, S, h_kv, d)`` keys and values of ``S`` slots (keras-hub's layout). Keys
            are stored rotated, except for a scheme that ``rotates_cached_keys`` (RoPE with a
            ``dynamic`` or ``longrope`` scaling): it stores raw keys and rotates every cached key
            at each call with the length its sequence has now, so decoding step ``t`` equals the
            forward over the row's first ``t`` tokens.
            A ``contextual`` scheme (``forgetting``) takes the pair ``(that, log_gates)``,
            ``log_gates`` float32 ``(b, S, h)``: each slot's log forget gate per head, written
            with its key (:meth:`empty_cache` builds either kind).
        cache_update_index: slot of the first new token, an int or one per row ``(b,)``.
        cache_mask: ``(b, S)`` True for slots holding tokens after this write (default: slots
            before ``cache_update_index + i``). Slot positions are counted from it per row, so a
            left-padded prompt continues at its own positions. With a cache, ``query_mask`` is
            not read: ``cache_mask`` says which of the new tokens are real.

    Returns:
        ``(b, i, output_shape)``; then the scores if asked, then the updated cache if given.
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
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        num_key_value_heads = num_heads if num_key_value_heads is None else num_key_value_heads
        for name, value in (
            ("num_heads", num_heads),
            ("key_dim", key_dim),
            ("num_key_value_heads", num_key_value_heads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_key_value_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_key_value_heads})"
            )
        self.num_key_value_heads = num_key_value_heads
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_heads, self.key_dim = num_heads, key_dim
        self.value_dim = key_dim if value_dim is None else value_dim
        self.dropout_rate, self.use_bias, self.causal = dropout, use_bias, bool(causal)
        self.output_dim = output_shape
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
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
        self.dropout = keras.layers.Dropout(dropout, dtype="float32")
        self.supports_masking = True

    def _dense(self, equation, shape, bias_axes, name):
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
        mask=None,
    ):
        query_mask = mask if query_mask is None else query_mask  # `attn(x)`: Keras fills `mask`
        self_attention = value is None or value is query
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
            cache, gates = self._split_cache(cache)
            self._check_cache(cache)  # before projecting: a wrong cache fails fast
        q = self.query_dense(query)
        k = self.key_dense(key)
        v = self.value_dense(value)
        if cache is not None:
            if positions is not None or segment_ids is not None:
                raise ValueError(
                    "with a cache, positions come from cache_mask; "
                    "do not pass positions or segment_ids"
                )
            q_pos, k_pos, index = self._cache_positions(cache, cache_update_index, cache_mask, n, b)
            if gates is not None:  # per-token log gates beside the keys; c over every slot
                gates = _write_cache(gates, scheme.token_log_decay(query), index)
                decay = slot_log_decay(gates, ops.broadcast_to(k_pos.valid, ops.shape(gates)[:2]))
                new = ops.broadcast_to(index + ops.arange(n, dtype="int32"), (b, n))
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
            if cache_update_index is not None or cache_mask is not None:
                raise ValueError("cache_update_index and cache_mask need a cache")
            q_pos = resolve_positions(
                n,
                batch=query.shape[0],
                mask=query_mask,
                segment_ids=segment_ids,
                positions=positions,
                start_index=start_index,
            )
            if scheme.contextual:  # per-document sums of the gates of x's tokens (FoX)
                q_pos = with_log_decay(q_pos, scheme.token_log_decay(query))
            if self_attention:
                k_pos = q_pos
            else:
                kmask = value_mask if value_mask is not None else key_mask
                k_pos = resolve_positions(sequence_length(key), batch=key.shape[0], mask=kmask)
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
        # Padding queries attend nowhere: their output is exactly zero (not the bias).
        y = ops.where(ops.expand_dims(q_pos.valid, -1), y, ops.zeros_like(y))
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

    def _check_cache(self, cache) -> None:
        kvh = self.num_key_value_heads
        if len(cache.shape) != 5 or any(
            got is not None and got != want
            for got, want in zip(cache.shape[1:], (2, None, kvh, self.key_dim), strict=True)
            if want is not None
        ):
            heads = f"h={kvh}" if kvh == self.num_heads else f"num_key_value_heads={kvh}"
            raise ValueError(
                f"cache must have shape (b, 2, S, {heads}, d={self.key_dim}), "
                f"got {tuple(cache.shape)}"
            )
        if self.value_dim != self.key_dim:
            raise ValueError("a cache needs value_dim == key_dim")

    def _cache_positions(self, cache, index, cache_mask, n, b):
        if index is None:
            raise ValueError("a cache needs cache_update_index (the slot of the first new token)")
        slots = cache.shape[2]
        index = ops.reshape(ops.cast(ops.convert_to_tensor(index), "int32"), (-1, 1))
        slot = ops.expand_dims(ops.arange(slots, dtype="int32"), 0)
        if cache_mask is None:
            cache_mask = ops.broadcast_to(slot < index + n, (b, slots))
        else:
            cache_mask = ops.convert_to_tensor(cache_mask)
            if len(cache_mask.shape) != 2 or cache_mask.shape[1] != slots:
                raise ValueError(
                    f"cache_mask must have shape (b, S={slots}), got {tuple(cache_mask.shape)}"
                )
        k_pos = positions_from_mask(cache_mask)
        new = ops.broadcast_to(index + ops.expand_dims(ops.arange(n, dtype="int32"), 0), (b, n))
        q_pos = Positions(
            ops.take_along_axis(ops.broadcast_to(k_pos.pos, (b, slots)), new, axis=1),
            ops.take_along_axis(ops.broadcast_to(k_pos.seg, (b, slots)), new, axis=1),
        )
        return q_pos, k_pos, index

    def compute_mask(self, query, previous_mask=None):
        """The output keeps the query's Keras mask (padding queries output zeros)."""
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        out = query_shape[-1] if self.output_dim is None else self.output_dim
        return (*query_shape[:-1], out)

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
        )
        return config
