"""Cross-attention with the value sequence's own positions: ``value_segment_ids`` (packed
encoder-decoder rows: query document ``s`` attends to value document ``s``) and
``value_positions``. Packed equals every (query document, value document) pair run alone, and so
does a padded batch of the pairs; the arguments work under ``jit`` / ``tf.function`` and in a
functional model. Equality with :class:`relpos.MultiheadAttention`'s ``context_segment_ids`` /
``context_positions``: tests/keras/test_parity_torch.py; bad arguments: tests/keras/test_errors.py.
"""

import keras
import numpy as np
import pytest

import relpos.keras as rk

from .util import kt, np_, traced

WIDTH = 16
#: Queries (2, 7) and keys (2, 6) of packed rows: ids are labels (5, 2, 7; any order, document 1
#: first among row 0's keys); row 1's query document 7 has no key and outputs zeros.
Q_SEG = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 2, 5, 5, 5, 7, -1]], "int32")
K_SEG = np.array([[1, 1, 0, 0, 0, -1], [5, 5, 2, 2, 2, -1]], "int32")
PAIRS = [(0, 0), (0, 1), (1, 2), (1, 5)]  # (row, document)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 7, WIDTH)).astype("float32")
CONTEXT = RNG.normal(size=(2, 6, WIDTH)).astype("float32")

#: (scheme, causal): RoPE, ALiBi (causal: a key at a position <= the query's), T5 buckets and
#: Shaw's relative embeddings (keys and values), clipped inside the documents.
SCHEMES = [
    ("rope", False),
    ("alibi", True),
    ({"name": "t5", "num_buckets": 8, "max_distance": 6}, False),
    ({"name": "shaw", "max_distance": 2}, False),
]
IDS = ["rope", "alibi-causal", "t5", "shaw"]


def _layer(scheme, causal):
    layer = rk.RelativeMultiHeadAttention(
        2, 8, scheme=scheme, causal=causal, bias_initializer="ones"
    )
    layer(kt(X), kt(CONTEXT))  # build
    for w in layer.position_scheme.weights:  # tables start at 0 (T5): give them values
        w.assign(RNG.normal(size=w.shape).astype("float32"))
    return layer


def _alone(layer, r, s):
    """The pair (query document ``s``, value document ``s``) of row ``r``, alone: ``(i_s, D)``."""
    q, k = X[r, Q_SEG[r] == s][None], CONTEXT[r, K_SEG[r] == s][None]
    return np_(layer(kt(q), kt(k)))[0]


@pytest.mark.parametrize(("scheme", "causal"), SCHEMES, ids=IDS)
def test_packed_cross_attention_equals_each_pair_alone(scheme, causal):
    """Every query document of a packed row attends to its value document only, each token at
    its position in its own document: the packed output equals each pair run alone, and so does
    a batch of the pairs padded (queries left, keys right: ``query_mask`` / ``value_mask``).
    A query document with no key, and padding, output zeros. (Without ``value_segment_ids`` every
    key was in document 0: the queries of documents 1 and later output zeros.)"""
    layer = _layer(scheme, causal)
    got = np_(layer(kt(X), kt(CONTEXT), segment_ids=kt(Q_SEG), value_segment_ids=kt(K_SEG)))
    alone = {(r, s): _alone(layer, r, s) for r, s in PAIRS}
    for (r, s), want in alone.items():
        np.testing.assert_allclose(got[r, Q_SEG[r] == s], want, atol=1e-5, err_msg=f"{r}, {s}")
    assert not got[1, 5:].any()  # document 7 (no key) and padding
    assert np.abs(got[1, :5]).sum(-1).all()

    # The pairs in a padded batch, one a row.
    iq = max(int((Q_SEG[r] == s).sum()) for r, s in PAIRS)
    jk = max(int((K_SEG[r] == s).sum()) for r, s in PAIRS)
    q = np.zeros((len(PAIRS), iq, WIDTH), "float32")
    k = np.full((len(PAIRS), jk, WIDTH), 3.0, "float32")  # padding keys with values
    q_mask, k_mask = np.zeros((len(PAIRS), iq), bool), np.zeros((len(PAIRS), jk), bool)
    for row, (r, s) in enumerate(PAIRS):
        qs, ks = X[r, Q_SEG[r] == s], CONTEXT[r, K_SEG[r] == s]
        q[row, iq - len(qs) :], q_mask[row, iq - len(qs) :] = qs, True
        k[row, : len(ks)], k_mask[row, : len(ks)] = ks, True
    padded = np_(layer(kt(q), kt(k), query_mask=kt(q_mask), value_mask=kt(k_mask)))
    for row, pair in enumerate(PAIRS):
        np.testing.assert_allclose(padded[row][q_mask[row]], alone[pair], atol=1e-5)


