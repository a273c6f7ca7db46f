"""KERPLE (Chi et al., 2022): its two kernels pinned by hand, parameters kept in their domain, and
the bias evaluated once per distinct distance. The shared suites (``SCHEME_SPECS``) run both
variants through the loop oracle, conformance, backends and gradcheck."""

import math

import pytest
import torch

import relpos
from relpos import Positions
from relpos.functional import kerple_bias


def test_kernels_by_hand():
    d = torch.tensor([-3, 0, 2])
    r1, r2 = torch.tensor([2.0]), torch.tensor([0.5])
    log = kerple_bias(d, r1, r2, variant="log")
    torch.testing.assert_close(log, torch.tensor([[-2 * math.log(2.5), 0.0, -2 * math.log(2.0)]]))
    power = kerple_bias(d, r1, r2, variant="power")
    torch.testing.assert_close(power, torch.tensor([[-2 * 3**0.5, 0.0, -2 * 2**0.5]]))


def test_parameters_are_clamped_into_their_domain():
    scheme = relpos.make_scheme(
        {"name": "kerple", "variant": "power"}, d_model=8, num_heads=2, causal=True
    )
    with torch.no_grad():
        scheme.r1.copy_(torch.tensor([-1.0, 3.0]))
        scheme.r2.copy_(torch.tensor([5.0, -2.0]))
    r1, r2 = scheme.parameters_in_range()
    assert r1.tolist() == pytest.approx([0.01, 3.0]) and r2.tolist() == pytest.approx([2.0, 0.01])


@pytest.mark.parametrize("variant", ["log", "power"])
def test_bias_depends_on_distance_only_and_decreases(variant):
    scheme = relpos.make_scheme(
        {"name": "kerple", "variant": variant}, d_model=8, num_heads=2, causal=False
    )
    q = torch.zeros(1, 2, 6, 4)
    a = scheme.score_bias(q, Positions.from_length(6), Positions.from_length(6))
    b = scheme.score_bias(
        q, Positions.from_length(6, offset=40), Positions.from_length(6, offset=40)
    )
    torch.testing.assert_close(a, b)
    row = a[0, :, 0]  # query 0 against keys 0..5: 0 at distance 0, then strictly decreasing
    assert (row[:, 0] == 0).all() and (row.diff(dim=-1) < 0).all()


def test_the_kernel_runs_once_per_distinct_distance():
    """1,000 queries and keys: 1,999 distances, not a million evaluations."""
    scheme = relpos.make_scheme("kerple", d_model=8, num_heads=2, causal=True)
    sizes = []
    original = scheme.distance_bias
    scheme.distance_bias = lambda distance: sizes.append(distance.numel()) or original(distance)
    pos = Positions.from_length(1000)
    bias = scheme.score_bias(torch.zeros(1, 2, 1000, 4), pos, pos)
    assert sizes == [1999] and bias.shape == (1, 2, 1000, 1000)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
def test_padding_far_from_the_real_positions_does_not_widen_the_table(backend):
    """Real tokens at 10**7 and one padding token (position 0): the function runs at the
    distances a row of 5 can hold (9 of them, from the positions' span, not 2·10**7), and the
    real tokens get what they get alone."""
    attn = relpos.MultiheadAttention(8, 2, "kerple", causal=True, backend=backend)
    sizes = []
    original = attn.scheme.distance_bias
    attn.scheme.distance_bias = lambda d: sizes.append(d.numel()) or original(d)
    x = torch.randn(1, 5, 8)
    mask = torch.tensor([[False, True, True, True, True]])
    with torch.no_grad():
        padded = attn(x, positions=Positions.from_padding_mask(mask, offset=10**7))
        alone = attn(x[:, 1:], positions=Positions.from_length(4, offset=10**7))
    assert max(sizes) <= 9
    torch.testing.assert_close(padded[:, 1:], alone)
    assert (padded[:, 0] == 0).all()


def test_bad_config():
    with pytest.raises(ValueError, match=r"variant must be one of \('log', 'power'\), got 'cubic'"):
        relpos.KerpleConfig(variant="cubic")
