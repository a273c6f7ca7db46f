"""Sandwich (Chi, Fan, Rudnicky and Ramadge, 2023): the bias pinned by hand and against a loop over
(i, j) of the inner product of two sinusoidal embeddings, its shape (0 at distance 0, even, the
head-wise compression), and one evaluation per distinct distance. The shared suites
(``SCHEME_SPECS``) run it through the attention oracle, padded / packed / cached parity and every
backend's distance-table path."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.functional import sandwich_bias, sandwich_head_scales
from tests.helpers import random_segments


def embedding(p: int, dim: int, base: float) -> list[float]:
    """Sinusoidal embedding of position ``p`` with frequencies ``base^(-2k/d̄)``, ``k = 1..d̄/2``."""
    freqs = [base ** (-2 * k / dim) for k in range(1, dim // 2 + 1)]
    return [math.sin(p * w) for w in freqs] + [math.cos(p * w) for w in freqs]


def test_by_hand():
    d = torch.tensor([-3, 0, 5])
    out = sandwich_bias(d, sandwich_head_scales(2), dim=4, base=10000.0)  # divisors 4 and 8
    inner = [math.cos(x / 100) + math.cos(x / 10000) - 2 for x in (-3, 0, 5)]
    expected = torch.tensor([[v / 4 for v in inner], [v / 8 for v in inner]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)


@settings(max_examples=8)
@given(seed=st.integers(0, 2**16), causal=st.booleans())
def test_matches_the_inner_product_of_sinusoidal_embeddings(seed, causal):
    """``(p_i·p_j - d̄/2) / (8h/H)`` pair by pair of real tokens, from each token's own position
    (a pair with padding is masked; its value is only finite)."""
    rng = random.Random(seed)
    h, b, n, dim = rng.randint(1, 4), rng.randint(1, 2), rng.randint(1, 10), 2 * rng.randint(1, 6)
    scheme = relpos.make_scheme(
        {"name": "sandwich", "dim": dim, "base": 100.0}, d_model=2 * h, num_heads=h, causal=causal
    ).double()
    seg = torch.tensor([random_segments(rng, n) for _ in range(b)])
    pos = Positions.from_segments(seg, offset=torch.tensor([rng.randint(0, 30) for _ in range(b)]))
    out = scheme.score_bias(None, pos, pos)
    assert out.dtype == torch.float64 and out.shape == (b, h, n, n)
    assert bool(out.isfinite().all())
    for r in range(b):
        p, real = pos.pos[r].tolist(), (seg[r] != -1).tolist()
        for head in range(h):
            for i in range(n):
                for j in range(n):
                    if not (real[i] and real[j]):
                        continue
                    e_i, e_j = embedding(p[i], dim, 100.0), embedding(p[j], dim, 100.0)
                    dot = sum(x * y for x, y in zip(e_i, e_j, strict=True))
                    expected = (dot - dim / 2) / (8 * (head + 1) / h)
                    assert out[r, head, i, j].item() == pytest.approx(expected, abs=1e-10)


def test_shape_of_the_bias():
    scheme = relpos.make_scheme("sandwich", d_model=32, num_heads=4, causal=False)
    pos = Positions.from_length(300)
    bias = scheme.score_bias(None, pos, pos)[0]  # (h, i, j)
    assert (bias.diagonal(dim1=-2, dim2=-1) == 0).all() and (bias <= 0).all()
    torch.testing.assert_close(bias, bias.transpose(-1, -2))  # even in the distance
    # head h is head 1 compressed by h (divisors 8h/H)
    for h in range(4):
        torch.testing.assert_close(bias[h] * (h + 1), bias[0])
    row = bias[0, 0]  # decays from the query (with ripples: the cosines' high frequencies)
    assert (row[:6].diff() < 0).all() and row[250:].max() < row[20:30].min()
    causal = relpos.make_scheme("sandwich", d_model=32, num_heads=4, causal=True)
    torch.testing.assert_close(causal.score_bias(None, pos, pos)[0], bias)
    assert not list(scheme.parameters()) and not scheme.state_dict()


def test_evaluated_once_per_distinct_distance():
    scheme = relpos.make_scheme("sandwich", d_model=8, num_heads=2, causal=True)
    sizes = []
    original = scheme.distance_bias
    scheme.distance_bias = lambda distance: sizes.append(distance.numel()) or original(distance)
    pos = Positions.from_length(1000)
    assert scheme.score_bias(None, pos, pos).shape == (1, 2, 1000, 1000) and sizes == [1999]


def test_bf16_module_keeps_exact_head_scales():
    pos = Positions.from_length(50)
    ref = relpos.make_scheme("sandwich", d_model=12, num_heads=3, causal=True)
    half = relpos.make_scheme("sandwich", d_model=12, num_heads=3, causal=True).to(torch.bfloat16)
    out = half.score_bias(None, pos, pos)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.score_bias(None, pos, pos))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dim": 7}, ValueError, "dim must be even"),
        ({"dim": 0}, ValueError, "dim must be >= 2, got 0"),
        ({"dim": 8.0}, TypeError, "dim must be an int"),
        ({"base": 1.0}, ValueError, "base must be > 1, got 1.0"),
        ({"heads": []}, ValueError, "heads must be None"),
    ],
)
def test_bad_config(kwargs, error, message):
    with pytest.raises(error, match=message):
        relpos.SandwichConfig(**kwargs)
