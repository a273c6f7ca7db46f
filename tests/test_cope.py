"""CoPE, contextual position encoding (Golovneva et al., 2024): the loop oracle (outputs and
gradients) on padded, packed, interleaved-segment, cached and cross-attention positions; what the
contextual positions count; every backend that runs it equal to ``eager``, the others refusing it
and ``auto`` never picking them; the causal-only and config errors. The shared suites
(``SCHEME_SPECS``) run one spec through the oracle and conformance (padded, packed, cached,
compile, gradcheck) and the fuzz."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import KVCache, Positions
from relpos.attention.auto import SDPA_MASK_BUDGET, choose_backend, sdpa_mask_bytes
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_attention, chunked_supports
from relpos.attention.flex import flex_supports
from relpos.attention.sdpa import sdpa_supports
from relpos.functional import cope_logits, cope_positions
from tests import oracles
from tests.helpers import gqa_and_repeated, randomize_parameters
from tests.test_backends import LAYOUTS, assert_same, run_case
from tests.test_oracle import check_against_oracle

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]

FEW = settings(max_examples=6, deadline=None, derandomize=True, database=None)


@st.composite
def configs(draw) -> dict:
    """A table short enough that the positions of short sequences reach its clamp."""
    return {"name": "cope", "npos_max": draw(st.integers(1, 8)), "per_head": draw(st.booleans())}


def make(spec, h: int = 2, d: int = 4) -> relpos.CoPE:
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=True).double()
    randomize_parameters(scheme)
    return scheme


# ------------------------------------------------------------------------------ the paper's formula
@FEW
@given(spec=configs(), seed=st.integers(0, 2**16), plain=st.booleans(), cached=st.booleans())
def test_matches_the_loop_oracle(spec, seed, plain, cached):
    """``eager`` equals the loop over (i, j, t) of ``q·k/√d + q·e[Σ_{t=j}^{i} σ(q·k_t/√d)]``,
    outputs and gradients (q, k, v, the table), on padded and packed rows or plain ones, every
    query or the last few (a KV cache)."""
    check_against_oracle(spec, True, seed, plain=plain and not cached, cached=cached)


def check_positions(scheme: relpos.CoPE, qp: Positions, kp: Positions, seed: int) -> None:
    """``eager`` against the loop oracle, outputs and gradients, for any query and key positions
    (the oracle counts keys by position, never by their place along the key axis)."""
    torch.manual_seed(seed)
    b, h, d = max(qp.batch, kp.batch), scheme.num_heads, scheme.head_dim
    q = torch.randn(b, h, len(qp), d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, len(kp), d, dtype=torch.float64, requires_grad=True) for _ in "kv")
    out = relpos.eager_attention(q, k, v, scheme, qp, kp, causal=True)
    qe, ke = qp.expand(b), kp.expand(b)
    ref = oracles.attention(
        scheme, q, k, v, qe.pos.tolist(), qe.seg.tolist(), ke.pos.tolist(), ke.seg.tolist(),
        causal=True,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    inputs = [q, k, v, scheme.pos_emb]
    g_out = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    g_ref = torch.autograd.grad(ref + 0.0 * q.sum(), inputs, grad, allow_unused=True)
    for name, a, r in zip("q k v table".split(), g_out, g_ref, strict=True):
        if r is None:
            assert a is None or torch.count_nonzero(a) == 0, name
        else:
            torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6, msg=f"gradient of {name}")


def interleaved(rng: random.Random, b: int, n: int, docs: int = 3) -> torch.Tensor:
    """Segment ids with documents interleaved token by token, and padding anywhere."""
    return torch.tensor([[rng.randint(-1, docs - 1) for _ in range(n)] for _ in range(b)])


@FEW
@given(spec=configs(), seed=st.integers(0, 2**16))
def test_interleaved_segments_match_the_oracle(spec, seed):
    """Documents interleaved along the row: each query counts only its own document's keys, which
    lie in position order along the key axis, so the reverse sum is the paper's."""
    rng = random.Random(seed)
    ids = interleaved(rng, rng.randint(1, 2), rng.randint(1, 12))
    pos = Positions.from_segments(ids, offset=rng.randint(0, 3))
    check_positions(make(spec, h=rng.randint(1, 3)), pos, pos, seed)


@FEW
@given(spec=configs(), seed=st.integers(0, 2**16))
def test_cross_attention_matches_the_oracle(spec, seed):
    """Queries and keys of different rows of tokens (cross-attention): segment s of the queries
    counts the context of segment s up to its own position."""
    rng = random.Random(seed)
    b = rng.randint(1, 2)
    qp = Positions.from_segments(interleaved(rng, b, rng.randint(1, 7)), offset=rng.randint(0, 4))
    kp = Positions.from_segments(interleaved(rng, b, rng.randint(1, 9)))
    check_positions(make(spec), qp, kp, seed)


