"""The functional core against explicit formulas, and its invariants."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.functional import (
    alibi_slopes,
    apply_rope,
    clipped_relative_index,
    gather_relative,
    gather_table,
    rope_angles,
    rope_frequencies,
    scatter_table,
    sinusoidal_table,
    skew,
    t5_buckets,
)
from tests import oracles


def test_clipped_index_matches_the_issue_example():
    d = Positions.from_length(10).distance()[0]
    assert clipped_relative_index(d, 3)[0].tolist() == [3, 4, 5, 6, 6, 6, 6, 6, 6, 6]
    assert clipped_relative_index(d, 3)[9].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("L", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_skew_equals_explicit_gather(L, causal):
    R = L if causal else 2 * L - 1
    rel = torch.randn(2, 3, L, R)
    out = skew(rel, causal=causal)
    assert out.shape == (2, 3, L, L)
    for i in range(L):
        for j in range(L if not causal else i + 1):
            assert torch.equal(out[..., i, j], rel[..., i, j - i + L - 1])
    # ... and the general gather with index j - i + L - 1 agrees wherever the skew is defined.
    index = (Positions.from_length(L).distance() + L - 1).clamp(0, R - 1)
    gathered = gather_relative(rel, index)
    keep = (
        torch.ones(L, L, dtype=torch.bool).tril() if causal else torch.ones(L, L, dtype=torch.bool)
    )
    assert torch.equal(out[..., keep], gathered[..., keep])


@pytest.mark.parametrize("b", [1, 3])
def test_shared_table_gather_and_scatter_match_a_loop(b):
    """``gather_table`` picks ``table[h, index[b, i, j]]``; ``scatter_table`` adds each ``src``
    entry at its row, summed over batch and queries: both against Python loops."""
    torch.manual_seed(0)
    h, i, j, r = 2, 3, 4, 7
    table = torch.randn(1, h, 1, r, dtype=torch.float64)
    index = torch.randint(0, r, (b, i, j))
    src = torch.randn(b, h, i, j, dtype=torch.float64)
    out = gather_table(table, index)
    grad = scatter_table(torch.zeros(1, h, 1, r, dtype=torch.float64), index, src)
    want_out = torch.zeros(b, h, i, j, dtype=torch.float64)
    want_grad = torch.zeros(1, h, 1, r, dtype=torch.float64)
    for bb, hh, ii, jj in itertools.product(range(b), range(h), range(i), range(j)):
        want_out[bb, hh, ii, jj] = table[0, hh, 0, index[bb, ii, jj]]
        want_grad[0, hh, 0, index[bb, ii, jj]] += src[bb, hh, ii, jj]
    assert torch.equal(out, want_out)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    expanded = table.expand(b, h, i, r)  # the general gather of the broadcast table
    assert torch.equal(out, torch.gather(expanded, -1, index.unsqueeze(1).expand(b, h, i, j)))
    assert torch.equal(gather_relative(table, index), out)  # which takes the shared-table form


def test_skew_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"\(\.\.\., L, L\)"):
        skew(torch.randn(3, 4), causal=True)
    with pytest.raises(ValueError, match="2L-1"):
        skew(torch.randn(3, 4), causal=False)


@given(st.integers(-300, 300), st.booleans(), st.sampled_from([(32, 128), (8, 20), (16, 9)]))
def test_t5_buckets_match_the_scalar_formula(distance, bidirectional, sizes):
    nb, md = sizes
    got = t5_buckets(
        torch.tensor([distance]), bidirectional=bidirectional, num_buckets=nb, max_distance=md
    )
    want = oracles.t5_bucket(distance, bidirectional=bidirectional, num_buckets=nb, max_distance=md)
    assert got.item() == want


def test_t5_buckets_are_monotone_and_in_range():
    d = torch.arange(-500, 501)
    for bidirectional in (True, False):
        b = t5_buckets(d, bidirectional=bidirectional, num_buckets=32, max_distance=128)
        assert b.min() >= 0 and b.max() < 32
        past = b[d <= 0].flip(0)  # distance 0, -1, -2, ...
        assert torch.all(past[1:] >= past[:-1])
    causal = t5_buckets(d, bidirectional=False, num_buckets=32, max_distance=128)
    assert torch.all(causal[d > 0] == 0)


def test_alibi_slopes_known_values():
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence.
    expected = [2.0**-k for k in range(1, 9)] + [2.0 ** (-k / 2) for k in (1, 3, 5, 7)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))
    for n in (1, 3, 5, 6, 7, 12, 24):
        torch.testing.assert_close(
            alibi_slopes(n), torch.tensor([oracles.alibi_slope(h, n) for h in range(n)])
        )


@given(st.integers(0, 5000), st.sampled_from([4, 8, 64]), st.booleans())
def test_rope_preserves_norms(pos, d, interleaved):
    x = torch.randn(1, 2, 1, d)
    y = apply_rope(
        x, rope_angles(torch.tensor([[pos]]), rope_frequencies(d)), interleaved=interleaved
    )
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


@given(st.integers(0, 1000), st.integers(0, 1000), st.integers(-50, 50), st.booleans())
def test_rope_dot_product_depends_only_on_distance(p, shift_q, shift, interleaved):
    d = 16
    inv = rope_frequencies(d)
    q, k = (
        torch.randn(1, 1, 1, d, dtype=torch.float64),
        torch.randn(1, 1, 1, d, dtype=torch.float64),
    )

    def score(pq, pk):
        rq = apply_rope(q, rope_angles(torch.tensor([[pq]]), inv.double()), interleaved=interleaved)
        rk = apply_rope(k, rope_angles(torch.tensor([[pk]]), inv.double()), interleaved=interleaved)
        return (rq * rk).sum()

    a = score(p, max(p + shift, 0))
    b = score(p + shift_q, max(p + shift, 0) + shift_q)
    torch.testing.assert_close(a, b)


def test_partial_rope_leaves_the_rest_alone():
    x = torch.randn(1, 1, 3, 8)
    y = apply_rope(x, rope_angles(torch.tensor([[1, 2, 3]]), rope_frequencies(4)))
    assert torch.equal(y[..., 4:], x[..., 4:]) and not torch.allclose(y[..., :4], x[..., :4])


def rope_loop(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation pair by pair, straight from the paper's 2×2 blocks."""
    out = x.clone()
    half = angles.shape[-1]
    for t in range(half):
        a, b = (2 * t, 2 * t + 1) if interleaved else (t, t + half)
        c, s = angles[..., t].cos().unsqueeze(1), angles[..., t].sin().unsqueeze(1)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., a] * s + x[..., b] * c
    return out


