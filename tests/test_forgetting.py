"""The Forgetting Transformer's forget gate (Lin et al., 2025): logits
``q_i·k_j/√d + Σ_{l=j+1}^{i} log f_l`` with ``f_l = σ(w_h·x_l + b_h)`` from each token's layer
input, summed over its own sequence.

The loop oracle (``tests/oracles.forget_sum``) writes the sum over ``l`` out; every backend that
runs the scheme equals ``eager`` (outputs and gradients of q, k, v, the gate and x), on plain,
padded, packed and cached layouts. The shared suites (oracle, conformance) run the spec too.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import relpos
from relpos import MultiheadAttention, Positions, Transformer, TransformerConfig
from relpos.attention.auto import choose_backend
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_attention, chunked_path
from relpos.attention.chunked import decay as decay_parts
from relpos.attention.flex import flex_available, flex_supports
from tests import oracles
from tests.helpers import gqa_and_repeated, random_segments, randomize_parameters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SPEC = {"name": "forgetting"}
LAYOUTS = ["plain", "offset", "left-pad", "right-pad", "packed", "cached", "cached-plain"]
FAST = ["sdpa", "chunked", "chunked-tiles", "auto"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_scheme(h: int, d: int, dtype=torch.float64, seed: int = 0) -> relpos.ForgetGate:
    scheme = relpos.make_scheme(SPEC, d_model=h * d, num_heads=h, causal=True).to(dtype)
    randomize_parameters(scheme, seed)
    return scheme


def base_layout(layout: str, rng: random.Random, b: int, n: int) -> tuple[Positions, int]:
    """``(positions of all n tokens, m)``: the last ``m`` tokens are the queries (``m < n`` for a
    KV cache, whose prefix is left-padded in ``cached``)."""
    if layout in ("plain", "offset"):
        return Positions.from_length(n, offset=rng.randint(1, 7) if layout == "offset" else 0), n
    if layout in ("left-pad", "right-pad", "cached"):
        mask = torch.ones(b, n, dtype=torch.bool)
        for r in range(b):
            pad = rng.randint(1 if r == 0 else 0, n // 2)
            if layout == "right-pad":
                mask[r, n - pad :] = False
            else:
                mask[r, :pad] = False
        m = rng.randint(1, n // 3) if layout == "cached" else n
        if layout == "cached":
            mask[:, n - m :] = True  # the new tokens are real
        return Positions.from_padding_mask(mask), m
    if layout == "packed":
        return Positions.from_segments(torch.tensor([random_segments(rng, n) for _ in range(b)])), n
    return Positions.from_length(n), rng.randint(1, n // 3)  # cached-plain


def contextualized(scheme, x: Tensor, base: Positions, m: int):
    """``(q_positions, k_positions)`` as ``MultiheadAttention`` builds them: with a cache, the
    prefix in one call and the last ``m`` tokens in the next (continuing the cached sums)."""
    n = x.shape[1]
    if m == n:
        kp = scheme.contextualize(x, base)
        return kp, kp
    cached = scheme.contextualize(x[:, : n - m], base[: n - m])
    new = Positions(base.pos[:, n - m :], base.seg[:, n - m :])  # not contiguous: a cache's
    qp = scheme.contextualize(x[:, n - m :], new, cached)
    return qp, cached.cat(qp)


def call(name: str, q, k, v, scheme, qp, kp):
    if name == "chunked-tiles":
        return chunked_attention(
            q, k, v, scheme, qp, kp, causal=True, path="tiles", q_block=3, k_block=5
        )
    return BACKENDS[name](q, k, v, scheme, qp, kp, causal=True)


def case(layout: str, seed: int, *, dtype=torch.float64, n: int | None = None):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, h, d = rng.randint(1, 3), rng.randint(1, 3), 2 * rng.randint(1, 3)
    n = rng.randint(6, 14) if n is None else n
    scheme = make_scheme(h, d, dtype, seed)
    base, m = base_layout(layout, rng, b, n)
    x = torch.randn(b, n, h * d, dtype=dtype, requires_grad=True)
    q = torch.randn(b, h, m, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, h, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    return scheme, base.expand(b), m, x, q, k, v


def outputs_and_grads(backend: str, scheme, base, m, x, q, k, v, grad_out=None):
    qp, kp = contextualized(scheme, x, base, m)
    out = call(backend, q, k, v, scheme, qp, kp)
    grad_out = torch.randn_like(out) if grad_out is None else grad_out
    inputs = [q, k, v, x, *scheme.parameters()]
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return out, grads, grad_out


def assert_same(a, b, tol):
    (out_a, g_a), (out_b, g_b) = a, b
    torch.testing.assert_close(out_a, out_b, atol=tol, rtol=tol)
    names = ["q", "k", "v", "x", "gate.weight", "gate.bias"]
    for name, ga, gb in zip(names, g_a, g_b, strict=True):
        if ga is None or gb is None:
            for g in (ga, gb):
                assert g is None or torch.count_nonzero(g) == 0, name
        else:
            torch.testing.assert_close(
                ga, gb, atol=tol, rtol=tol, msg=lambda s, n=name: f"{n}: {s}"
            )


# ----------------------------------------------------------------------------- the oracle
@settings(max_examples=8)
@given(seed=st.integers(0, 2**16), layout=st.sampled_from(LAYOUTS))
def test_eager_matches_the_loop_oracle(seed, layout):
    """Outputs and gradients (q, k, v, x through the gates, the gate's weight and bias)."""
    scheme, base, m, x, q, k, v = case(layout, seed, n=random.Random(seed).randint(4, 9))
    out, grads, grad_out = outputs_and_grads("eager", scheme, base, m, x, q, k, v)
    n = x.shape[1]
    qb, kb = base[n - m :], base
    ref = oracles.attention(
        scheme, q, k, v, qb.pos.tolist(), qb.seg.tolist(), kb.pos.tolist(), kb.seg.tolist(),
        causal=True, x=x,
    )  # fmt: skip
    ref = ref + 0.0 * (q.sum() + x.sum())  # a graph even when every query is padding
    g_ref = torch.autograd.grad(
        ref, [q, k, v, x, *scheme.parameters()], grad_out, allow_unused=True
    )
    assert_same((out, grads), (ref, g_ref), 1e-9)


def test_the_bias_is_the_sum_of_log_gates_between_key_and_query():
    """``score_bias`` entry by entry, from the formula: a packed, padded row."""
    scheme = make_scheme(2, 2)
    seg = torch.tensor([[-1, 0, 0, 0, 1, 1, -1, 1]])  # padding between a document's tokens too
    base = Positions.from_segments(seg)
    x = torch.randn(1, 8, 4, dtype=torch.float64)
    p = scheme.contextualize(x, base)
    bias = scheme.score_bias(torch.zeros(1, 2, 8, 2, dtype=torch.float64), p, p)
    log_f = torch.nn.functional.logsigmoid(scheme.gate(x))[0]  # (n, h)
    pos, segs = base.pos[0].tolist(), seg[0].tolist()
    for h in range(2):
        for i in range(8):
            for j in range(8):
                if segs[i] == segs[j] != -1 and pos[j] <= pos[i]:
                    want = sum(
                        log_f[t, h].item()
                        for t in range(8)
                        if segs[t] == segs[i] and pos[j] < pos[t] <= pos[i]
                    )
                    assert bias[0, h, i, j].item() == pytest.approx(want, abs=1e-12)
    assert torch.all(p.log_decay[0, [0, 6]] == 0)  # padding: 0, whatever its gate


# ----------------------------------------------------------------------------- backends
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", FAST)
def test_backend_matches_eager(backend, layout):
    seed = LAYOUTS.index(layout) * 7 + FAST.index(backend)
    scheme, base, m, x, q, k, v = case(layout, seed)
    out, grads, grad_out = outputs_and_grads("eager", scheme, base, m, x, q, k, v)
    got, g, _ = outputs_and_grads(backend, scheme, base, m, x, q, k, v, grad_out)
    assert_same((got, g), (out, grads), 1e-9)


def test_backend_matches_eager_float32():
    scheme, base, m, x, q, k, v = case("packed", 3, dtype=torch.float32, n=40)
    ref = outputs_and_grads("eager", scheme, base, m, x, q, k, v)
    for backend in FAST:
        got, g, _ = outputs_and_grads(backend, scheme, base, m, x, q, k, v, ref[2])
        assert got.dtype == torch.float32
        assert_same((got, g), ref[:2], 2e-5)


def test_fused_parts_match_eager_across_blocks(monkeypatch):
    """Plain positions take ``chunked``'s fused forget-gate parts; with 4-query blocks every block
    but the first has a left part: outputs and the gradients of q, k, v, the layer input and the
    gate's weights equal eager's."""
    monkeypatch.setattr(decay_parts, "DECAY_BLOCK", 4)
    scheme, base, m, x, q, k, v = case("plain", 5, n=30)
    qp, kp = contextualized(scheme, x, base, m)
    assert chunked_path(scheme, q, qp, kp) == "decay"
    out, grads, grad_out = outputs_and_grads("eager", scheme, base, m, x, q, k, v)
    got, g, _ = outputs_and_grads("chunked", scheme, base, m, x, q, k, v, grad_out)
    assert_same((got, g), (out, grads), 1e-9)
    assert torch.count_nonzero(g[3]) > 0  # the gates get a gradient through the parts


def test_auto_takes_the_fused_parts_past_small_sequences():
    scheme = make_scheme(2, 4, torch.float32)
    for n, want in ((256, "sdpa"), (1024, "chunked")):
        p = scheme.contextualize(torch.randn(1, n, 8), Positions.from_length(n))
        q = torch.zeros(1, 2, n, 4)
        assert chunked_path(scheme, q, p, p) == "decay"
        assert choose_backend(scheme, q, p, p, needs_grad=False) == want


def test_fused_parts_keep_float32_precision_on_a_long_row():
    """1024 tokens of strong forgetting (``c`` far below -100): the float32 fused parts equal a
    float64 eager reference, outputs and gradients."""
    torch.manual_seed(0)
    h, d, n = 2, 8, 1024
    scheme = make_scheme(h, d, torch.float32)
    with torch.no_grad():
        scheme.gate.bias.fill_(-0.3)
    x = torch.randn(1, n, h * d, requires_grad=True)
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, h, n, d)
    results = []
    for backend, dtype in (("eager", torch.float64), ("chunked", torch.float32)):
        s = scheme.to(dtype)
        p = s.contextualize(x.to(dtype), Positions.from_length(n))
        assert p.log_decay.min() < -100
        out = BACKENDS[backend](*(t.to(dtype) for t in (q, k, v)), s, p, p, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v, x), grad_out.to(dtype))))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=2e-5, rtol=2e-4)


