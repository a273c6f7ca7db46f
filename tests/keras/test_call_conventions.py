"""How ``RelativeMultiHeadAttention`` and the position layers read their call arguments: the
self-attention rule, packed ``segment_ids`` beside a Keras mask, ``value_mask`` and ``key_mask``
as keras MHA reads them, symbolic outputs, keras MHA's constructor arguments, and what a traced
call does with positions it cannot check."""

import keras
import numpy as np
import pytest
from keras import ops

import relpos.keras as rk

from .util import BACKEND, kt, np_, traced

X = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
SEG = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, -1]], "int32")


def test_self_attention_is_decided_before_keras_converts_the_arguments():
    """``attn(x, x)`` is self-attention however Keras converts each argument (numpy inputs,
    float32 under mixed_bfloat16): keys keep segment_ids and start_index, and forgetting runs."""
    xt, st = kt(X), kt(SEG)
    attn = rk.RelativeMultiHeadAttention(2, 4, scheme="alibi")
    want = np_(attn(xt, segment_ids=st))
    np.testing.assert_allclose(np_(attn(X, X, segment_ids=SEG)), want, atol=1e-6)
    np.testing.assert_allclose(np_(attn(X, X, X, start_index=5)), np_(attn(xt, start_index=5)))
    keras.config.set_dtype_policy("mixed_bfloat16")
    attn = rk.RelativeMultiHeadAttention(2, 4, scheme="alibi")
    want = np_(ops.cast(attn(xt, segment_ids=st), "float32"))
    got = np_(ops.cast(attn(xt, xt, segment_ids=st), "float32"))
    np.testing.assert_array_equal(got, want)
    x_in, s_in = keras.Input((None, 8)), keras.Input((None,), dtype="int32")
    model = keras.Model([x_in, s_in], attn(x_in, x_in, segment_ids=s_in))
    got = np.asarray(model.predict([X, SEG], verbose=0), "float32")
    np.testing.assert_allclose(got, want, atol=2e-2)
    forgetting = rk.RelativeMultiHeadAttention(2, 4, scheme="forgetting", causal=True)
    assert tuple(forgetting(xt, xt).shape) == X.shape


def test_segment_ids_meet_the_keras_mask_of_a_mask_zero_embedding():
    """Keras passes an upstream mask_zero mask as query_mask: with segment_ids a token is real
    where both say so (token 0 of row 0 is masked though its segment id says document 0)."""
    tokens = np.array([[0, 4, 5, 6, 7, 8], [3, 4, 5, 6, 0, 0]], "int32")
    seg = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, -1, -1]], "int32")
    embed = keras.layers.Embedding(10, 8, mask_zero=True)
    attn = rk.RelativeMultiHeadAttention(2, 4, causal=True, scheme="alibi")
    t_in, s_in = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="int32")
    model = keras.Model([t_in, s_in], attn(embed(t_in), segment_ids=s_in))
    got = model.predict([tokens, seg], verbose=0)
    plain = kt(np_(embed(kt(tokens))))  # the same features with no Keras mask
    want = attn(plain, segment_ids=kt(np.where(tokens != 0, seg, -1)))
    np.testing.assert_allclose(got, np_(want), atol=1e-6)
    assert not np_(want)[0, 0].any()


#: Keys masked by value_mask and key_mask: together they leave row 1's key 0 masked, so with a
#: causal mask its first query has no key at all.
VALUE_MASK = np.array([[1, 0, 1, 1, 0, 1], [0, 1, 0, 1, 1, 1]], bool)
KEY_MASK = np.array([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 1]], bool)


def _keras_mha_twin(layer):
    """A ``keras.layers.MultiHeadAttention`` with the built ``layer``'s projections."""
    ref = keras.layers.MultiHeadAttention(layer.num_heads, layer.key_dim)
    ref(kt(X), kt(X))
    pairs = (
        (layer.query_dense, ref._query_dense),
        (layer.key_dense, ref._key_dense),
        (layer.value_dense, ref._value_dense),
        (layer.output_dense, ref._output_dense),
    )
    for mine, theirs in pairs:
        theirs.set_weights(mine.get_weights())
    return ref


