"""TensorFlow: ragged batches are accepted and give what the same rows give zero-padded with a
mask (and so what each row gives alone)."""

import numpy as np
import pytest

import relpos.keras as rk

from .util import BACKEND, np_

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="ragged tensors are TensorFlow's")


def _ragged(rows):
    import tensorflow as tf

    return tf.ragged.constant(rows, ragged_rank=1)


def test_ragged_tokens_embed_like_the_masked_batch():
    rows = [[3, 4, 5, 6], [7, 8]]
    layer = rk.TokenAndPositionEmbedding(10, 6, 4)
    out = layer(_ragged(rows))
    assert out.shape.rank == 3 and list(out.row_lengths().numpy()) == [4, 2]
    for r, row in enumerate(rows):
        alone = np_(layer(np.array([row])))[0]
        np.testing.assert_allclose(out[r].numpy(), alone, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: rk.PositionEmbedding(6),
        lambda: rk.SinePositionEncoding(),
        lambda: rk.RotaryEmbedding(),
    ],
    ids=["learned", "sine", "rotary"],
)
def test_ragged_features_get_each_rows_positions(make):
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(n, 4)).astype("float32").tolist() for n in (5, 2, 3)]
    layer = make()
    out = layer(_ragged(rows))
    for r, row in enumerate(rows):
        np.testing.assert_allclose(out[r].numpy(), np_(layer(np.array([row])))[0], atol=1e-6)


@pytest.mark.parametrize("spec", ["rope", {"name": "shaw", "max_distance": 2}], ids=str)
def test_ragged_attention_equals_each_row_alone(spec):
    rng = np.random.default_rng(1)
    rows = [rng.normal(size=(n, 8)).astype("float32").tolist() for n in (4, 1, 3)]
    layer = rk.RelativeMultiHeadAttention(2, 4, scheme=spec, causal=True)
    out = layer(_ragged(rows))
    for r, row in enumerate(rows):
        np.testing.assert_allclose(out[r].numpy(), np_(layer(np.array([row])))[0], atol=1e-5)
    bias = rk.AlibiBias(num_heads=2)(_ragged(rows))  # pair layers return a dense (b, h, i, j) term
    assert tuple(bias.shape) == (3, 2, 4, 4) and (np_(bias)[1, :, 1:, :] == 0).all()