def test_flex_support_is_declared():
    scheme = make_scheme(2, 4, torch.float32)
    assert flex_supports(scheme) == flex_available()
    assert not flex_supports(scheme, needs_grad=True)  # CPU: inference only


@pytest.mark.slow
@pytest.mark.skipif(not flex_available(), reason="no FlexAttention")
def test_flex_matches_eager_without_gradients():
    """CPU: compiled for inference (tens of seconds to compile)."""
    scheme, base, m, x, q, k, v = case("cached", 5, dtype=torch.float32, n=20)
    q, k, v = (t.detach() for t in (q, k, v))  # FlexAttention on CPU refuses requires_grad inputs
    with torch.no_grad():
        qp, kp = contextualized(scheme, x, base, m)
        ref = call("eager", q, k, v, scheme, qp, kp)
        out = call("flex", q, k, v, scheme, qp, kp)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["plain", "packed", "cached"])
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "auto", "flex"])
def test_cuda_backends_match_eager(backend, layout):
    """On a GPU, gradients included (flex differentiates the captured per-token values)."""
    if backend == "flex" and not flex_available():
        pytest.skip("no FlexAttention")
    scheme, base, m, x, q, k, v = case(layout, 11, dtype=torch.float32, n=150)
    moved = [t.detach().cuda().requires_grad_(True) for t in (x, q, k, v)]
    scheme, base = scheme.cuda(), base.to("cuda")
    x, q, k, v = moved
    ref = outputs_and_grads("eager", scheme, base, m, x, q, k, v)
    got, g, _ = outputs_and_grads(backend, scheme, base, m, x, q, k, v, ref[2])
    assert_same((got, g), ref[:2], 1e-4)