@pytest.mark.parametrize("form", ["self", "self-pair", "cross"])
@pytest.mark.parametrize("masks", ["value", "key", "both"])
def test_value_and_key_masks_mask_keys_as_keras_mha(form, masks):
    """``value_mask`` and ``key_mask`` mask keys as in keras MHA (which ANDs them), in
    self-attention (``attn(x)``, ``attn(x, x)``) as in cross-attention (there with both given too:
    ``key_mask`` was dropped beside ``value_mask``); in self-attention with the causal mask as
    well. Scheme ``nope`` (no positions), fused and through the scores; a query left with no key
    outputs zeros (keras MHA's spreads over every key instead)."""
    kw = {}
    if masks in ("value", "both"):
        kw["value_mask"] = kt(VALUE_MASK)
    if masks in ("key", "both"):
        kw["key_mask"] = kt(KEY_MASK)
    keep = np.ones((2, 1, 6), bool)
    keep &= VALUE_MASK[:, None] if "value_mask" in kw else True
    keep &= KEY_MASK[:, None] if "key_mask" in kw else True
    layer = rk.RelativeMultiHeadAttention(2, 4, scheme="nope", bias_initializer="ones")
    xt = kt(X)
    context = kt(X[:, ::-1] * 0.5)
    layer(xt, context)
    ref = _keras_mha_twin(layer)
    for causal in (False, True) if form != "cross" else (False,):
        allowed = keep & (np.tril(np.ones((6, 6), bool)) if causal else True)
        allowed = np.broadcast_to(allowed, (2, 6, 6))
        attends = allowed.any(-1)
        ckw = {**kw, "use_causal_mask": causal}
        for scores in (False, True):
            if form == "cross":
                got = layer(xt, context, return_attention_scores=scores, **ckw)
                want = ref(xt, context, return_attention_scores=scores, **ckw)
            else:
                args = (xt,) if form == "self" else (xt, xt)
                got = layer(*args, return_attention_scores=scores, **ckw)
                want = ref(xt, xt, return_attention_scores=scores, **ckw)
            got, want = (got, want) if scores else ((got,), (want,))
            np.testing.assert_allclose(np_(got[0])[attends], np_(want[0])[attends], atol=1e-5)
            assert not np_(got[0])[~attends].any()
            if scores:
                g, w = np_(got[1]).transpose(0, 2, 1, 3), np_(want[1]).transpose(0, 2, 1, 3)
                np.testing.assert_allclose(g[attends], w[attends], atol=1e-6)
                assert not g[~attends].any()


@pytest.mark.parametrize(
    ("scheme", "causal"),
    [
        ("rope", False),
        ("alibi", True),
        ({"name": "t5", "num_buckets": 8, "max_distance": 6}, False),
        ("forgetting", True),
    ],
    ids=["rope", "alibi-causal", "t5", "forgetting-causal"],
)
def test_value_mask_in_self_attention_masks_keys_at_their_positions(scheme, causal):
    """In self-attention ``value_mask`` (and ``key_mask``) only mask keys: every token keeps the
    position the query side gives it (here beside ``segment_ids``), as the same pairs masked by
    ``attention_mask`` give. (It was ignored: the layer attended to the masked keys.)"""
    layer = rk.RelativeMultiHeadAttention(2, 4, scheme=scheme, causal=causal)
    xt, st = kt(X), kt(SEG)
    pairs = np.broadcast_to((VALUE_MASK & KEY_MASK)[:, None], (2, 6, 6))
    want = np_(layer(xt, segment_ids=st, attention_mask=kt(pairs)))
    got = layer(xt, segment_ids=st, value_mask=kt(VALUE_MASK), key_mask=kt(KEY_MASK))
    np.testing.assert_allclose(np_(got), want, atol=1e-6)
    unmasked = np_(layer(xt, segment_ids=st))
    assert not np.allclose(want, unmasked, atol=1e-3)


def test_a_query_with_no_key_outputs_zeros():
    """A real query whose keys are all masked (value_mask in cross- or self-attention, or
    attention_mask) outputs exactly zero, not the output projection's bias nor, on the fused
    path of ``nope``/``rope``, an average over every key."""
    none_in_row_0 = np.array([[0] * 6, [1] * 6], bool)
    pairs = np.ones((2, 6, 6), bool)
    pairs[:, 2] = False
    for scheme in ("nope", "rope", "alibi"):
        layer = rk.RelativeMultiHeadAttention(2, 4, scheme=scheme, bias_initializer="ones")
        xt = kt(X)
        for got, empty in (
            (layer(xt, kt(X * 2.0), value_mask=kt(none_in_row_0)), (slice(0, 1), slice(None))),
            (layer(xt, value_mask=kt(none_in_row_0)), (slice(0, 1), slice(None))),
            (layer(xt, attention_mask=kt(pairs)), (slice(None), slice(2, 3))),
        ):
            out = np_(got)
            assert np.isfinite(out).all()
            assert not out[empty].any(), scheme
            full = np.ones(out.shape[:2], bool)
            full[empty] = False
            assert np.abs(out[full]).sum(axis=-1).all()


