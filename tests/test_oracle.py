"""Every scheme's attention, outputs and gradients, against the slow loop oracle (random shapes)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import Positions
from tests import oracles
from tests.helpers import (
    SCHEME_SPECS,
    causal_only,
    contextual,
    random_segments,
    randomize_parameters,
    spec_id,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: Random shapes per (spec, causal, layout): 96 such cells share the work, so each draws a third
#: of the profile's examples (5 by default, 66 under the ``thorough`` profile).
ORACLE_EXAMPLES = max(5, settings.default.max_examples // 3)


def fast_attention(scheme, q, k, v, qp, kp, causal):
    q, k = scheme.rotate(q, k, qp, kp)
    return relpos.eager_attention(q, k, v, scheme, qp, kp, causal=causal)


def check_against_oracle(
    spec: dict, causal: bool, seed: int, *, cached: bool = False, plain: bool = False
) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, h, d = rng.randint(1, 2), rng.randint(1, 3), 2 * rng.randint(2, 4)
    n = rng.randint(1, 9)
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal).double()
    randomize_parameters(scheme, seed)
    seg = torch.tensor([random_segments(rng, n) for _ in range(b)])
    kp = Positions.from_segments(seg, offset=torch.tensor([rng.randint(0, 5) for _ in range(b)]))
    if plain:  # one contiguous sequence per row: the fast paths (e.g. the skew) apply
        kp = Positions.from_length(n, offset=rng.randint(0, 5))
    # A contextual scheme (the forget gate) reads the keys' layer inputs x (b, n, d_model).
    x = None
    if contextual(spec):
        x = torch.randn(b, n, h * d, dtype=torch.float64, requires_grad=True)
        kp = scheme.contextualize(x, kp)
    # Queries: all keys (self-attention), or the last few (a KV cache holding earlier keys).
    qp = kp[n - rng.randint(1, n) :] if cached else kp
    i = len(qp)
    q = torch.randn(b, h, i, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True)
    params = [p for p in scheme.parameters()] + ([] if x is None else [x])

    out = fast_attention(scheme, q, k, v, qp, kp, causal)
    qe, ke = qp.expand(b), kp.expand(b)  # plain positions have batch 1 and broadcast
    ref = oracles.attention(
        scheme,
        q,
        k,
        v,
        qe.pos.tolist(),
        qe.seg.tolist(),
        ke.pos.tolist(),
        ke.seg.tolist(),
        causal=causal,
        x=x,
    )
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    ref = ref + 0.0 * q.sum()  # keep a graph when every query is padding (all-zero output)

    grad_out = torch.randn_like(out)
    inputs = [q, k, v, *params]
    g_fast = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    g_ref = torch.autograd.grad(ref, inputs, grad_out, allow_unused=True)
    for name, a, r in zip(
        ["q", "k", "v", *[f"param{j}" for j in range(len(params))]], g_fast, g_ref, strict=True
    ):
        if r is None:
            assert a is None or torch.count_nonzero(a) == 0, name
        else:
            torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6, msg=f"gradient of {name}")


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("plain", [True, False], ids=["plain", "padded-packed"])
@settings(max_examples=ORACLE_EXAMPLES)
@given(seed=st.integers(0, 2**16))
@pytest.mark.matrix
def test_attention_matches_oracle(spec, causal, plain, seed):
    if not causal and causal_only(spec):
        pytest.skip("causal only (its own test file checks the refusal)")
    check_against_oracle(spec, causal, seed, plain=plain)


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@settings(max_examples=ORACLE_EXAMPLES)
@given(seed=st.integers(0, 2**16))
@pytest.mark.matrix
def test_cached_queries_match_oracle(spec, seed):
    """Fewer queries than keys (a KV cache), each at its own position."""
    check_against_oracle(spec, True, seed, cached=True)


@pytest.mark.parametrize(
    "spec", [s for s in SCHEME_SPECS if s["name"] in ("sinusoidal", "learned")], ids=spec_id
)
def test_embedding_matches_oracle(spec):
    scheme = relpos.make_scheme(spec, d_model=12, num_heads=1, causal=False)
    seg = torch.tensor([[0, 0, 0, 1, 1, -1], [-1, -1, 0, 0, 0, 0]])
    pos = Positions.from_segments(seg, offset=torch.tensor([3, 0]))
    out = scheme.embed(pos)
    assert out.shape == (2, 6, 12) and out.dtype == torch.float32
    for b in range(2):
        for t in range(6):
            expected = oracles.embedding(scheme, int(pos.pos[b, t])).to(out.dtype)
            torch.testing.assert_close(out[b, t], expected, rtol=1e-5, atol=1e-5)