# ----------------------------------------------------------------------------- the sums
def test_sums_restart_per_document_and_skip_padding():
    """A packed, padded row gives each document the values it has alone (to float64 rounding:
    the row's running sum less its value where the document starts)."""
    x = torch.randn(1, 9, 6, dtype=torch.float64)
    scheme = make_scheme(3, 2)
    seg = torch.tensor([[-1, 0, 0, 1, 1, 1, -1, 2, 2]])
    packed = scheme.contextualize(x, Positions.from_segments(seg)).log_decay[0]
    for s in range(3):
        alone = scheme.contextualize(
            x[:, seg[0] == s], Positions.from_length(int((seg == s).sum()))
        )
        torch.testing.assert_close(packed[seg[0] == s], alone.log_decay[0], atol=1e-12, rtol=0)


def test_sums_follow_positions_not_array_order():
    """Hand-made positions out of row order: the sum runs in position order."""
    log_f = -torch.rand(1, 4, 1, dtype=torch.float64)
    p = Positions(torch.tensor([[2, 0, 3, 1]]), torch.zeros(1, 4, dtype=torch.long))
    c = p.with_log_decay(log_f).log_decay[0, :, 0]
    order = [1, 3, 0, 2]  # tokens by position
    want = log_f[0, order, 0].cumsum(0)
    torch.testing.assert_close(c[order], want)