def test_interleaved_documents_equal_each_document_alone():
    """A packed row with its documents interleaved (and padding between them) gives every document
    what it gets alone, on every backend that runs CoPE."""
    scheme = make({"name": "cope", "npos_max": 5})
    ids = torch.tensor([[0, 1, 0, -1, 1, 1, 0, 2, 0, -1, 2, 0]])
    pos = Positions.from_segments(ids)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64) for _ in "qkv")
    for name in ("eager", "sdpa", "auto"):
        out = BACKENDS[name](q, k, v, scheme, pos, pos, causal=True)
        for doc in range(3):
            idx = (ids[0] == doc).nonzero().flatten()
            alone = Positions.from_length(len(idx))
            one = [t[:, :, idx] for t in (q, k, v)]
            ref = BACKENDS["eager"](*one, scheme, alone, alone, causal=True)
            torch.testing.assert_close(out[:, :, idx], ref, rtol=1e-12, atol=1e-12)
        assert torch.all(out[:, :, ids[0] == -1] == 0)


# ------------------------------------------------------------------------------ what CoPE counts
def test_gates_that_open_count_tokens_and_gates_that_close_skip_them():
    """With ``σ(q·k_t/√d)`` saturated at 1 for marked keys and 0 for the others, ``p_ij`` is the
    number of marked keys from ``j`` to ``i`` (every key marked: ``p_i - p_j + 1``, the relative
    position), clamped to ``npos_max - 1``; the count restarts at each document."""
    u = torch.ones(4, dtype=torch.float64)
    marked = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    k = torch.where(marked[:, None], 100.0 * u, -100.0 * u)[None, None]  # (1, 1, 10, 4)
    q = u.expand(1, 1, 10, 4)
    ids = torch.tensor([[0] * 6 + [1] * 4])
    pos = Positions.from_segments(ids)
    allowed = pos.allowed(pos, causal=True)
    p = cope_positions(q, k, allowed, npos_max=4)[0, 0]
    for i in range(10):
        for j in range(10):
            if allowed[0, i, j]:
                assert abs(p[i, j] - min(int(marked[j : i + 1].sum()), 3)) < 1e-12, (i, j)
    every = cope_positions(q, 100.0 * u.expand(1, 1, 10, 4), allowed, npos_max=64)[0, 0]
    expected = pos.pos[0][:, None] - pos.pos[0][None] + 1
    torch.testing.assert_close(every[allowed[0]], expected[allowed[0]].double())