#: Every position layer with ``segment_ids``: (factory, input).
SEGMENT_LAYERS = {
    "PositionEmbedding": (lambda: rk.PositionEmbedding(6), X),
    "SinePositionEncoding": (lambda: rk.SinePositionEncoding(), X),
    "RotaryEmbedding": (lambda: rk.RotaryEmbedding(), X.reshape(2, 6, 2, 4)),
    "RelativePositionEmbedding": (lambda: rk.RelativePositionEmbedding(2, 4), X),
    "AlibiBias": (lambda: rk.AlibiBias(num_heads=2), X),
    "T5RelativeBias": (lambda: rk.T5RelativeBias(2, 8, 6), X),
}


@pytest.mark.parametrize("name", sorted(SEGMENT_LAYERS))
def test_segment_ids_with_an_explicit_mask_combine(name):
    """``segment_ids`` and ``mask=`` together: a token is real only where both say so, as
    ``RelativeMultiHeadAttention`` reads them (token 1 of row 0 is masked inside document 0)."""
    make, x = SEGMENT_LAYERS[name]
    layer, x = make(), kt(x)
    mask = np.ones((2, 6), bool)
    mask[0, 1] = mask[1, 0] = False
    want = np_(layer(x, segment_ids=kt(np.where(mask, SEG, -1))))
    np.testing.assert_allclose(np_(layer(x, segment_ids=kt(SEG), mask=kt(mask))), want, atol=1e-6)
    assert not np.allclose(np_(layer(x, segment_ids=kt(SEG))), want)  # the mask is read


def test_token_and_position_embedding_segments_meet_mask_zero():
    """With ``mask_zero`` the token mask and ``segment_ids`` combine: padding inside a document
    takes no position."""
    tokens = np.array([[4, 0, 5, 6, 7, 8], [3, 4, 5, 6, 0, 0]], "int32")
    layer = rk.TokenAndPositionEmbedding(10, 6, 4, mask_zero=True)
    want = layer(kt(tokens), segment_ids=kt(np.where(tokens != 0, SEG, -1)))
    np.testing.assert_allclose(np_(layer(kt(tokens), segment_ids=kt(SEG))), np_(want), atol=1e-6)


def test_functional_model_returns_scores_and_cache_as_keras_mha():
    q = keras.Input((5, 8))
    out, scores = rk.RelativeMultiHeadAttention(2, 4)(q, q, return_attention_scores=True)
    ref = keras.layers.MultiHeadAttention(2, 4)(q, q, return_attention_scores=True)
    assert [tuple(t.shape) for t in (out, scores)] == [tuple(t.shape) for t in ref]
    layer = rk.RelativeMultiHeadAttention(2, 4, causal=True)
    c_in = keras.Input((2, 7, 2, 4))
    out, scores, cache = layer(q, cache=c_in, cache_update_index=1, return_attention_scores=True)
    assert (tuple(scores.shape), tuple(cache.shape)) == ((None, 2, 5, 7), (None, 2, 7, 2, 4))
    model = keras.Model([q, c_in], [out, scores, cache])
    x, c = X[:, :5], np.zeros((2, 2, 7, 2, 4), "float32")
    want = layer(kt(x), cache=kt(c), cache_update_index=1, return_attention_scores=True)
    for g, w in zip(model.predict([x, c], verbose=0), want, strict=True):
        np.testing.assert_allclose(g, np_(w), atol=1e-6)


def test_keras_mha_constructor_arguments():
    layer = rk.RelativeMultiHeadAttention(
        2,
        4,
        output_shape=(6,),
        kernel_regularizer="l2",
        bias_regularizer="l1",
        kernel_constraint="non_neg",
        bias_constraint="unit_norm",
        seed=3,
    )
    assert tuple(layer(kt(X)).shape) == (2, 6, 6)
    dense = (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense)
    assert len(layer.losses) == 8  # a kernel and a bias regulariser per projection
    assert all(isinstance(d.kernel_constraint, keras.constraints.NonNeg) for d in dense)
    assert all(isinstance(d.bias_constraint, keras.constraints.UnitNorm) for d in dense)
    assert layer.dropout.seed == 3
    clone = rk.RelativeMultiHeadAttention.from_config(layer.get_config())
    assert (clone.output_dim, clone.seed) == (6, 3)
    assert isinstance(clone.kernel_regularizer, keras.regularizers.L2)


