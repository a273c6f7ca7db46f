"""The padding guarantee of the PyTorch layer, on every Keras backend and every Keras attention
scheme: whatever a padding token holds, NaN and inf included, the real tokens' outputs are
exactly those of the same batch with finite padding, padding outputs exactly 0, and the weights'
gradients are those of finite padding too. ``make test`` checks every scheme on the torch
backend and a third of them on each of JAX and TensorFlow (``every_other``); ``make test-all``
every scheme on every backend."""

import numpy as np
import pytest
from keras import ops

from relpos.keras import KERAS_SCHEMES, RelativeMultiHeadAttention
from relpos.spec import config_class

from .util import every_other, grads, kt, np_

# test_properties.py's shapes (JAX compiles once per shape)
B, N, WIDTH, HEADS = 3, 8, 16, 2
X = np.random.default_rng(0).normal(size=(B, N, WIDTH)).astype("float32")
MASK = np.ones((B, N), bool)
MASK[1, :3] = False  # left padding
MASK[2, 5:] = False  # right padding


def _layer(name):
    causal = config_class(name).causal_only
    layer = RelativeMultiHeadAttention(HEADS, WIDTH // HEADS, scheme=name, causal=causal)
    layer.build((None, None, WIDTH))
    return layer


def _poison(x, padding):
    """``x`` with NaN, +inf and -inf spread over its ``padding`` ``(b, n)`` tokens."""
    bad = np.array([np.nan, np.inf, -np.inf], "float32")
    fill = bad[np.arange(x.size).reshape(x.shape) % 3]
    return np.where(padding[..., None], fill, x).astype("float32")


def _assert_real_equal(call, x, padding, **kw):
    """``call`` on ``x`` and on ``x`` poisoned at ``padding``: real outputs identical, padding
    outputs 0."""
    clean = np_(call(kt(x), **kw))
    dirty = np_(call(kt(_poison(x, padding)), **kw))
    np.testing.assert_array_equal(dirty[~padding], clean[~padding])
    assert (dirty[padding] == 0).all()


@pytest.mark.parametrize("name", every_other(sorted(KERAS_SCHEMES)))
def test_non_finite_padding_does_not_reach_real_tokens(name):
    layer, x, mask = _layer(name), X, MASK
    _assert_real_equal(layer, x, ~mask, query_mask=kt(mask))
    seg = np.array(
        [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, -1, -1], [-1, 0, 0, 0, 1, 1, 1, 1]], "int32"
    )
    _assert_real_equal(layer, x, seg == -1, segment_ids=kt(seg))
    if KERAS_SCHEMES[name].contextual:  # self-attention only
        return

    def cross(value, **kw):  # padding in the value sequence: the queries stay real
        return layer(kt(x), value, **kw)

    clean = np_(cross(kt(x), value_mask=kt(mask)))
    dirty = np_(cross(kt(_poison(x, ~mask)), value_mask=kt(mask)))
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("name", every_other(sorted(KERAS_SCHEMES)))
def test_non_finite_padding_reaches_no_gradient(name):
    """The padding tokens are dropped before the projections read them: every weight's gradient
    is the one of finite padding (a projection weight's sums input times output gradient over
    every token, and NaN·0 is NaN)."""
    layer = _layer(name)
    weights = layer.trainable_variables
    clean, dirty = (
        grads(lambda x=x: ops.sum(layer(kt(x), query_mask=kt(MASK))), weights)
        for x in (X, _poison(X, ~MASK))
    )
    for path, c, d in zip((w.path for w in weights), clean, dirty, strict=True):
        np.testing.assert_array_equal(np_(d), np_(c), err_msg=path)