@given(
    d=st.sampled_from([4, 6, 8]),
    rotary_pairs=st.integers(1, 3),
    interleaved=st.booleans(),
    batch_angles=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_and_its_closed_form_gradient_match_a_loop(
    d, rotary_pairs, interleaved, batch_angles, seed
):
    """apply_rope's closed-form backward (rotation by the opposite angles) against autograd
    through the pair-by-pair loop: outputs, gradients, and gradients of gradients."""
    torch.manual_seed(seed)
    half = min(rotary_pairs, d // 2)
    x = torch.randn(2, 3, 5, d, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 50, (2 if batch_angles else 1, 5))
    angles = rope_angles(pos, rope_frequencies(2 * half).double())
    grad = torch.randn_like(x)
    got = apply_rope(x, angles, interleaved=interleaved)
    want = rope_loop(x, angles, interleaved)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got, x, grad, create_graph=True)
    (g_want,) = torch.autograd.grad(want, x, grad, create_graph=True)
    torch.testing.assert_close(g_got, g_want)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, angles, interleaved=interleaved), (x,))
    assert torch.autograd.gradgradcheck(
        lambda t: apply_rope(t, angles, interleaved=interleaved), (x,)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_angles_are_exact_modulo_two_pi_at_any_position(dtype):
    """Issue 45 item 5: ``pos·ω`` in float32 was off by tens of radians at position 1e9. The
    angle modulo (float64) 2π now equals the exact rational product's, whatever the position."""
    from fractions import Fraction

    inv = rope_frequencies(8).to(dtype) * 1.1  # float64: more bits than a float32 ladder
    two_pi = Fraction(2 * math.pi)
    for p in [0, 7, 10**9, 2**40 + 3, -(10**12), 2**53 + 1, 2**62 + 12345]:
        got = rope_angles(torch.tensor([[p]]), inv)[0, 0].double()
        want = [float(Fraction(p) * Fraction(w) % two_pi) for w in inv.double().tolist()]
        got = torch.remainder(got, 2 * math.pi)  # fmod's sign: the same angle
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "spec", ["rope", {"name": "rope", "sections": [2, 2], "axial": True}], ids=["rope", "axial"]
)
def test_rope_keeps_its_relative_property_at_large_offsets(spec):
    """Issue 45 item 5 as reported: ``Positions.from_length(5, offset=10**9)`` gave outputs 0.128
    away from offset 0 (float32 angles); now they agree to float32 rounding, up to 2^62."""
    m = relpos.MultiheadAttention(16, 2, spec, causal=True)
    x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(x, Positions.from_length(5))
        for offset in (10**9, 10**12, 2**62):
            torch.testing.assert_close(m(x, Positions.from_length(5, offset=offset)), ref)


def test_learned_frequencies_get_the_position_as_gradient():
    """The reduced angles stay differentiable in the frequencies (``learned_freq``)."""
    inv = torch.tensor([0.5, 0.01], requires_grad=True)
    rope_angles(torch.tensor([[3, 10**9]]), inv).sum().backward()
    torch.testing.assert_close(inv.grad, torch.tensor([3 + 1e9, 3 + 1e9]))