@pytest.mark.skipif(BACKEND == "torch", reason="the torch backend runs eagerly: always checked")
def test_traced_positions_past_the_table_are_clamped():
    """Under jit a traced start_index or positions cannot be checked: they read the table's last
    row instead of gathering out of range (NaN on JAX)."""
    pe = rk.PositionEmbedding(6)
    x = kt(np.zeros((2, 5, 3), "float32"))
    pe(x)
    table = np_(pe.position_embeddings)
    want = table[np.minimum(np.arange(4, 9), 5)]
    got = np_(traced(lambda s: pe(x, start_index=s))(kt(np.array([4, 4], "int32"))))
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
    got = np_(traced(lambda p: pe(x, positions=p))(kt(np.arange(4, 9, dtype="int32"))))
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


@pytest.mark.skipif(BACKEND == "torch", reason="the torch backend runs eagerly: always checked")
def test_traced_cache_write_past_the_end_drops_the_tokens_that_do_not_fit():
    """Under jit a traced cache_update_index cannot be checked: of 5 tokens written at slot 2 of
    4, the 2 that fit are written and output as eagerly; the others output zeros, as padding
    (not the output bias of a query with no key)."""
    layer = rk.RelativeMultiHeadAttention(
        2, 4, causal=True, scheme="alibi", bias_initializer="ones"
    )
    x = kt(X[:1, :5])
    cache = layer.empty_cache(1, 4)
    want, want_cache = layer(x[:, :2], cache=cache, cache_update_index=2)
    got, got_cache = traced(lambda i: layer(x, cache=cache, cache_update_index=i))(kt(2))
    np.testing.assert_allclose(np_(got)[:, :2], np_(want), atol=1e-6)
    assert not np_(got)[:, 2:].any()
    np.testing.assert_allclose(np_(got_cache), np_(want_cache), atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="XLA training through tf.function")
def test_xla_training_of_a_distance_bias_at_a_second_sequence_length():
    """A second batch length relaxes tf.function's length to None: the distance window must not
    sit in a keras.ops.cond, whose gradient XLA cannot compile then."""
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(10, 8, mask_zero=True)(tokens)
    x = rk.RelativeMultiHeadAttention(2, 4, scheme="kerple", causal=True)(x)
    model = keras.Model(tokens, keras.layers.Dense(10)(x))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="sgd", loss=loss, jit_compile=True)
    for n in (4, 6):
        t = np.arange(1, 2 * n + 1, dtype="int32").reshape(2, n) % 10
        t[1, :2] = 0
        assert np.isfinite(model.fit(t, t, batch_size=2, verbose=0).history["loss"][0])


def test_positions_beside_start_index_is_decided_on_the_arguments_given():
    """``positions`` with a ``start_index`` is refused (the offset used to be ignored) on which
    arguments are given, never on their values, so eagerly and traced alike: the default int 0
    passes (explicitly too), a tensor start_index is refused even holding 0 (as is a numpy
    scalar, which Keras turns into one), and under jit the check needs no value (a traced
    start_index is refused while tracing)."""
    layer = rk.RelativeMultiHeadAttention(2, 4, scheme="alibi")
    xt, pos = kt(X), kt(np.array([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]], "int32"))
    want = np_(layer(xt, positions=pos))
    np.testing.assert_array_equal(np_(layer(xt, positions=pos, start_index=0)), want)
    with pytest.raises(ValueError, match="pass at most one of positions and start_index"):
        layer(xt, positions=pos, start_index=kt(np.zeros(2, "int32")))
    if traced(lambda: None) is None:
        return  # the torch backend runs eagerly
    np.testing.assert_allclose(np_(traced(lambda p: layer(xt, positions=p))(pos)), want, atol=1e-6)
    run = traced(lambda p, s: layer(xt, positions=p, start_index=s))
    with pytest.raises(ValueError, match="pass at most one of positions and start_index"):
        run(pos, kt(np.zeros(2, "int32")))


@pytest.mark.skipif(BACKEND == "torch", reason="the torch backend runs eagerly: always checked")
def test_traced_segment_ids_below_minus_one_are_one_more_document():
    """Under jit traced segment ids cannot be checked (eagerly an id below -1 is a ValueError):
    such an id is then a document like any other, its tokens attending to each other at their
    positions in it, as if it were a fresh id >= 0."""
    layer = rk.RelativeMultiHeadAttention(2, 4, scheme="alibi", causal=True)
    seg = np.array([[0, 0, -3, -3, -3, 1], [-3, -3, 1, 1, -1, -1]], "int32")
    want = np_(layer(kt(X), segment_ids=kt(np.where(seg == -3, 7, seg))))
    got = np_(traced(lambda s: layer(kt(X), segment_ids=s))(kt(seg)))
    np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"segment_ids must be >= 0, or -1 for padding"):
        layer(kt(X), segment_ids=kt(seg))