def test_the_term_interpolates_the_table_between_integer_rows():
    """``cope_logits = (1 - w)·q·e[⌊p⌋] + w·q·e[⌈p⌉]`` at the positions ``cope_positions`` gives;
    at an integer (the clamp) it is ``q·e[p]``."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in "qk")
    table = torch.randn(3, 3, 4, generator=g, dtype=torch.float64)
    allowed = Positions.from_length(5).allowed(causal=True)
    p = cope_positions(q, k, allowed, npos_max=3)
    z = q @ table.transpose(-1, -2)
    lo, hi = p.floor().long(), p.ceil().long()
    w = p - p.floor()
    expected = (1 - w) * z.gather(-1, lo) + w * z.gather(-1, hi)
    torch.testing.assert_close(cope_logits(q, k, allowed, table), expected)
    assert (p[allowed.expand_as(p)] == 2).any()  # the clamp is reached


def test_key_bias_is_float32_and_the_table_starts_at_zero():
    scheme = relpos.make_scheme("cope", d_model=8, num_heads=2, causal=True)
    assert scheme.pos_emb.shape == (64, 4) and torch.all(scheme.pos_emb == 0)
    per_head = relpos.make_scheme(
        {"name": "cope", "npos_max": 5, "per_head": True}, d_model=8, num_heads=2, causal=True
    )
    assert per_head.pos_emb.shape == (2, 5, 4)
    pos = Positions.from_padding_mask(torch.tensor([[False, True, True], [True] * 3]))
    q, k = (torch.randn(2, 2, 3, 4, dtype=torch.bfloat16) for _ in "qk")
    for s in (scheme, per_head):
        bias = s.to(torch.bfloat16).key_bias(q, k, pos, pos)
        assert bias.shape == (2, 2, 3, 3) and bias.dtype == torch.float32
    assert scheme.hooks == {"key_bias"}


# ------------------------------------------------------------------------------ backends
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
@pytest.mark.parametrize("spec", [{"name": "cope", "npos_max": 6, "per_head": True}], ids=["cope"])
def test_every_backend_that_runs_it_matches_eager(backend, spec, layout):
    """Outputs and gradients (q, k, v, the table), float64, plain, padded, packed and cached."""
    results, _ = run_case(backend, spec, True, layout)
    assert_same(results, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_float32_matches_eager(backend):
    results, _ = run_case(backend, {"name": "cope", "npos_max": 6}, True, "packed", n=40,
                          dtype=torch.float32)  # fmt: skip
    assert_same(results, atol=1e-5, rtol=1e-5)


def test_chunked_and_flex_refuse_it_and_auto_never_picks_them():
    scheme = relpos.make_scheme("cope", d_model=8, num_heads=2, causal=True)
    assert not chunked_supports(scheme) and sdpa_supports(scheme)
    assert not flex_supports(scheme, device=torch.device("cpu"))
    q = torch.randn(1, 2, 6, 4)
    pos = Positions.from_length(6)
    with pytest.raises(ValueError, match="key bias of scheme CoPE"):
        chunked_attention(q, q, q, scheme, pos, pos, causal=True)
    with pytest.raises(ValueError, match="key bias of scheme CoPE"):
        relpos.MultiheadAttention(8, 2, "cope", causal=True, backend="chunked")(
            torch.randn(1, 6, 8)
        )
    # Short, long, padded past the sdpa mask budget; with and without gradients or dropout.
    long = 4096
    padded = Positions.from_padding_mask(torch.ones(4, long, dtype=torch.bool))
    big_q = torch.randn(4, 2, long, 4)
    assert sdpa_mask_bytes(scheme, big_q, padded, padded) > SDPA_MASK_BUDGET
    cases = [(q, pos), (torch.randn(1, 2, long, 4), Positions.from_length(long)), (big_q, padded)]
    for x, p in cases:
        for grad in (False, True):
            for training in (False, True):
                pick = choose_backend(
                    scheme, x, p, p, needs_grad=grad, dropout_p=0.1, training=training, causal=True
                )
                assert pick == "sdpa"


def test_gqa_and_cached_decoding():
    """Grouped-query attention equals multi-head attention with repeated key/value weights, and
    decoding it with a cache (a left-padded prompt, then one token at a time) equals the full
    forward pass: the cache holds the keys the gates count."""
    spec = {"name": "cope", "npos_max": 5}
    gqa, full = gqa_and_repeated(spec, 1, True, "auto", d_model=16, num_heads=4)
    x = torch.randn(2, 9, 16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        ref = gqa(x, padding_mask=mask)
        torch.testing.assert_close(ref, full(x, padding_mask=mask), atol=2e-5, rtol=2e-5)
        cache = KVCache()
        steps = [gqa(x[:, :4], padding_mask=mask[:, :4], cache=cache)]
        steps += [gqa(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------ errors
def test_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match=r"cope needs causal=True"):
        relpos.make_scheme("cope", d_model=8, num_heads=2, causal=False)
    with pytest.raises(ValueError, match=r"causal=True"):
        relpos.MultiheadAttention(8, 2, "cope", causal=False)
    cfg = relpos.TransformerConfig(vocab_size=5, d_model=8, num_heads=2, num_layers=1,
                                   causal=False, scheme="cope")  # fmt: skip
    with pytest.raises(ValueError, match=r"causal=True"):
        relpos.Transformer(cfg)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"npos_max": 0}, ValueError, "npos_max must be >= 1"),
        ({"npos_max": 2.0}, TypeError, "npos_max must be an int"),
        ({"npos_max": True}, TypeError, "npos_max must be an int"),
        ({"per_head": 1}, TypeError, "per_head must be a bool"),
    ],
)
def test_bad_config_names_the_field(fields, error, match):
    with pytest.raises(error, match=match):
        relpos.CoPEConfig(**fields)


def test_config_round_trip_and_unknown_keys():
    config = relpos.CoPEConfig(npos_max=8, per_head=True)
    assert relpos.config_from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['npos'\]"):
        relpos.config_from_dict({"name": "cope", "npos": 8})


def test_bench_runs_it_on_eager_and_sdpa_causal_only():
    from relpos.cli import bench

    assert "cope" in bench.SCHEMES
    assert bench._supported("eager", "cope") and bench._supported("sdpa", "cope")
    assert not bench._supported("chunked", "cope")
    assert not bench._supported("eager", "cope", causal=False)
    s = bench.make_setup("cope", 8, 1, causal=True, heads=2, head_dim=4, device="cpu",
                         dtype=torch.float32, grad=True)  # fmt: skip
    out = bench.IMPLEMENTATIONS["sdpa"].run(s)
    assert out.shape == (1, 2, 8, 4) and math.isfinite(out.sum().item())