def test_non_finite_gates_stay_in_their_document():
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    x[0, 1] = float("nan")
    scheme = make_scheme(2, 2)
    p = scheme.contextualize(x, Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1, -1]])))
    assert torch.isnan(p.log_decay[0, 1:3]).all() and torch.isfinite(p.log_decay[0, 0]).all()
    assert torch.isfinite(p.log_decay[0, 3:]).all()
    x[0, 1] = 0.0
    x[0, 5] = float("nan")  # padding: ignored
    p = scheme.contextualize(x, Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1, -1]])))
    assert torch.isfinite(p.log_decay).all()


@pytest.mark.parametrize("chunks", [[1] * 7, [3, 0, 4], [2, 5]])
def test_cache_continues_each_rows_sum(chunks):
    """Decoding by one token, by chunks (an empty one too): the cached positions carry every
    token's sum, and a left-padded prompt continues from its own last token."""
    scheme = make_scheme(2, 3)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    mask = torch.tensor([[False, False] + [True] * 7, [True] * 9])
    full = scheme.contextualize(x, Positions.from_padding_mask(mask)).log_decay
    prompt = scheme.contextualize(x[:, :2], Positions.from_padding_mask(mask[:, :2]))
    cached, t = prompt, 2
    for size in chunks:
        step = scheme.contextualize(x[:, t : t + size], cached.continued(size), cached)
        cached, t = cached.cat(step), t + size
    torch.testing.assert_close(cached.log_decay, full, atol=1e-12, rtol=0)


def test_a_long_row_keeps_float32_precision():
    """4096 tokens of strong forgetting (``c`` reaches about -3000): the float32 model's bias for
    the last 64 queries equals a float64 reference within 1e-6·(1 + |D|), where a float32 running
    sum would be off by ~1e-3 for nearby keys."""
    n, h = 4096, 2
    torch.manual_seed(0)
    scheme = make_scheme(h, 4, torch.float32)
    with torch.no_grad():
        scheme.gate.bias.fill_(-0.3)
    x = torch.randn(1, n, 8)
    p = scheme.contextualize(x, Positions.from_length(n))
    bias = scheme.score_bias(torch.zeros(1, h, 64, 4), p[n - 64 :], p)  # (1, h, 64, n) float32
    assert bias.dtype == torch.float32
    # Reference: the same float32 gate logits, log σ and the sums in float64.
    logits = torch.nn.functional.linear(x, scheme.gate.weight, scheme.gate.bias).double()
    c = torch.nn.functional.logsigmoid(logits)[0].cumsum(0).T  # (h, n)
    ref = c[:, n - 64 :, None] - c[:, None, :]
    allowed = p[n - 64 :].allowed(p, causal=True)[0]
    assert c[:, -1].max() < -2000
    err = ((bias[0].double() - ref).abs() / (1 + ref.abs()))[:, allowed]
    assert err.max() < 1e-6
    naive = torch.nn.functional.logsigmoid(logits.float())[0].cumsum(0).T  # float32 sums
    naive_bias = naive[:, n - 64 :, None] - naive[:, None, :]
    assert ((naive_bias.double() - ref).abs() / (1 + ref.abs()))[:, allowed].max() > 1e-5


# ----------------------------------------------------------------------------- the layer
def test_grouped_query_attention_equals_repeated_heads():
    gqa, full = gqa_and_repeated(SPEC, 1, True, "auto", d_model=12, num_heads=3)
    x = torch.randn(2, 7, 12)
    seg = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [0] * 7])
    with torch.no_grad():
        torch.testing.assert_close(gqa(x, segment_ids=seg), full(x, segment_ids=seg))


def test_layer_gradients_reach_the_gates_and_the_input():
    torch.manual_seed(0)
    attn = MultiheadAttention(8, 2, SPEC, causal=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    attn(
        x, padding_mask=torch.tensor([[True] * 5, [False, True, True, True, True]])
    ).sum().backward()
    assert (
        attn.scheme.gate.weight.grad.abs().sum() > 0 and attn.scheme.gate.bias.grad.abs().sum() > 0
    )
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[1, 0] == 0)


