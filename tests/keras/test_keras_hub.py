"""keras-hub as a test-only reference: on unpadded input with the same weights, our layers give
keras-hub's numbers (so code switches by the import)."""

import keras
import numpy as np
import pytest
from keras import ops

import relpos.keras as rk

from .util import kt, np_

hub = pytest.importorskip("keras_hub")
#: keras-hub's tensorflow-text pulls TensorFlow, which a JAX user's install lacks: the JAX suite
#: runs these in the main environment (tests/run_suites.py).
pytestmark = pytest.mark.keras_hub_reference


def test_position_embedding_equals_keras_hub():
    x = kt(np.random.default_rng(0).normal(size=(2, 7, 6)).astype("float32"))
    ours, theirs = rk.PositionEmbedding(10), hub.layers.PositionEmbedding(10)
    ours.build(x.shape)
    theirs.build(x.shape)
    ours.position_embeddings.assign(theirs.position_embeddings)
    for kw in ({}, {"start_index": 3}, {"positions": kt(np.array([[0, 2, 4, 1, 3, 5, 6]] * 2))}):
        np.testing.assert_allclose(np_(ours(x, **kw)), np_(theirs(x, **kw)), atol=1e-6)


def test_sine_position_encoding_equals_keras_hub():
    x = kt(np.zeros((2, 9, 12), "float32"))
    for kw in ({}, {"start_index": 5}):
        want = np_(hub.layers.SinePositionEncoding(1000)(x, **kw))
        np.testing.assert_allclose(np_(rk.SinePositionEncoding(1000)(x, **kw)), want, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"start_index": 4}, {"scaling_factor": 2.0}])
def test_rotary_embedding_equals_keras_hub(kw):
    x = kt(np.random.default_rng(1).normal(size=(2, 8, 3, 16)).astype("float32"))
    ctor = {k: v for k, v in kw.items() if k == "scaling_factor"}
    call = {k: v for k, v in kw.items() if k == "start_index"}
    want = np_(hub.layers.RotaryEmbedding(500, **ctor)(x, **call))
    np.testing.assert_allclose(np_(rk.RotaryEmbedding(500, **ctor)(x, **call)), want, atol=1e-5)


