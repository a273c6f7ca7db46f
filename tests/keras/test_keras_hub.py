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
