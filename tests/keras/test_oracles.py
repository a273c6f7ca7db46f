"""What has no PyTorch twin, against loops and NumPy: segment positions (interleaved documents
too), the relative embedding tensor of the paper's formula, ALiBi's bias counting positions, not
indices, and FIRE's piecewise-linear MLP. No torch: their equality with the PyTorch modules is
tests/keras/test_parity_torch.py."""

import numpy as np

from relpos.keras import AlibiBias, RelativePositionEmbedding
from relpos.keras.ops import fire_mlp
from relpos.keras.positions import positions_from_segments

from .util import kt, layout, np_


def test_segment_positions_equal_a_loop():
    rng = np.random.default_rng(4)
    seg = rng.integers(-1, 3, size=(4, 12)).astype("int32")  # interleaved documents too
    got = positions_from_segments(kt(seg), start_index=kt(np.array([0, 2, 5, 1], "int32")))
    for r in range(4):
        for t in range(12):
            want = 0 if seg[r, t] < 0 else int((seg[r, :t] == seg[r, t]).sum()) + [0, 2, 5, 1][r]
            assert np_(got.pos)[r, t] == want
    assert (np_(got.seg) == seg).all()


def test_fire_mlp_piecewise_form_equals_the_dense_mlp():
    """``keras.ops`` FIRE MLP (kinks and tables) against ``relu(x·w1 + b1)·w2 + b2`` in NumPy,
    with flat units (``w1 = 0``, on and off), two units sharing a kink and inputs on kinks."""
    rng = np.random.default_rng(0)
    w, h = 9, 3
    w1, b1 = rng.normal(size=w).astype("float32"), rng.normal(size=w).astype("float32")
    w1[:2], b1[:2] = 0.0, (0.7, -0.3)
    w1[3], b1[3] = 2 * w1[2], 2 * b1[2]
    w2, b2 = rng.normal(size=(w, h)).astype("float32"), rng.normal(size=h).astype("float32")
    kinks = -b1[2:] / w1[2:]
    x = np.concatenate([np.linspace(-4, 4, 41), kinks]).astype("float32").reshape(2, -1)
    want = np.maximum(x[..., None] * w1 + b1, 0.0) @ w2 + b2
    got = np_(fire_mlp(*(kt(a) for a in (x, w1, b1, w2, b2))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_relative_embedding_equals_the_papers_formula():
    k, d = 2, 5
    layer = RelativePositionEmbedding(k, d)
    lay = layout("packed", 2, 7, seed=5)
    got = np_(layer(kt(np.zeros((2, 7, 3), "float32")), segment_ids=kt(lay["seg"])))
    w = np_(layer.embeddings)
    seg = lay["seg"]
    for r in range(2):
        pos = [int((seg[r, :t] == seg[r, t]).sum()) for t in range(7)]
        for i in range(7):
            for j in range(7):
                same = seg[r, i] == seg[r, j] and seg[r, i] >= 0
                want = w[min(max(pos[j] - pos[i], -k), k) + k] if same else np.zeros(d)
                np.testing.assert_allclose(got[r, i, j], want, atol=1e-7)


def test_alibi_layer_counts_positions_not_indices():
    left = kt(np.array([[False, False, True, True, True]]))
    got = np_(AlibiBias(num_heads=2, causal=True)(kt(np.zeros((1, 5, 4), "float32")), mask=left))
    alone = np_(AlibiBias(num_heads=2, causal=True)(kt(np.zeros((1, 3, 4), "float32"))))
    np.testing.assert_allclose(got[:, :, 2:, 2:], alone)
