"""RoPE's angles at large positions in Keras (issue 45 item 5): reduced modulo ``2π`` in float32
alone, so the relative property holds at any int32 offset, as on the PyTorch side."""

import math
from fractions import Fraction

import numpy as np
import pytest

import relpos
from relpos.keras.convert import from_torch
from relpos.keras.ops import rope_angles

from .util import kt, np_

POSITIONS = [0, 7, 2000, 10**9, -(10**9), 2**31 - 1, -(2**31), 123456789]


def test_angles_of_a_fixed_ladder_are_exact_modulo_two_pi():
    """A float32 ``p·ω`` was off by tens of radians at position 1e9; the reduced angle is within
    1e-6 of the exact rational product modulo (float64) 2π at every int32 position."""
    ladder = (1.0, 0.1, 0.01, 1e-4)
    got = np_(rope_angles(kt(np.array([POSITIONS], "int32")), ladder))[0]
    two_pi = Fraction(2 * math.pi)
    for row, p in zip(got, POSITIONS, strict=True):
        want = [float(Fraction(p) * Fraction(float(np.float32(w))) % two_pi) for w in ladder]
        diff = np.abs(row - np.array(want))
        assert np.minimum(diff, 2 * math.pi - diff).max() < 1e-6, p


@pytest.mark.torch_reference
def test_rope_keeps_its_relative_property_at_large_offsets_and_equals_torch():
    """Issue 45 item 5 as reported (``offset=10**9``), on the Keras layer: the outputs at offset 0,
    and PyTorch's at that offset."""
    import torch

    module = relpos.MultiheadAttention(16, 2, "rope", causal=True, backend="eager").eval()
    layer = from_torch(module)
    x = np.random.default_rng(0).standard_normal((1, 5, 16)).astype("float32")
    q = kt(x)  # value is query: self-attention
    near = np_(layer(q, q, start_index=0))
    far = np_(layer(q, q, start_index=10**9))
    np.testing.assert_allclose(far, near, atol=2e-6)
    with torch.no_grad():
        want = module(torch.from_numpy(x), relpos.Positions.from_length(5, offset=10**9))
    np.testing.assert_allclose(far, want.numpy(), atol=2e-6)
