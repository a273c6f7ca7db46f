"""Distance biases in closed form (``relpos.functional.distance_form``): what a scheme declares
(``closed_form``, ``distance_form``) is what it evaluates as a table, for every registered
distance bias and ALiBi; the forms pinned by hand. The kernel that computes them per pair is
checked against ``eager`` in ``tests/fused``. Over a KV cache's positions (no promised range) a
distance bias is evaluated per pair where that spares a device sync, with the table's numbers."""

from __future__ import annotations

import math

import pytest
import torch

import relpos
from relpos.functional.distance_form import (
    DISTANCE_FORMS,
    LINEAR_FORMS,
    DistanceForm,
    distance_form_bias,
    linear_form,
)
from relpos.positions import Positions
from relpos.schemes.base import PAIRWISE_QUERIES, DistanceBiasScheme, LinearBiasScheme
from tests.helpers import SyncCalls, randomize_parameters, spec_id
from tests.specs import SCHEME_SPECS

DISTANCE_SPECS = [
    s
    for s in SCHEME_SPECS
    if issubclass(relpos.SCHEMES[s["name"]], DistanceBiasScheme | LinearBiasScheme)
]


def test_every_form_by_hand():
    d = torch.tensor([-4, -1, 0, 3])
    params = torch.tensor([[0.5, 0.25]], dtype=torch.float64)
    want = {
        "linear": [-2.0, -0.5, 0.0, 1.5],
        "symmetric_linear": [-2.0, -0.5, 0.0, -1.5],
        "kerple_log": [-0.5 * math.log(1 + 0.25 * x) for x in (4, 1, 0, 3)],
        "kerple_power": [-0.5 * x**0.25 for x in (4, 1, 0, 3)],
    }
    assert set(want) == set(DISTANCE_FORMS)
    for name, values in want.items():
        got = distance_form_bias(DistanceForm(name, params), d)
        torch.testing.assert_close(got, torch.tensor([values], dtype=torch.float64))
    with pytest.raises(ValueError, match="name must be one of"):
        distance_form_bias(DistanceForm("cubic", params), d)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("spec", DISTANCE_SPECS, ids=spec_id)
def test_a_declared_form_is_the_scheme_s_table(spec, causal):
    """``closed_form`` says whether ``distance_form`` gives one (ALiBi, learned ALiBi, KERPLE's
    two kernels; not Sandwich's nor DPB's); where it does, the form's bias is the scheme's own
    over every distance (heads left out of ``heads`` at 0), and its parameters carry the
    gradient to the scheme's."""
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=4, causal=causal)
    randomize_parameters(scheme, 3)
    declared = isinstance(scheme, LinearBiasScheme) or scheme.closed_form
    form = scheme.distance_form() if declared else None
    if isinstance(scheme, DistanceBiasScheme):
        assert (scheme.distance_form() is not None) == scheme.closed_form
    if form is None:
        return
    width = 1 if form.name in LINEAR_FORMS else 2
    assert form.name in DISTANCE_FORMS and tuple(form.params.shape) == (4, width)
    p = relpos.Positions.from_length(9)
    lo, hi = -8, 8
    got = distance_form_bias(form, torch.arange(lo, hi + 1))
    if isinstance(scheme, DistanceBiasScheme):
        table_lo, table = scheme.distance_table(p, p)
        assert table_lo == lo
    else:  # ALiBi's bias of a query at 8 over keys 0..16
        keys = relpos.Positions.from_length(17)
        table = scheme.score_bias(None, relpos.Positions.from_length(1, offset=8), keys)[0, :, 0]
    torch.testing.assert_close(got.float(), table.float())
    learned = [t for t in scheme.parameters() if t.requires_grad]
    if learned:
        grads = torch.autograd.grad(got.sum(), learned, allow_unused=True)
        assert all(g is not None for g in grads)


def test_the_line_s_form_keeps_its_slopes_gradient():
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    form = linear_form(slopes, causal=False)
    assert form.name == "symmetric_linear" and tuple(form.params.shape) == (2, 1)
    distance_form_bias(form, torch.arange(-2, 3)).sum().backward()
    torch.testing.assert_close(slopes.grad, torch.tensor([-6.0, -6.0]))


BIAS_SPECS = [
    s for s in DISTANCE_SPECS if issubclass(relpos.SCHEMES[s["name"]], DistanceBiasScheme)
]


@pytest.mark.parametrize("spec", BIAS_SPECS, ids=spec_id)
def test_a_kv_cache_s_bias_reads_no_range(spec):
    """Queries and keys of two ``Positions`` (a KV cache's) promise no range of distances. Up to
    :data:`PAIRWISE_QUERIES` queries (decoding), and any number for a closed form, the bias is then
    evaluated per pair with no device sync; past that, a function with no closed form reads the
    range (one sync) for its table. Either way the numbers and the parameters' gradients are
    those of self-attention over the same keys (a table over the promised range)."""
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=4, causal=True)
    randomize_parameters(scheme, 5)
    keys = Positions.from_padding_mask(torch.tensor([[False] * 3 + [True] * 13, [True] * 16]))
    real = (keys.seg != -1)[:, None, None, :]  # padding keys' pairs are masked by every backend
    weights = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    q = torch.randn(2, 4, 16, 8)

    def bias_and_grads(queries: Positions, rows: slice) -> tuple[torch.Tensor, list]:
        scheme.zero_grad()
        bias = scheme.score_bias(q[:, :, rows], queries, keys)
        if queries is keys:
            bias = bias[:, :, rows]
        bias = torch.where(real, bias, 0.0)
        if bias.requires_grad:  # Sandwich has no parameters
            (bias * weights[:, :, rows]).sum().backward()
        return bias, [p.grad.clone() for p in scheme.parameters() if p.grad is not None]

    limit = PAIRWISE_QUERIES
    for n in (1, limit, limit + 1):
        rows = slice(16 - n, 16)
        want, want_grads = bias_and_grads(keys, rows)
        with SyncCalls() as syncs:
            got, got_grads = bias_and_grads(keys[16 - n :], rows)
        pairwise = scheme.closed_form or n <= limit
        assert syncs.calls == ([] if pairwise else ["tolist"]), n
        torch.testing.assert_close(got, want)
        assert len(got_grads) == len(want_grads) == sum(1 for _ in scheme.parameters())
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w)