def test_memory_carries_no_gradient():
    """Transformer-XL's stop-gradient memory detaches the cached sums too."""
    cfg = TransformerConfig(vocab_size=7, d_model=8, num_heads=2, num_layers=2, scheme=SPEC)
    m = Transformer(cfg).train()
    tokens = torch.randint(0, 7, (2, 8))
    memory = m.new_memory(mem_len=16)
    m(tokens[:, :4], cache=memory).square().mean().backward()
    assert not any(c.positions.log_decay.requires_grad for c in memory)
    m(tokens[:, 4:], cache=memory).square().mean().backward()


def test_mixed_layers_and_packed_rows():
    """FoX in one layer, RoPE in the other (the paper's "Pro" blocks keep no RoPE; any mix runs)."""
    cfg = TransformerConfig(
        vocab_size=9, d_model=8, num_heads=2, num_layers=2, dropout=0.0,
        layer_schemes=[SPEC, {"name": "rope"}],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    docs = [torch.randint(0, 9, (n,)) for n in (3, 5, 2)]
    assert relpos.checks.packed_gap(model, [docs]) < 1e-5


# ----------------------------------------------------------------------------- bad input
def test_bidirectional_is_refused():
    with pytest.raises(ValueError, match="forgetting needs causal=True: the scheme is causal only"):
        relpos.make_scheme(SPEC, d_model=8, num_heads=2, causal=False)
    with pytest.raises(ValueError, match="causal only"):
        MultiheadAttention(8, 2, SPEC, causal=False)
    with pytest.raises(ValueError, match="causal only"):
        Transformer(
            TransformerConfig(vocab_size=5, d_model=8, num_heads=2, causal=False, scheme=SPEC)
        )


def test_cross_attention_is_refused():
    attn = MultiheadAttention(8, 2, SPEC, causal=True)
    with pytest.raises(ValueError, match=r"self-attention only.*context="):
        attn(torch.randn(1, 3, 8), context=torch.randn(1, 4, 8))


def test_bad_shapes_name_the_argument():
    scheme = make_scheme(2, 4, torch.float32)
    pos = Positions.from_length(5)
    with pytest.raises(ValueError, match=r"x must have shape \(b, n, d_model=8\)"):
        scheme.contextualize(torch.randn(1, 5, 6), pos)
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        scheme.contextualize(torch.ones(1, 5, 8, dtype=torch.long), pos)
    with pytest.raises(ValueError, match=r"positions have shape \(b, n\) = \(1, 4\)"):
        scheme.contextualize(torch.randn(1, 5, 8), Positions.from_length(4))
    with pytest.raises(TypeError, match="cached must be a Positions"):
        scheme.contextualize(torch.randn(1, 5, 8), pos, cached=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="cached positions must carry a log_decay of 2 channels"):
        scheme.contextualize(torch.randn(1, 5, 8), pos, cached=Positions.from_length(3))
    with pytest.raises(ValueError, match=r"log_f must have shape \(b, n, c\)"):
        pos.with_log_decay(torch.zeros(1, 4, 2))
    with pytest.raises(TypeError, match="log_f must be a floating tensor"):
        pos.with_log_decay(torch.zeros(1, 5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"log_decay must have shape \(b, n, c\) with \(b, n\)"):
        Positions(pos.pos, pos.seg, log_decay=torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="needs q_positions with a log_decay of 2 heads"):
        scheme.score_bias(torch.zeros(1, 2, 5, 4), pos, pos)
    decayed = pos.with_log_decay(torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match="different log_decay channels: 2 and None"):
        decayed.cat(pos)
    with pytest.raises(ValueError, match="log_decay of 2 heads"):
        BACKENDS["eager"](
            *(torch.zeros(1, 2, 5, 4) for _ in range(3)), scheme, pos, pos, causal=True
        )


def test_positions_keep_the_field_through_views():
    p = Positions.from_length(4).with_log_decay(-torch.ones(1, 4, 2))
    assert p.expand(3).log_decay.shape == (3, 4, 2)
    assert p[1:3].log_decay[0, :, 0].tolist() == [-2.0, -3.0]
    assert p.to("cpu").log_decay is not None and p.detach().log_decay is not None
    assert p.with_coords(torch.zeros(1, 4, 2, dtype=torch.long)).log_decay is p.log_decay
    assert p.continued(2).log_decay is None  # each layer computes its new tokens' values
    assert "log_decay=<(1, 4, 2)" in repr(p)
    assert math.isclose(p.cat(p).log_decay[0, -1, 0].item(), -4.0)