HUB_ROPE_CONFIGS = {
    "defaults": {},
    "linear": {"max_wavelength": 500, "scaling_factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "scaling_factor": 3.0, "sequence_axis": 2},
    "denominator": {"scaling_factor": 2.0, "denominator_dim": 32},  # Gemma 4's partial ladder
    # L = 64 puts YaRN's ramp inside the 8 pairs (dims 0..3 with truncate, 0..2.02 without)
    "yarn": {"rope_type": "yarn", "scaling_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-untruncated": {
        "rope_type": "yarn",
        "scaling_factor": 4.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "original_max_position_embeddings": 64,
        "truncate": False,
    },
}


@pytest.mark.parametrize("name", sorted(HUB_ROPE_CONFIGS))
def test_rotary_embedding_loads_keras_hub_configs(name):
    """A keras-hub layer's config (every argument of its signature) loads, and gives its numbers."""
    theirs = hub.layers.RotaryEmbedding(**HUB_ROPE_CONFIGS[name])
    config = theirs.get_config()
    ours = rk.RotaryEmbedding.from_config(config)
    assert {k: v for k, v in ours.get_config().items() if k in config} == config
    x = np.random.default_rng(4).normal(size=(2, 8, 3, 16)).astype("float32")
    if theirs.sequence_axis == 2:
        x = x.transpose(0, 2, 1, 3)
    x = kt(x)
    for call in ({}, {"start_index": 5}, {"positions": kt(np.array([0, 3, 9, 1, 40, 7, 2, 60]))}):
        want = np_(theirs(x, **call))
        np.testing.assert_allclose(np_(ours(x, **call)), want, atol=1e-5)
    if name != "defaults":  # the scaling is read: unscaled RoPE gives other numbers
        assert not np.allclose(np_(rk.RotaryEmbedding(theirs.max_wavelength)(x)), want, atol=1e-3)


def test_token_and_position_embedding_equals_keras_hub():
    tokens = kt(np.random.default_rng(2).integers(0, 20, size=(2, 6)))
    ours = rk.TokenAndPositionEmbedding(20, 8, 4)
    theirs = hub.layers.TokenAndPositionEmbedding(20, 8, 4)
    ours.build(tokens.shape)
    theirs.build(tokens.shape)
    ours.token_embedding.embeddings.assign(theirs.token_embedding.embeddings)
    ours.position_embedding.position_embeddings.assign(
        theirs.position_embedding.position_embeddings
    )
    np.testing.assert_allclose(np_(ours(tokens)), np_(theirs(tokens)), atol=1e-6)
    h = kt(np.random.default_rng(3).normal(size=(2, 6, 4)).astype("float32"))
    np.testing.assert_allclose(
        np_(ours.token_embedding(h, reverse=True)),
        np_(theirs.token_embedding(h, reverse=True)),
        atol=1e-5,
    )


def test_keras_hub_shifts_a_left_padded_row_and_we_do_not():
    """The reason relpos exists: keras-hub embeds a left-padded row at shifted positions."""
    tokens = np.array([[0, 0, 5, 6, 7]])
    ours = rk.TokenAndPositionEmbedding(10, 8, 4, mask_zero=True)
    ours.build((None, 5))
    alone = np_(ours(kt(tokens[:, 2:])))
    np.testing.assert_allclose(np_(ours(kt(tokens)))[:, 2:], alone, atol=1e-6)
    theirs = hub.layers.TokenAndPositionEmbedding(10, 8, 4, mask_zero=True)
    theirs.build((None, 5))
    assert not np.allclose(np_(theirs(kt(tokens)))[:, 2:], np_(theirs(kt(tokens[:, 2:]))))


def _copy_table(ours, theirs, shape):
    ours.build(shape)
    theirs.build(shape)
    ours.position_embeddings.assign(theirs.position_embeddings)


def test_position_layers_take_keras_hubs_rank_4_inputs():
    """``(b, a, n, d)``: the sequence is the axis before the features, as in keras-hub; every
    ``a`` shares its row's positions, a Keras-style mask ``(b, n)`` included."""
    x = kt(np.random.default_rng(5).normal(size=(2, 3, 5, 6)).astype("float32"))
    ours, theirs = rk.PositionEmbedding(8), hub.layers.PositionEmbedding(8)
    _copy_table(ours, theirs, x.shape)
    for kw in ({}, {"start_index": 2}, {"positions": kt(np.array([4, 3, 2, 1, 0]))}):
        np.testing.assert_allclose(np_(ours(x, **kw)), np_(theirs(x, **kw)), atol=1e-6)
    sine, hub_sine = rk.SinePositionEncoding(), hub.layers.SinePositionEncoding()
    np.testing.assert_allclose(np_(sine(x, start_index=3)), np_(hub_sine(x, start_index=3)), 1e-5)
    mask = kt(np.array([[True] * 5, [False, False, True, True, True]]))
    for layer in (ours, sine):
        got = np_(layer(x, mask=mask))
        np.testing.assert_allclose(got[1, :, 2:], np_(layer(x[:1, :, :3]))[0], atol=1e-6)


def test_rotary_embedding_takes_float_positions_as_keras_hub():
    """keras-hub rotates a float position by its own angle; an integral one is the int's."""
    x = kt(np.random.default_rng(6).normal(size=(2, 4, 2, 8)).astype("float32"))
    ours, theirs = rk.RotaryEmbedding(100), hub.layers.RotaryEmbedding(100)
    for pos in (np.array([0.0, 0.5, 2.25, 7.0]), np.array([[0.0, 1, 2, 3], [1.5, 0, 3, 9]])):
        got = np_(ours(x, positions=kt(pos.astype("float32"))))
        np.testing.assert_allclose(got, np_(theirs(x, positions=kt(pos))), atol=1e-5)
    whole = np.array([[3, 1, 4, 1], [5, 9, 2, 6]])
    np.testing.assert_allclose(
        np_(ours(x, positions=kt(whole.astype("float32")))),
        np_(ours(x, positions=kt(whole.astype("int32")))),
        atol=1e-6,
    )


@pytest.mark.parametrize(("heads", "bias_max"), [(8, 8), (3, 6), (12, 8)])
def test_alibi_bias_adds_keras_hubs_bias_to_the_scores(heads, bias_max):
    """keras-hub's constructor and call: the scores ``(b, h, i, j)`` plus its bias, any ``h``."""
    scores = kt(np.random.default_rng(7).normal(size=(2, heads, 3, 5)).astype("float32"))
    want = np_(hub.layers.AlibiBias(alibi_bias_max=bias_max)(scores))
    ours = rk.AlibiBias(alibi_bias_max=bias_max)
    np.testing.assert_allclose(np_(ours(scores)), want, atol=1e-6)
    config = hub.layers.AlibiBias(alibi_bias_max=bias_max).get_config()
    np.testing.assert_allclose(np_(rk.AlibiBias.from_config(config)(scores)), want, atol=1e-6)
    half = rk.AlibiBias(alibi_bias_max=bias_max, dtype="float16")(ops.cast(scores, "float16"))
    assert keras.backend.standardize_dtype(half.dtype) == "float16"


def test_alibi_bias_scores_read_each_rows_keys():
    """relpos on top of keras-hub's call: with the keys' mask or segment ids, a left-padded row
    and each packed document get the bias of their keys alone (padding keys: none)."""
    layer = rk.AlibiBias()
    scores = kt(np.zeros((2, 4, 5, 5), "float32"))
    alone = np_(layer(kt(np.zeros((1, 4, 5, 3), "float32"))))[0, :, 0]  # (h, 3)
    mask = np.array([[True] * 5, [False, False, True, True, True]])
    got = np_(layer(scores, mask=kt(mask)))
    np.testing.assert_array_equal(got[1, :, :, 2:], np.broadcast_to(alone[:, None], (4, 5, 3)))
    assert (got[1, :, :, :2] == 0).all()
    np.testing.assert_array_equal(got[0], np_(layer(scores))[0])  # no padding: keras-hub's
    seg = np.array([[0, 0, 0, 1, 1], [1, 1, 1, 0, -1]], "int32")
    got = np_(layer(scores, segment_ids=kt(seg)))
    np.testing.assert_array_equal(got[0, :, 0, :3], alone)
    np.testing.assert_array_equal(got[1, :, 0, :3], alone)
    np.testing.assert_array_equal(got[0, :, 0, 3:], alone[:, 1:])
    assert (got[1, :, :, 3:] == 0).all()  # a one-token document's last key, and padding


def test_alibi_bias_num_heads_form_and_the_old_call():
    """relpos' bias of tokens stays, keyword ``num_heads``; the earlier positional form on
    tokens is a clear error pointing there."""
    x = kt(np.zeros((2, 5, 4), "float32"))
    bias = np_(rk.AlibiBias(num_heads=2, causal=True)(x))
    assert bias.shape == (2, 2, 5, 5) and bias[0, 0, 4, 0] == pytest.approx(-4 * 2**-4)
    with pytest.raises(
        ValueError,
        match=r"attention_scores must have shape \(b, h, i, j\).*"
        r"num_heads=h",
    ):
        rk.AlibiBias(2)(x)
    with pytest.raises(ValueError, match="causal=True is read only with num_heads="):
        rk.AlibiBias(causal=True)
