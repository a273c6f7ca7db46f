"""ALiBi's fused-kernel parts (``relpos.attention.chunked.alibi``): left/diagonal/right parts and
the keys they skip, against eager attention and against the bound's own claim."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import alibi as alibi_parts
from relpos.attention.chunked import chunked_path
from relpos.attention.chunked import parts as key_parts
from tests import oracles
from tests.test_backends import assert_same, run_case


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_parts_match_eager_across_blocks(causal, monkeypatch):
    """Small blocks, so every query block but the first has a left part (and a right part when
    bidirectional); outputs and gradients equal eager's."""
    monkeypatch.setattr(alibi_parts, "ALIBI_BLOCK", 32)
    n = 150
    pos = Positions.from_length(n)
    scheme = relpos.make_scheme("alibi", d_model=8, num_heads=2, causal=causal)
    assert chunked_path(scheme, torch.zeros(1, 2, n, 4), pos, pos) == "alibi"
    results, _ = run_case("chunked", {"name": "alibi"}, causal, "plain", n=n, seed=3)
    assert_same(results, atol=1e-9, rtol=1e-9)


def _steep_case(dtype: torch.dtype, causal: bool, n: int = 400, amp: float = 1.0):
    torch.manual_seed(0)
    h, d = 4, 8
    scheme = relpos.make_scheme("alibi", d_model=h * d, num_heads=h, causal=causal).to(dtype)
    # Steep heads become short windows; a zero slope must still see every key.
    scheme.slopes = torch.tensor([16.0, 4.0, 0.5, 0.0], dtype=dtype)
    q, k, v = (amp * torch.randn(2, h, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
    return scheme, q, k, v, Positions.from_length(n)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_skipped_keys_change_nothing(dtype, causal, monkeypatch):
    """Steep slopes: most keys of the steep heads are skipped, and outputs and gradients still
    equal eager's."""
    monkeypatch.setattr(alibi_parts, "ALIBI_BLOCK", 64)
    scheme, q, k, v, pos = _steep_case(dtype, causal)
    n = q.shape[-2]
    scale = q.shape[-1] ** -0.5
    reach = alibi_parts.alibi_reach(scheme.slopes, q.detach(), k.detach(), scale, 64)
    assert all(0 <= r[0] < 100 for r in reach)  # the steepest head: a short window
    assert all(r[3] == -1 for r in reach)  # slope 0: no bound
    calls = []  # (heads × keys) of each forward kernel call
    real = key_parts.flash

    def counting(q_, k_, *args, **kwargs):
        calls.append(k_.shape[1] * k_.shape[2])
        return real(q_, k_, *args, **kwargs)

    monkeypatch.setattr(key_parts, "flash", counting)
    grad_out = torch.randn_like(q)
    results = []
    for name in ("eager", "chunked"):
        out = BACKENDS[name](q, k, v, scheme, pos, pos, causal=causal)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    # Without skipping, block [i0, i1) gives every head i0 left keys (n - i1 right ones), and
    # its own block: the steep heads' windows must save more than a tenth of that.
    blocks = [(i0, min(n, i0 + 64)) for i0 in range(0, n, 64)]
    whole = 4 * sum(i1 if causal else n for _, i1 in blocks)
    assert sum(calls) < 0.9 * whole, (sum(calls), whole)
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(20, 260),
    block=st.sampled_from([16, 32, 64]),
    log_slope=st.floats(-4.0, 4.0),
    amp=st.floats(0.1, 4.0),
    adversarial=st.booleans(),
)
def test_reach_bound_holds_in_float32(seed, n, block, log_slope, amp, adversarial):
    """Every pair farther apart than the reach of its query's block has probability exactly 0 in
    float32 — also when each query's own logit is as low as the norms allow and far keys' as
    high (``adversarial``: all queries along one direction, keys along it or against it)."""
    g = torch.Generator().manual_seed(seed)
    h, d = 2, 8
    if adversarial:
        u = torch.nn.functional.normalize(torch.randn(h, 1, d, generator=g), dim=-1)
        sign = torch.randint(0, 2, (1, n, 1), generator=g) * 2.0 - 1.0
        q = (amp * u).expand(h, n, d).unsqueeze(0)
        k = (amp * sign * u).unsqueeze(0)
    else:
        q, k = (amp * torch.randn(1, h, n, d, generator=g) for _ in range(2))
    slopes = torch.tensor([2.0**log_slope, 2.0 ** (log_slope - 1)])
    scale = d**-0.5
    reach = alibi_parts.alibi_reach(slopes, q, k, scale, block)
    i = torch.arange(n)
    dist = (i.view(-1, 1) - i.view(1, -1)).abs().float()
    probs = torch.softmax(scale * q @ k.transpose(-1, -2) - slopes.view(1, -1, 1, 1) * dist, -1)
    for c in range(-(-n // block)):
        rows = slice(c * block, min(n, (c + 1) * block))
        for head in range(h):
            r = reach[c][head]
            assert r >= 0
            far = dist[rows] > r
            assert (probs[0, head, rows][far] == 0).all()


def test_reach_has_no_bound_for_infinite_norms():
    q = torch.full((1, 1, 4, 2), float("inf"))
    assert alibi_parts.alibi_reach(torch.tensor([1.0]), q, q, 1.0, 2) == [[-1], [-1]]


# ------------------------------------------------------------------ per-head slopes
def _oracle_case(spec: dict, causal: bool, backend: str, n: int = 40):
    """``backend``'s attention and the loop oracle's, for 4 heads over a packed row."""
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=4, causal=causal).double()
    pos = Positions.from_segments(
        torch.tensor([[0] * (n // 2) + [1] * (n - n // 2 - 3) + [-1] * 3])
    )
    q, k, v = (torch.randn(1, 4, n, 4, dtype=torch.float64) for _ in range(3))
    out = BACKENDS[backend](q, k, v, scheme, pos, pos, causal=causal)
    e = pos.expand(1)
    ref = oracles.attention(
        scheme,
        q,
        k,
        v,
        e.pos.tolist(),
        e.seg.tolist(),
        e.pos.tolist(),
        e.seg.tolist(),
        causal=causal,
    )
    return out, ref


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_custom_slopes_bias_only_the_heads_given(backend, causal):
    """Slopes (0.5, 0, 0.25, 0): heads 1 and 3 get no bias; every backend equals the oracle."""
    spec = {"name": "alibi", "slopes": [0.5, 0, 0.25, 0]}
    out, ref = _oracle_case(spec, causal, backend)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)
    none, _ = _oracle_case({"name": "alibi", "slopes": [0.0] * 4}, causal, backend)
    nope, _ = _oracle_case("nope", causal, backend)
    torch.testing.assert_close(none, nope)  # all slopes 0: no positions at all


def test_custom_slopes_take_the_fused_path_and_match_eager():
    spec = {"name": "alibi", "slopes": [0.5, 0.0]}
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True).double()
    pos = Positions.from_length(600)
    assert chunked_path(scheme, torch.zeros(1, 2, 600, 4), pos, pos) == "alibi"
    q, k, v = (torch.randn(1, 2, 600, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    outs = [BACKENDS[b](q, k, v, scheme, pos, pos, causal=True) for b in ("eager", "chunked")]
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-9)
    for g_chunked, g_eager in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_chunked, g_eager, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_learned_slopes_match_the_oracle_and_train(causal):
    spec = {"name": "learned_alibi", "slopes": [0.5, 0.1, 0.25, 1.0]}
    out, ref = _oracle_case(spec, causal, "eager")
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)
    attn = relpos.MultiheadAttention(16, 4, spec, causal=causal)
    attn(torch.randn(2, 7, 16)).square().sum().backward()
    assert attn.scheme.slopes.grad is not None and attn.scheme.slopes.grad.abs().sum() > 0
    assert torch.equal(attn.scheme.slopes.detach(), torch.tensor([0.5, 0.1, 0.25, 1.0]))


@pytest.mark.parametrize("heads", [None, [0, 2]], ids=["all-heads", "heads-0-2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_learned_slopes_take_the_fused_path_with_their_gradient(causal, heads, monkeypatch):
    """Trained slopes on ALiBi's fused parts: outputs and the gradients of q, k, v and the slopes
    equal eager's, across blocks, with steep heads skipping far keys and a zero slope."""
    monkeypatch.setattr(alibi_parts, "ALIBI_BLOCK", 32)
    spec = {"name": "learned_alibi", "slopes": [2.0, 0.3, 0.05, 0.0], "heads": heads}
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=4, causal=causal).double()
    n = 150
    pos = Positions.from_length(n)
    assert chunked_path(scheme, torch.zeros(1, 4, n, 8), pos, pos) == "alibi"
    q, k, v = (3 * torch.randn(2, 4, n, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    results = []
    for backend in ("eager", "chunked"):
        out = BACKENDS[backend](q, k, v, scheme, pos, pos, causal=causal)
        grads = torch.autograd.grad((out * out.sin()).sum(), (q, k, v, scheme.slopes))
        results.append((out, *grads))
    (eager, *eager_grads), (chunked, *chunked_grads) = results
    torch.testing.assert_close(chunked, eager, rtol=1e-9, atol=1e-9)
    for g_chunked, g_eager in zip(chunked_grads, eager_grads, strict=True):
        torch.testing.assert_close(g_chunked, g_eager, rtol=1e-9, atol=1e-9)
    dslope = eager_grads[-1]
    assert (dslope[[0, 2]].abs() > 1).all()  # the test sees the slopes' gradient
    if heads is not None:
        assert (dslope[[1, 3]] == 0).all()  # heads left out: no bias, no gradient


def test_slopes_config_round_trip_and_errors():
    config = relpos.ALiBiConfig(slopes=[1, 0.5])
    assert config.slopes == (1.0, 0.5)
    assert relpos.config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="slopes has 2 entries; the layer has 4 heads"):
        relpos.MultiheadAttention(16, 4, {"name": "alibi", "slopes": [1, 0.5]})
    with pytest.raises(ValueError, match=r"slopes\[1\] must be a finite number >= 0, got -1"):
        relpos.ALiBiConfig(slopes=[1, -1])
    for bad in (float("nan"), float("inf")):  # every output would be NaN
        for config in (relpos.ALiBiConfig, relpos.LearnedALiBiConfig):
            with pytest.raises(
                ValueError, match=rf"slopes\[0\] must be a finite number >= 0, got {bad}"
            ):
                config(slopes=[bad, 0.5])
    with pytest.raises(ValueError, match="slopes must be a non-empty list"):
        relpos.LearnedALiBiConfig(slopes=[])
