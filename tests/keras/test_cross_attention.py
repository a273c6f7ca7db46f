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
#: Queries (2, 7) and keys (2, 6) of packed rows: ids are labels (any order: row 1's query
#: documents 5 then 2, its keys 2 then 5; row 0's keys document 1 first). Every (query document,
#: value document) pair is 3 queries over 2 keys, so the pairs alone are one plain batch: one shape
#: for JAX to compile each op at, not one per pair. Row 1's query document 7 has no key and
#: outputs zeros; row 0's value document 9 has no query.
Q_SEG = np.array([[0, 0, 0, 1, 1, 1, -1], [5, 5, 5, 2, 2, 2, 7]], "int32")
K_SEG = np.array([[1, 1, 0, 0, 9, -1], [-1, 2, 2, 5, 5, -1]], "int32")
PAIRS = [(0, 0), (0, 1), (1, 5), (1, 2)]  # (row, document)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 7, WIDTH)).astype("float32")
CONTEXT = RNG.normal(size=(2, 6, WIDTH)).astype("float32")
#: Where each pair sits in the padded rows, of the packed rows' lengths (7 queries, 6 keys): its
#: 3 queries from slot QUERY_AT[p], its 2 keys from slot KEY_AT[p]; padding on the left, the
#: right or both sides.
QUERY_AT, KEY_AT = (4, 0, 2, 3), (0, 4, 1, 2)

#: (scheme, causal): RoPE, ALiBi (causal: a key at a position <= the query's), T5 buckets and
#: Shaw's relative embeddings (keys and values), clipped inside the documents (Shaw's at 1: the
#: pairs' distances -2..1 reach past it).
SCHEMES = [
    ("rope", False),
    ("alibi", True),
    ({"name": "t5", "num_buckets": 8, "max_distance": 6}, False),
    ({"name": "shaw", "max_distance": 1}, False),
]
IDS = ["rope", "alibi-causal", "t5", "shaw"]


def _layer(scheme, causal):
    layer = rk.RelativeMultiHeadAttention(
        2, 8, scheme=scheme, causal=causal, bias_initializer="ones"
    )
    layer.build(X.shape, CONTEXT.shape)  # no call: each call shape compiles on JAX
    for w in layer.position_scheme.weights:  # tables start at 0 (T5): give them values
        w.assign(RNG.normal(size=w.shape).astype("float32"))
    return layer


def _pairs():
    """The queries ``(P, 3, D)`` and keys ``(P, 2, D)`` of each pair of :data:`PAIRS`."""
    q = np.stack([X[r, Q_SEG[r] == s] for r, s in PAIRS])
    k = np.stack([CONTEXT[r, K_SEG[r] == s] for r, s in PAIRS])
    return q, k


@pytest.mark.parametrize(("scheme", "causal"), SCHEMES, ids=IDS)
def test_packed_cross_attention_equals_each_pair_alone(scheme, causal):
    """Every query document of a packed row attends to its value document only, each token at
    its position in its own document: the packed output equals each pair run alone (a row each
    of one plain batch: rows never attend to each other), and so does a batch of the pairs
    padded (``query_mask`` / ``value_mask``, at other slots in each row). A query document with
    no key, and padding, output zeros. (Without ``value_segment_ids`` every key was in document
    0: the queries of documents 1 and later output zeros.)"""
    layer = _layer(scheme, causal)
    got = np_(layer(kt(X), kt(CONTEXT), segment_ids=kt(Q_SEG), value_segment_ids=kt(K_SEG)))
    q, k = _pairs()
    alone = np_(layer(kt(q), kt(k)))
    for p, (r, s) in enumerate(PAIRS):
        np.testing.assert_allclose(got[r, Q_SEG[r] == s], alone[p], atol=1e-5, err_msg=f"{r}, {s}")
    assert not got[:, 6].any()  # row 1's document 7 (no key), row 0's padding
    assert np.abs(got[:, :6]).sum(-1).all()

    # The pairs padded, one a row, at other slots than alone: two calls of the packed call's
    # shape (2, 7, 6), so that JAX, which compiles each op per shape, compiles no third one.
    rng = np.random.default_rng(1)
    padded_q = rng.normal(size=(len(PAIRS), 7, WIDTH)).astype("float32")  # padding: any values
    padded_k = np.full((len(PAIRS), 6, WIDTH), 3.0, "float32")
    q_mask, k_mask = np.zeros((len(PAIRS), 7), bool), np.zeros((len(PAIRS), 6), bool)
    for p, (qa, ka) in enumerate(zip(QUERY_AT, KEY_AT, strict=True)):
        padded_q[p, qa : qa + 3], q_mask[p, qa : qa + 3] = q[p], True
        padded_k[p, ka : ka + 2], k_mask[p, ka : ka + 2] = k[p], True
    padded = np.concatenate(
        [
            np_(
                layer(
                    kt(padded_q[rows]),
                    kt(padded_k[rows]),
                    query_mask=kt(q_mask[rows]),
                    value_mask=kt(k_mask[rows]),
                )
            )
            for rows in (slice(0, 2), slice(2, 4))
        ]
    )
    np.testing.assert_allclose(padded[q_mask].reshape(alone.shape), alone, atol=1e-5)
    assert not padded[~q_mask].any()


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
