"""keras-hub as a test-only reference: on unpadded input with the same weights, our layers give
keras-hub's numbers (so code switches by the import)."""

import numpy as np
import pytest

import relpos.keras as rk

from .util import kt, np_

hub = pytest.importorskip("keras_hub")


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