@pytest.mark.parametrize(("scheme", "causal"), SCHEMES[:3], ids=IDS[:3])
def test_value_positions_place_the_keys(scheme, causal):
    """``value_positions`` ``(j,)`` or ``(b, j)`` are the keys' positions, as ``positions`` are
    the queries': ``0..j-1`` is the default; shifting both sides alike changes nothing for a
    relative scheme, shifting the keys alone does; beside ``value_mask`` (padding), the
    positions counted among its real tokens are what the mask alone gives."""
    layer = _layer(scheme, causal)
    xt, ct = kt(X), kt(CONTEXT)
    pos = np.array([[2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6]], "int32")
    base = np_(layer(xt, ct, positions=kt(pos)))
    keys = np.arange(6, dtype="int32")
    np.testing.assert_allclose(
        np_(layer(xt, ct, positions=kt(pos), value_positions=kt(keys))), base
    )
    shifted = layer(xt, ct, positions=kt(pos + 4), value_positions=kt(np.stack([keys, keys]) + 4))
    np.testing.assert_allclose(np_(shifted), base, atol=1e-5)
    moved = np_(layer(xt, ct, positions=kt(pos), value_positions=kt(keys + 3)))
    assert not np.allclose(moved, base, atol=1e-3)

    mask = np.array([[1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], bool)
    counted = np.where(mask, np.cumsum(mask, 1) - 1, 7).astype("int32")  # padding: any value
    want = np_(layer(xt, ct, value_mask=kt(mask)))
    got = layer(xt, ct, value_mask=kt(mask), value_positions=kt(counted))
    np.testing.assert_allclose(np_(got), want, atol=1e-5)


def test_value_segment_ids_meet_value_mask():
    """``value_segment_ids`` with ``value_mask`` (or ``key_mask``): a key is real only where both
    say so, as ``segment_ids`` with ``query_mask``."""
    layer = _layer("rope", False)
    hole = np.ones((2, 6), bool)
    hole[0, 3] = hole[1, 1] = False
    want = layer(
        kt(X), kt(CONTEXT), segment_ids=kt(Q_SEG), value_segment_ids=kt(np.where(hole, K_SEG, -1))
    )
    for name in ("value_mask", "key_mask"):
        got = layer(
            kt(X),
            kt(CONTEXT),
            segment_ids=kt(Q_SEG),
            value_segment_ids=kt(K_SEG),
            **{name: kt(hole)},
        )
        np.testing.assert_allclose(np_(got), np_(want), atol=1e-6, err_msg=name)


def test_value_segment_ids_traced_and_in_a_functional_model():
    """Compiled as a training step would be (``jax.jit``, ``tf.function``) and as a functional
    model's inputs, packed cross-attention gives the eager numbers."""
    layer = _layer({"name": "t5", "num_buckets": 8, "max_distance": 6}, False)
    args = (kt(X), kt(CONTEXT), kt(Q_SEG), kt(K_SEG))
    want = np_(layer(args[0], args[1], segment_ids=args[2], value_segment_ids=args[3]))

    def run(x, c, s, vs):
        return layer(x, c, segment_ids=s, value_segment_ids=vs)

    compiled = traced(run)
    if compiled is not None:
        np.testing.assert_allclose(np_(compiled(*args)), want, atol=1e-5)
    x_in = keras.Input((7, WIDTH))
    c_in = keras.Input((6, WIDTH))
    s_in, vs_in = keras.Input((7,), dtype="int32"), keras.Input((6,), dtype="int32")
    model = keras.Model([x_in, c_in, s_in, vs_in], run(x_in, c_in, s_in, vs_in))
    np.testing.assert_allclose(np_(model(list(args))), want, atol=1e-5)