def test_rope_gradient_reaches_angles_that_require_it():
    """Learned angles take the differentiable path: the gradient reaches them."""
    x = torch.randn(1, 2, 4, 6, dtype=torch.float64)
    angles = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: apply_rope(x, a, interleaved=True), (angles,))
    torch.testing.assert_close(
        apply_rope(x, angles, interleaved=True), rope_loop(x, angles.detach(), True)
    )


def test_rope_in_bfloat16_rotates_in_float32():
    x = torch.randn(1, 2, 7, 8)
    angles = rope_angles(torch.arange(7)[None] * 1000, rope_frequencies(8))
    got = apply_rope(x.bfloat16(), angles)
    assert got.dtype == torch.bfloat16
    want = rope_loop(x.bfloat16().float(), angles, False).bfloat16()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_sinusoid_layouts():
    t = sinusoidal_table(torch.tensor([0, 3]), 6)
    assert t[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert t[1, 0].item() == pytest.approx(math.sin(3)) and t[1, 1].item() == pytest.approx(
        math.cos(3)
    )
    halves = sinusoidal_table(torch.tensor([3]), 6, interleaved=False)[0]
    torch.testing.assert_close(halves, torch.cat([t[1, 0::2], t[1, 1::2]]))


@pytest.mark.parametrize("name", ["shaw", "music", "t5", "alibi"])
@pytest.mark.parametrize("causal", [True, False])
@given(offset=st.integers(1, 10_000))
def test_relative_terms_depend_only_on_distance(name, causal, offset):
    """Shifting every position by the same amount changes no relative term."""
    scheme = relpos.make_scheme(name, d_model=8, num_heads=2, causal=causal)
    torch.nn.init.normal_(next(iter(scheme.parameters()), torch.empty(0)))
    q = torch.randn(1, 2, 5, 4)
    p = Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1]]))
    shifted = Positions.from_segments(p.seg, offset=offset)
    torch.testing.assert_close(scheme.score_bias(q, p, p), scheme.score_bias(q, shifted, shifted))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_music_table_slice_by_span_equals_the_full_table(causal, n):
    """With a known span only the reachable rows of Er are multiplied; the result is the same."""
    scheme = relpos.make_scheme(
        {"name": "music", "max_distance": 16}, d_model=8, num_heads=2, causal=causal
    )
    q = torch.randn(2, 2, n, 4)
    with_span = Positions.from_segments(torch.tensor([[0] * n, [-1] + [0] * (n - 1)]))
    assert with_span.span == n - 1
    without = Positions(with_span.pos, with_span.seg)  # hand-built: span unknown, full table
    keep = with_span.allowed(causal=causal).unsqueeze(1)
    a = scheme.score_bias(q, with_span, with_span)
    b = scheme.score_bias(q, without, without)
    torch.testing.assert_close(a[keep.expand_as(a)], b[keep.expand_as(b)])


# ------------------------------------------------------------------------------ dropout
def test_drop_mask_rate_scale_and_independent_lanes():
    """The CPU mask drops at ``p`` rounded to 1/65536 (to 5 standard errors, in each of the four
    16-bit lanes of a random word: a lane stuck or shared would show), scales by
    ``1 / (1 - rounded p)``, and draws from torch's seeded generator."""
    from relpos.functional.dropout import drop_mask

    n, p = 1 << 20, 0.3
    torch.manual_seed(0)
    drop, scale = drop_mask((n // 1024, 1024), p, torch.device("cpu"))
    rounded = round(p * 65536) / 65536
    assert drop.dtype == torch.bool and drop.shape == (n // 1024, 1024)
    assert scale == pytest.approx(1 / (1 - rounded), rel=1e-12)
    for lane in range(4):
        rate = drop.flatten()[lane::4].float().mean().item()
        assert abs(rate - rounded) < 5 * (p * (1 - p) / (n // 4)) ** 0.5, (lane, rate)
    # Neighbouring lanes are independent: both dropped at rate p² (not p, not 0).
    pairs = drop.flatten().view(-1, 4)
    both = (pairs[:, 0] & pairs[:, 1]).float().mean().item()
    assert abs(both - rounded**2) < 5 * (p * p * (1 - p * p) / (n // 4)) ** 0.5, both
    torch.manual_seed(0)
    assert torch.equal(drop_mask(drop.shape, p, torch.device("cpu"))[0], drop)
    odd, _ = drop_mask((3, 5), p, torch.device("cpu"))  # not a multiple of four lanes
    assert odd.shape == (3, 5)
    assert not drop_mask((64,), 0.0, torch.device("cpu"))[0].any()
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.0"):
        drop_mask((4,), 1.0, torch.device("cpu"))


def test_dropout_keeps_the_expectation_and_is_identity_in_eval():
    from relpos.functional.dropout import Dropout, dropout

    x = torch.rand(256, 256) + 0.5
    torch.manual_seed(1)
    y = dropout(x, 0.25)
    kept = y != 0
    torch.testing.assert_close(y[kept], (x / (1 - 0.25))[kept])
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    layer = Dropout(0.25).eval()
    assert layer(x) is x and dropout(x, 0.25, training=False) is x
    assert dropout(x, 0.0) is x
