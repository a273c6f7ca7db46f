"""Every attention backend against ``eager``: outputs and gradients, every scheme and layout.

Layouts: plain (one contiguous sequence per row: the fast paths), left/right padding, packed
documents with padding, and a KV cache (fewer queries than keys, positions from
``Positions.continued``). The exhaustive parity runs in float64, where the backends agree with
``eager`` to rounding (~1e-13), so a tolerance of 1e-9 catches any algorithmic slip; a float32 run
checks the ~1e-5 agreement of the production dtype.
"""

from __future__ import annotations

import json
import random
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import relpos
from relpos import Positions
from relpos.attention import auto as auto_mod
from relpos.attention.auto import choose_backend
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import alibi as alibi_parts
from relpos.attention.chunked import chunked_attention, chunked_path, plan_tiles
from relpos.attention.chunked import geometry as geometry_mod
from relpos.attention.chunked import narrow as narrow_mod
from relpos.attention.chunked import tiles as tiles_mod
from relpos.attention.chunked.region import far_field
from relpos.attention.contract import rows_with_keys
from relpos.attention.flex import flex_attention_backend, flex_available, flex_supports
from relpos.attention.sdpa import sdpa_attention, sdpa_supports
from relpos.functional import dtypes as dtypes_mod
from tests.helpers import (
    BACKEND_SPECS,
    causal_only,
    has_value_term,
    make_layout,
    randomize_parameters,
    spec_id,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    # emitted from inside Inductor while it compiles FlexAttention
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: intra-op threads only add synchronisation, and on a busy machine every
    parallel region waits for a descheduled thread (milliseconds per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LAYOUTS = ["plain", "offset", "left-pad", "right-pad", "packed", "cached", "cached-plain"]
FAST_BACKENDS = ["sdpa", "chunked", "chunked-tiles", "auto"]


def call(name: str, q, k, v, scheme, qp, kp, causal, **kw):
    """Run backend ``name``; ``chunked-tiles`` forces the general path with tiny tiles."""
    if name == "chunked-tiles":
        return chunked_attention(
            q, k, v, scheme, qp, kp, causal=causal, path="tiles", q_block=5, k_block=7, **kw
        )
    return BACKENDS[name](q, k, v, scheme, qp, kp, causal=causal, **kw)


def run_case(
    backend: str,
    spec: dict,
    causal: bool,
    layout: str,
    *,
    dtype: torch.dtype = torch.float64,
    n: int | None = None,
    seed: int | None = None,
):
    """Outputs and gradients (q, k, v, every parameter) of ``eager`` and of ``backend``."""
    seed = (
        zlib.crc32(f"{spec_id(spec)}{causal}{layout}{backend}".encode()) if seed is None else seed
    )
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, h, d = rng.randint(1, 3), rng.randint(1, 3), 2 * rng.randint(2, 4)
    n = rng.randint(16, 32) if n is None else n
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal).to(dtype)
    randomize_parameters(scheme, seed)
    qp, kp = make_layout(layout, rng, b, n)
    q = torch.randn(b, h, len(qp), d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, n, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h, n, d, dtype=dtype, requires_grad=True)
    params = list(scheme.parameters())
    grad_out = torch.randn(b, h, len(qp), d, dtype=dtype)
    results = []
    for name in ("eager", backend):
        qr, kr = scheme.rotate(q, k, qp, kp)
        out = call(name, qr, kr, v, scheme, qp, kp, causal)
        grads = torch.autograd.grad(out, [q, k, v, *params], grad_out, allow_unused=True)
        results.append((out, grads))
    return results, (scheme, q, qp, kp)


def assert_same(results, atol: float, rtol: float) -> None:
    (out_ref, g_ref), (out, g) = results
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)
    for t, (a, r) in enumerate(zip(g, g_ref, strict=True)):
        if r is None or a is None:
            for x in (a, r):
                assert x is None or torch.count_nonzero(x) == 0, f"gradient {t}"
        else:
            torch.testing.assert_close(
                a, r, atol=atol, rtol=rtol, msg=lambda m, t=t: f"grad {t}: {m}"
            )


def supported(backend: str, spec: dict) -> bool:
    return not (backend == "sdpa" and has_value_term(spec))


# ------------------------------------------------------------------------------ parity, float64
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.matrix
def test_backend_matches_eager(backend, spec, causal, layout):
    if not supported(backend, spec):
        pytest.skip("sdpa does not support a value term (auto picks chunked)")
    if layout.startswith("cached") and not causal:
        pytest.skip("a KV cache is for causal decoding")
    results, _ = run_case(backend, spec, causal, layout)
    assert_same(results, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(
    "spec",
    [
        {"name": "transformer_xl", "max_distance": 40},
        {"name": "music", "max_distance": 40},
        {"name": "shaw", "max_distance": 3, "per_head": False},
        {"name": "deberta", "position_buckets": 8, "max_relative_positions": 24},
    ],
    ids=spec_id,
)
@pytest.mark.matrix
def test_tiles_compute_a_keyed_term_for_the_rows_a_block_reaches(spec, causal, layout, monkeypatch):
    """With ``FEW_ROWS = 0`` every ``q·Eᵀ`` term is computed per query block for the rows its
    tiles reach (an offset into the table; the gradients land in those rows): equal to eager on
    every layout, outputs and the gradients of q, k, v and every parameter."""
    if layout.startswith("cached") and not causal:
        pytest.skip("a KV cache is for causal decoding")
    monkeypatch.setattr(tiles_mod, "FEW_ROWS", 0)
    seen = []
    real = tiles_mod._block_rows
    monkeypatch.setattr(tiles_mod, "_block_rows", lambda *a: seen.append(real(*a)) or seen[-1])
    results, _ = run_case("chunked-tiles", spec, causal, layout)
    assert_same(results, atol=1e-9, rtol=1e-9)
    assert seen
    if layout == "plain" and spec.get("max_distance", 0) > 32:
        assert all(lo > 0 for lo, _ in seen)  # distances < 32 < M: no block reaches row 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_backend_matches_eager_longer(backend, spec, causal, layout):
    if not supported(backend, spec):
        pytest.skip("sdpa does not support a value term (auto picks chunked)")
    if layout.startswith("cached") and not causal:
        pytest.skip("a KV cache is for causal decoding")
    results, _ = run_case(backend, spec, causal, layout, n=random.Random(layout).randint(90, 200))
    assert_same(results, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(
    "spec", [s for s in BACKEND_SPECS if s["name"] in ("shaw", "t5", "music", "alibi")], ids=spec_id
)
def test_chunked_fast_paths_cover_far_field(spec, causal):
    """Long plain sequences: the region path hands clipped distances to the fused kernel (both
    sides when bidirectional), ALiBi its left/diagonal/right parts; still equal to eager."""
    n = 160
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=causal)
    pos = Positions.from_length(n)
    path = chunked_path(scheme, torch.zeros(1, 2, n, 4), pos, pos)
    assert path == ("alibi" if spec["name"] == "alibi" else "region")
    if path == "region":
        far = far_field(scheme, n, torch.device("cpu"))
        assert far.left < n // 2 and (causal or far.right < n // 2)
    results, _ = run_case("chunked", spec, causal, "plain", n=n, seed=1)
    assert_same(results, atol=1e-9, rtol=1e-9)


@given(
    seed=st.integers(0, 2**16),
    q_block=st.integers(1, 9),
    k_block=st.integers(1, 9),
    layout=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
)
def test_chunked_tiles_any_block_sizes(seed, q_block, k_block, layout, causal):
    """Random shapes, layouts and tile sizes: tiles cut through documents, padding, diagonal."""
    spec = BACKEND_SPECS[seed % len(BACKEND_SPECS)]
    if layout.startswith("cached") or causal_only(spec):
        causal = True
    rng = random.Random(seed)
    b, h, d, n = rng.randint(1, 3), rng.randint(1, 2), 2 * rng.randint(2, 3), rng.randint(2, 24)
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal).double()
    randomize_parameters(scheme, seed)
    qp, kp = make_layout(layout, rng, b, n)
    q = torch.randn(b, h, len(qp), d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    inputs = [q, k, v, *scheme.parameters()]
    ref = BACKENDS["eager"](q, k, v, scheme, qp, kp, causal=causal)
    out = chunked_attention(
        q, k, v, scheme, qp, kp, causal=causal, path="tiles", q_block=q_block, k_block=k_block
    )
    grad_out = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, inputs, grad_out, allow_unused=True)
    g = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    assert_same(((ref, g_ref), (out, g)), atol=1e-9, rtol=1e-9)


# ------------------------------------------------------------------------------ parity, float32
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize(
    ("backend", "layout"), [("sdpa", "packed"), ("chunked", "plain"), ("chunked-tiles", "packed")]
)
@pytest.mark.matrix
def test_backend_matches_eager_float32(backend, spec, causal, layout):
    if not supported(backend, spec):
        pytest.skip("sdpa does not support a value term")
    results, _ = run_case(backend, spec, causal, layout, dtype=torch.float32, n=20)
    assert results[1][0].dtype == torch.float32
    assert_same(results, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ masked rows
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.matrix
def test_fully_masked_rows_give_zeros_and_finite_grads(backend, spec):
    if not supported(backend, spec):
        pytest.skip("sdpa does not support a value term")
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True)
    randomize_parameters(scheme)
    mask = torch.tensor([[False, False, True, True, True, False], [False] * 6])  # row 1: all pad
    pos = Positions.from_padding_mask(mask)
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    out = call(backend, q, k, v, scheme, pos, pos, True)
    pad = ~mask
    assert torch.equal(out[pad.unsqueeze(1).expand(2, 2, 6)], torch.zeros(int(pad.sum()) * 2, 4))
    params = [p for p in scheme.parameters()]
    grads = torch.autograd.grad(out.square().sum(), [q, k, v, *params], allow_unused=True)
    for g in grads:
        assert g is None or bool(torch.isfinite(g).all())
    assert torch.count_nonzero(grads[0][1]) == 0  # no query of row 1 influences anything


@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.matrix
def test_a_call_of_padding_queries_gives_parameters_eagers_gradients(backend, spec):
    """A KV-cache step whose every query is padding sees no key: the output is 0, and the
    scheme's parameters get what ``eager`` gives them (zeros where the term took part, None
    where it did not), not a missing gradient where eager has zeros."""
    if not supported(backend, spec):
        pytest.skip("sdpa does not support a value term")
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True).double()
    randomize_parameters(scheme)
    kp = Positions.from_padding_mask(torch.tensor([[True] * 7 + [False] * 3]))
    qp = kp[7:]  # the padding at the end of the row
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    params = [p for p in scheme.parameters() if p.requires_grad]
    if not params:
        pytest.skip("no parameters")
    results = []
    for name in ("eager", backend):
        out = call(name, q, k, v, scheme, qp, kp, True)
        assert not out.any()
        grads = torch.autograd.grad(out.square().sum() + 0.0 * q.sum(), params, allow_unused=True)
        results.append(["none" if g is None else bool(g.any()) for g in grads])
    assert results[1] == results[0]


# ------------------------------------------------------------------------------ non-finite
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_nan_query_weights_give_nan_on_every_backend(backend, spec):
    """Issue 45 item 1: with NaN query weights ``sdpa``, ``chunked`` and ``auto`` returned 0
    (the stock kernel and the tiles take a row of NaN logits for a row with no key) where
    ``eager`` returns NaN; now every real query is NaN on every backend, padding still 0."""
    if not supported(backend, spec):
        pytest.skip("sdpa does not support a value term")
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True)
    randomize_parameters(scheme)
    q, k, v = (
        torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    q[:, 0] = float("nan")  # head 0's queries
    mask = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    for pos in (Positions.from_length(6), Positions.from_padding_mask(mask)):
        with torch.no_grad():
            ref = call("eager", q, k, v, scheme, pos, pos, True)
            out = call(backend, q, k, v, scheme, pos, pos, True)
        torch.testing.assert_close(out, ref, equal_nan=True)
        real = pos.valid.expand(2, 6)
        assert out[:, 0][real].isnan().all() and (out[:, 0][~real] == 0).all()


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("target", ["queries", "yarn"])
def test_bad_weights_show_at_inference_on_every_backend(backend, target):
    """Issue 45 item 1, as reported: NaN query weights (or a YaRN ``attention_factor`` of NaN,
    unless the config refuses it) under ``torch.no_grad()`` gave the output projection's bias on
    the fast backends: a model gone bad looked healthy."""
    spec = "nope"
    if target == "yarn":
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
        spec = {"name": "rope", "scaling": {**scaling, "attention_factor": float("nan")}}
    refused = ""
    try:
        m = relpos.MultiheadAttention(16, 2, spec, backend=backend)
    except ValueError as e:  # a config check refusing NaN is the other accepted answer
        refused = str(e)
    if refused:
        assert "attention_factor" in refused
        return
    if target == "queries":
        with torch.no_grad():
            m.qkv.weight[:16] = float("nan")
    with torch.no_grad():
        y = m(torch.randn(2, 5, 16))
    assert y.isnan().all()


# ------------------------------------------------------------------------------ half precision
@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
def test_bfloat16_inputs_return_bfloat16(backend, name):
    torch.manual_seed(0)
    scheme = relpos.make_scheme(name, d_model=16, num_heads=2, causal=True)
    pos = Positions.from_length(40)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    ref = BACKENDS["eager"](q, k, v, scheme, pos, pos, causal=True)
    out = call(backend, *(t.bfloat16() for t in (q, k, v)), scheme, pos, pos, True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------------------------ dropout
def test_chunked_dropout_gradients_match_finite_differences():
    """The backward pass replays the forward pass's dropout masks (gradcheck reseeds each call)."""
    torch.manual_seed(0)
    scheme = relpos.make_scheme(
        {"name": "shaw", "max_distance": 2}, d_model=4, num_heads=1, causal=True
    ).double()
    randomize_parameters(scheme)
    pos = Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1, 1, -1]]))
    q, k, v = (torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q, k, v, *params):
        torch.manual_seed(123)
        return chunked_attention(
            q,
            k,
            v,
            scheme,
            pos,
            pos,
            causal=True,
            dropout_p=0.4,
            training=True,
            q_block=2,
            k_block=3,
        )

    torch.autograd.gradcheck(f, (q, k, v, *scheme.parameters()))
    torch.manual_seed(123)
    dropped = f(q, k, v)
    plain = chunked_attention(q, k, v, scheme, pos, pos, causal=True)
    assert not torch.allclose(dropped, plain)  # dropout did something


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked-tiles", "auto"])
@pytest.mark.parametrize("name", ["nope", "alibi", "music"])
def test_attention_dropout_drops_at_rate_p_and_rescales_the_rest(backend, name):
    """With ``v = I`` the output is the (dropped) probabilities themselves: each pair a query may
    attend to is 0 with probability ``p`` and otherwise its probability / (1 - p), so the
    expectation is the probabilities without dropout. The rate is checked to 5 standard errors
    over every allowed pair of 150 draws (a seeded run: deterministic)."""
    torch.manual_seed(0)
    n, p, draws = 16, 0.3, 150
    scheme = relpos.make_scheme(name, d_model=2 * n, num_heads=2, causal=True)
    randomize_parameters(scheme)
    q, k = (torch.randn(1, 2, n, n) for _ in range(2))
    v = torch.eye(n).expand(1, 2, n, n)
    pos = Positions.from_length(n)
    probs = call(backend, q, k, v, scheme, pos, pos, True)
    allowed = torch.ones(n, n, dtype=torch.bool).tril().expand(1, 2, n, n)
    assert torch.all(probs[allowed] > 0) and torch.all(probs[~allowed] == 0)
    run = [
        call(backend, q, k, v, scheme, pos, pos, True, dropout_p=p, training=True)
        for _ in range(draws)
    ]
    out = torch.stack(run)  # (draws, 1, 2, i, j)
    kept = out != 0
    assert not kept[:, ~allowed].any()
    count = allowed.sum().item() * draws
    rate = 1.0 - kept[:, allowed].sum().item() / count
    assert abs(rate - p) < 5 * (p * (1 - p) / count) ** 0.5, rate
    expected = (probs / (1 - p)).expand_as(out)
    torch.testing.assert_close(out[kept], expected[kept], rtol=1e-5, atol=1e-7)
    # Outside training the same call is the probabilities, unchanged.
    same = call(backend, q, k, v, scheme, pos, pos, True, dropout_p=p, training=False)
    torch.testing.assert_close(same, probs, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("name", ["nope", "music"])
def test_sdpa_dropout_on_cpu_equals_eager_with_the_same_mask(name, layout):
    """On the CPU, ``sdpa`` with dropout computes the math kernel's function itself (torch's draws
    its mask with a slow float ``bernoulli_``) and draws the same ``(b, h, i, j)`` mask as
    ``eager`` from the same seed: equal outputs and gradients, the learned bias's included."""
    torch.manual_seed(0)
    scheme = relpos.make_scheme(name, d_model=16, num_heads=2, causal=True)
    randomize_parameters(scheme)
    segments = [[0, 0, 0, 1, 1, 1, 1, -1], [0] * 8] if layout == "packed" else [[0] * 8] * 2
    pos = Positions.from_segments(torch.tensor(segments))
    qkv = [torch.randn(2, 2, 8, 8, requires_grad=True) for _ in range(3)]
    params = [*qkv, *scheme.parameters()]
    results = []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(7)
        out = call(backend, *qkv, scheme, pos, pos, True, dropout_p=0.3, training=True)
        grads = torch.autograd.grad(out.square().sum(), params)
        results.append((out, grads))
    (out_e, grads_e), (out_s, grads_s) = results
    plain = call("eager", *qkv, scheme, pos, pos, True)
    assert not torch.allclose(out_e, plain)  # dropout did something
    torch.testing.assert_close(out_s, out_e, rtol=1e-5, atol=1e-6)
    for g_s, g_e in zip(grads_s, grads_e, strict=True):
        torch.testing.assert_close(g_s, g_e, rtol=1e-5, atol=1e-6)
    # bfloat16 inputs (autocast's): the softmax still runs in float32; the same mask again.
    half = [t.detach().bfloat16() for t in qkv]
    outs = []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(7)
        outs.append(call(backend, *half, scheme, pos, pos, True, dropout_p=0.3, training=True))
    assert outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=2e-2, atol=2e-2)


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
@pytest.mark.parametrize("layout", ["plain", "left-pad"])
def test_sdpa_dropout_keeps_bf16_products_where_the_cpu_computes_them(layout, native, monkeypatch):
    """With a bias and bfloat16 inputs, sdpa's math path (dropout) runs its products, forward and
    backward, in bfloat16 on a CPU with bfloat16 instructions and in float32 on one without; the
    bias and the softmax are float32 either way, so both stay near float32 ``eager`` (the same
    dropout mask), outputs and gradients."""
    backend, spec, p = "sdpa", "music", 0.3
    monkeypatch.setattr(dtypes_mod, "native_bf16", lambda device: native)
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True)
    randomize_parameters(scheme)
    qp, kp = make_layout(layout, random.Random(0), 2, 24)
    qkv = [torch.randn(2, 2, 24, 8) for _ in range(3)]
    half = [t.bfloat16().requires_grad_() for t in qkv]
    torch.manual_seed(7)
    with MatmulDtypes() as seen:
        out = call(backend, *half, scheme, qp, kp, True, dropout_p=p, training=True)
        out.float().square().sum().backward()
    products = seen.dtypes - {torch.float32} if native else seen.dtypes
    assert products == ({torch.bfloat16} if native else {torch.float32})
    exact = [t.detach().requires_grad_() for t in qkv]
    torch.manual_seed(7)
    ref = call("eager", *exact, scheme, qp, kp, True, dropout_p=p, training=True)
    ref.square().sum().backward()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for t, r in zip(half, exact, strict=True):
        assert (t.grad.float() - r.grad).norm() <= 2e-2 * r.grad.norm()


# ------------------------------------------------------------------------------ memory structure
class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


MEMORY_CASES = [
    ({"name": "shaw", "max_distance": 16}, "plain"),
    ({"name": "t5"}, "plain"),
    ({"name": "alibi"}, "plain"),
    ({"name": "music", "max_distance": 64}, "plain"),
    ({"name": "shaw", "max_distance": 16}, "packed"),
    ({"name": "music", "max_distance": 64}, "packed"),
]


def check_no_l_by_l(spec: dict, layout: str, n: int, causal: bool) -> None:
    """No op of the forward or backward pass produces anything near L×L elements: the largest
    tensor is a tile or an O(L·d) / O(L·R) row statistic."""
    h, d, qb, kb = 2, 8, 64, 128
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal)
    if layout == "plain":
        pos = Positions.from_length(n)
    else:
        pos = Positions.from_lengths([[n // 4, n // 2, n // 4]], n)
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
    with MaxNumel() as mode:
        out = chunked_attention(q, k, v, scheme, pos, pos, causal=causal, q_block=qb, k_block=kb)
        out.sum().backward()
    rows = max(d, getattr(scheme, "num_relative", 0))  # head dim, or a relative table's rows
    band = 128 + 2 * rows  # the region path's band tile: 128 queries, clipped distances
    alibi = h * alibi_parts.ALIBI_BLOCK**2  # ALiBi's diagonal block
    # The band's groups of blocks: a fixed budget, or one block when that is larger.
    group = max(geometry_mod.GROUP_ELEMENTS, h * 128 * (128 + band))
    # The distance engine's chunks of rows: a fixed budget, or one row's (n, B + D - 1) tile.
    narrow = max(narrow_mod.CHUNK_ELEMENTS, n * (narrow_mod.NARROW_BLOCK + narrow_mod.NARROW_WIDTH))
    bound = max(h * n * rows, h * qb * kb, group, alibi, narrow)
    assert mode.max <= bound < n * n // 8, (mode.max, bound)


@pytest.mark.parametrize(
    "causal",
    # Packed bidirectional rows take ~10 s each at L = 8192: under ``make test-all``.
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["causal", "bidirectional"],
)
@pytest.mark.parametrize(("spec", "layout"), MEMORY_CASES, ids=str)
def test_chunked_never_builds_an_l_by_l_tensor(spec, layout, causal):
    check_no_l_by_l(spec, layout, 8192, causal=causal)


def test_plan_skips_other_documents_and_future_tiles():
    pos = Positions.from_lengths([[64, 64]], 128)
    plan = plan_tiles(pos, pos, causal=True, q_block=32, k_block=32)
    computed = [(j0, j1) for row in plan.tiles for j0, j1, _ in row]
    assert len(computed) == 2 * (1 + 2)  # per 64-token document: the lower triangle of 2×2 tiles
    unmasked = [masked for row in plan.tiles for _, _, masked in row].count(False)
    assert unmasked == 2  # the one off-diagonal tile of each document needs no mask
    assert plan.max_tile() == 32 * 32


# ------------------------------------------------------------------------------ sdpa specifics
def test_sdpa_uses_no_mask_for_plain_positions(monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    scheme = relpos.make_scheme("rope", d_model=8, num_heads=2, causal=True)
    pos = Positions.from_length(10)
    q = torch.randn(3, 2, 10, 4)
    sdpa_attention(q, q, q, scheme, pos, pos, causal=True)
    assert seen == [None]
    alibi = relpos.make_scheme("alibi", d_model=8, num_heads=2, causal=True)
    sdpa_attention(q, q, q, alibi, pos, pos, causal=True)
    assert seen[-1].shape == (1, 2, 10, 10)  # one mask for the whole batch


def test_sdpa_rejects_value_term_and_auto_routes_it():
    scheme = relpos.make_scheme("shaw", d_model=8, num_heads=2, causal=True)
    pos = Positions.from_length(5)
    q = torch.randn(1, 2, 5, 4)
    assert not sdpa_supports(scheme)
    with pytest.raises(ValueError, match="value term"):
        sdpa_attention(q, q, q, scheme, pos, pos, causal=True)
    assert choose_backend(scheme, q, pos, pos, needs_grad=False) == "chunked"


# ------------------------------------------------------------------------------ auto
@pytest.mark.parametrize(
    ("name", "layout", "needs_grad", "expected"),
    [
        ("nope", "plain", True, "sdpa"),
        ("rope", "packed", True, "sdpa"),
        ("alibi", "plain", True, "chunked"),
        ("alibi", "packed", True, "sdpa"),
        ("t5", "plain", True, "chunked"),
        ("t5", "packed", True, "chunked"),
        ("t5", "packed", False, "sdpa"),
        ("music", "plain", False, "chunked"),
        ("shaw", "packed", False, "chunked"),
        ("sandwich", "plain", False, "chunked"),
        ("kerple", "plain", False, "chunked"),
        ("kerple", "packed", False, "chunked"),  # tiles beat the float mask (measured)
        ("fire", "packed", False, "chunked"),
        ("kerple", "packed", True, "chunked"),
        ("learned_alibi", "plain", False, "chunked"),
    ],
)
def test_auto_table(name, layout, needs_grad, expected):
    scheme = relpos.make_scheme(name, d_model=8, num_heads=2, causal=True)
    qp, kp = make_layout(layout, random.Random(0), 2, 1024)
    q = torch.zeros(2, 2, len(qp), 4)
    assert choose_backend(scheme, q, qp, kp, needs_grad=needs_grad) == expected


class CudaQuery:
    """What ``flex_wins_on_cuda`` reads of ``q`` (its device, shape and dtype), on CUDA, so that
    the rule is tested on a machine without a GPU."""

    def __init__(self, b: int, h: int, i: int, d: int, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = (b, h, i, d), dtype, torch.device("cuda")

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@pytest.mark.parametrize(
    ("name", "n", "layout", "needs_grad", "dropout", "expected"),
    [
        ("alibi", 1024, "plain", True, False, True),
        ("alibi", 1024, "packed", True, False, True),
        ("alibi", 512, "plain", True, False, False),  # short: sdpa
        ("alibi", 1024, "plain", False, False, False),  # inference: a shape per decoding step
        ("alibi", 1024, "plain", True, True, False),  # attention dropout: flex has none
        ("music", 4096, "plain", True, False, True),  # past the mask budget
        ("music", 256, "plain", True, False, False),  # a small mask: sdpa
        ("shaw", 4096, "plain", True, False, False),  # a value term: flex cannot
        ("t5", 4096, "plain", True, False, True),  # its table read per distance
        ("t5", 512, "plain", True, False, True),  # sdpa's mask gradient: the math kernel
        ("t5", 256, "plain", True, False, False),  # short: sdpa
        ("kerple", 4096, "plain", True, False, True),  # its mask's gradient: the math kernel
        ("kerple", 256, "plain", True, False, False),  # short: sdpa
        ("sandwich", 4096, "plain", True, False, True),  # fixed: sdpa's float mask, still slower
        ("deberta", 4096, "plain", True, False, True),  # past the mask budget
        ("deberta", 256, "plain", True, False, False),
    ],
)
def test_auto_takes_flex_on_cuda_where_it_was_measured_to_win(
    name, n, layout, needs_grad, dropout, expected
):
    scheme = relpos.make_scheme(name, d_model=32, num_heads=2, causal=True)
    qp, kp = make_layout(layout, random.Random(0), 4, n)
    q = CudaQuery(4, 2, len(qp), 16)
    got = auto_mod.flex_wins_on_cuda(scheme, q, qp, kp, needs_grad=needs_grad, dropout=dropout)
    assert got is expected
    cpu = torch.zeros(4, 2, len(qp), 16)  # never on the CPU, where flex has no backward
    assert not auto_mod.flex_wins_on_cuda(scheme, cpu, qp, kp, needs_grad=True, dropout=False)


def test_auto_keeps_flex_off_learned_terms_in_deterministic_mode(deterministic):
    pos = Positions.from_length(4096)
    q = CudaQuery(4, 2, 4096, 16)
    frozen = relpos.make_scheme("t5", d_model=32, num_heads=2, causal=True).requires_grad_(False)
    deterministic(True)  # flex would sum a learned term's gradient by atomic adds (it refuses)
    for name in ("t5", "music", "kerple", "deberta"):
        scheme = relpos.make_scheme(name, d_model=32, num_heads=2, causal=True)
        assert not auto_mod.flex_wins_on_cuda(scheme, q, pos, pos, needs_grad=True, dropout=False)
    alibi = relpos.make_scheme("alibi", d_model=32, num_heads=2, causal=True)
    for scheme in (alibi, frozen):  # nothing summed
        assert auto_mod.flex_wins_on_cuda(scheme, q, pos, pos, needs_grad=True, dropout=False)


@pytest.mark.parametrize(
    ("spec", "dtype", "expected"),
    [
        ({"name": "shaw"}, torch.bfloat16, True),  # a value term: sdpa and flex cannot
        ({"name": "shaw"}, torch.float32, True),
        ({"name": "shaw", "values": False}, torch.bfloat16, False),  # keys only, short: sdpa
        ({"name": "shaw", "max_distance": 100}, torch.bfloat16, False),  # past MAX_LOOP_ROWS
        ({"name": "shaw"}, torch.float64, False),  # not a dtype the kernel takes
        ({"name": "music"}, torch.bfloat16, False),  # short: sdpa
        ({"name": "alibi"}, torch.bfloat16, False),
    ],
)
def test_auto_takes_fused_on_cuda_for_a_value_term(spec, dtype, expected):
    pytest.importorskip("triton")
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=True)
    pos = Positions.from_length(64)
    for grad in (True, False):
        q = CudaQuery(4, 2, 64, 16, dtype)
        assert auto_mod.fused_wins_on_cuda(scheme, q, pos, pos, needs_grad=grad) is expected
        cpu = torch.zeros(4, 2, 64, 16, dtype=dtype)
        assert not auto_mod.fused_wins_on_cuda(scheme, cpu, pos, pos, needs_grad=grad)


@pytest.mark.parametrize(
    ("spec", "n", "layout", "needs_grad", "dropout", "dtype", "expected"),
    [
        ("t5", 4096, "plain", True, False, torch.bfloat16, "fused"),  # one-row tiles: 4.2× vs 6.6
        ("t5", 512, "plain", True, False, torch.float16, "fused"),  # sdpa: the math kernel
        ("t5", 256, "plain", True, False, torch.bfloat16, "sdpa"),  # short
        ("t5", 4096, "plain", True, False, torch.float32, "flex"),  # float32: not timed
        ("music", 4096, "plain", True, False, torch.bfloat16, "fused"),
        ("music", 4096, "packed", True, False, torch.bfloat16, "fused"),
        ("music", 256, "plain", True, False, torch.bfloat16, "sdpa"),  # a small mask
        ("music", 2048, "plain", True, False, torch.float16, "fused"),  # past FUSED_LONG
        ("transformer_xl", 4096, "plain", True, False, torch.bfloat16, "fused"),
        ("learned_alibi", 1024, "plain", True, False, torch.bfloat16, "fused"),  # flex: 6×
        ("alibi", 4096, "plain", True, False, torch.bfloat16, "flex"),  # flex measured faster
        ("alibi", 4096, "plain", True, True, torch.bfloat16, "fused"),  # flex has no dropout
        ("alibi", 4096, "plain", False, False, torch.bfloat16, "fused"),  # inference: no compile
        ("alibi", 256, "plain", False, False, torch.bfloat16, "sdpa"),  # a small mask
        ("deberta", 4096, "plain", True, False, torch.bfloat16, "flex"),  # flex measured faster
        ("deberta", 4096, "plain", False, False, torch.bfloat16, "fused"),
        ("kerple", 4096, "plain", True, False, torch.bfloat16, "flex"),  # fused: not timed
        ("kerple", 4096, "plain", True, True, torch.bfloat16, "fused"),  # flex has no dropout
        ("kerple", 4096, "packed", False, False, torch.bfloat16, "fused"),  # inference: T5's form
        ("dpb", 1024, "plain", True, True, torch.bfloat16, "fused"),  # sdpa: the math kernel
        ("sandwich", 256, "plain", True, True, torch.bfloat16, "sdpa"),  # short
        ({"name": "t5", "num_buckets": 160}, 4096, "plain", True, False, torch.bfloat16, "flex"),
        ("sandwich", 1024, "plain", True, False, torch.bfloat16, "flex"),  # sdpa: 8.6× vs 5.7×
    ],
)
def test_auto_on_cuda_takes_what_the_gpu_measured_fastest(
    spec, n, layout, needs_grad, dropout, dtype, expected
):
    """``choose_backend`` on CUDA (a stand-in query: the rule, on a machine without a GPU); the
    figures behind each pick: ``docs/performance.md``, "On a GPU"."""
    pytest.importorskip("triton")
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=True)
    qp, kp = make_layout(layout, random.Random(0), 4, n)
    q = CudaQuery(4, 2, len(qp), 16, dtype)
    kw = dict(needs_grad=needs_grad, dropout_p=0.1 if dropout else 0.0, training=dropout)
    assert choose_backend(scheme, q, qp, kp, causal=True, **kw) == expected


@pytest.mark.parametrize(
    ("name", "dropout", "expected"),
    [
        ("music", False, "flex"),  # up to FUSED_LONG flex leads (L=1024: 6.3× vs 7.2×)
        ("transformer_xl", False, "flex"),
        ("music", True, "fused"),  # flex has no dropout: fused, not chunked
        ("t5", False, "fused"),  # T5 from 512²: fused (5.5× vs 5.6× at L=1024)
    ],
)
def test_auto_on_cuda_below_fused_long(name, dropout, expected):
    """At L=1024 with many heads (a mask past the budget) a query-dependent table takes ``flex``
    where it runs, ``fused`` where it does not (never ``chunked``: 24× against 7×)."""
    pytest.importorskip("triton")
    scheme = relpos.make_scheme(name, d_model=64, num_heads=8, causal=True)
    pos = Positions.from_length(1024)
    q = CudaQuery(16, 8, 1024, 8)
    kw = dict(needs_grad=True, dropout_p=0.1 if dropout else 0.0, training=dropout)
    assert choose_backend(scheme, q, pos, pos, causal=True, **kw) == expected


def test_auto_keeps_fused_to_the_head_dims_it_was_timed_at():
    """Past ``FUSED_HEAD_DIM`` (64) ``auto`` leaves ``fused`` for ``flex`` (its 64×64 kernels ask
    for more shared memory than an H100 grants at d=256), except for Shaw's value term."""
    pytest.importorskip("triton")
    pos = Positions.from_length(4096)
    for d, expected in ((64, "fused"), (128, "flex")):
        scheme = relpos.make_scheme("t5", d_model=2 * d, num_heads=2, causal=True)
        q = CudaQuery(4, 2, 4096, d)
        assert choose_backend(scheme, q, pos, pos, needs_grad=True, causal=True) == expected
    shaw = relpos.make_scheme("shaw", d_model=256, num_heads=2, causal=True)
    assert choose_backend(shaw, CudaQuery(4, 2, 4096, 128), pos, pos, needs_grad=True) == "fused"


def test_auto_keeps_fused_off_atomic_sums_in_deterministic_mode(deterministic):
    """In deterministic mode ``auto`` takes ``fused`` only where it sums no table's gradient by
    atomic adds (``fused_sums_atomically``): the Music Transformer over plain positions (each
    query's rows its own) and DeBERTa there (its tables read per entry: each query's and each
    key's own), not over packed ones, and KERPLE (a closed form) on any layout; ``flex``
    refuses learned terms there."""
    pytest.importorskip("triton")
    deterministic(True)
    for name in ("music", "deberta"):
        scheme = relpos.make_scheme(name, d_model=32, num_heads=2, causal=True)
        for layout, expected in (("plain", "fused"), ("packed", "chunked")):
            qp, kp = make_layout(layout, random.Random(0), 4, 4096)
            q = CudaQuery(4, 2, 4096, 16)
            got = choose_backend(scheme, q, qp, kp, needs_grad=True, causal=True)
            assert got == expected, (name, layout)
    # KERPLE's closed form sums nothing atomically: fused wherever flex refuses its table; a
    # distance bias with a learned table (DPB) sums it atomically: chunked.
    q = CudaQuery(4, 2, 4096, 16, torch.bfloat16)
    for name, expected in (("kerple", "fused"), ("dpb", "chunked")):
        scheme = relpos.make_scheme(name, d_model=32, num_heads=2, causal=True)
        for layout in ("plain", "packed"):
            qp, kp = make_layout(layout, random.Random(0), 4, 4096)
            assert choose_backend(scheme, q, qp, kp, needs_grad=True, causal=True) == expected


def test_auto_keeps_learned_tables_off_flex_before_the_torch_it_was_measured_with(monkeypatch):
    scheme = relpos.make_scheme("music", d_model=32, num_heads=2, causal=True)
    pos = Positions.from_length(4096)
    q = CudaQuery(4, 2, 4096, 16)
    assert auto_mod.flex_wins_on_cuda(scheme, q, pos, pos, needs_grad=True, dropout=False)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    assert not auto_mod.flex_wins_on_cuda(scheme, q, pos, pos, needs_grad=True, dropout=False)
    alibi = relpos.make_scheme("alibi", d_model=32, num_heads=2, causal=True)  # nothing learned
    assert auto_mod.flex_wins_on_cuda(alibi, q, pos, pos, needs_grad=True, dropout=False)


@pytest.mark.parametrize("name", ["alibi", "t5", "music", "rope"])
def test_auto_takes_sdpa_for_short_sequences(name):
    scheme = relpos.make_scheme(name, d_model=8, num_heads=2, causal=True)
    pos = Positions.from_length(128)
    q = torch.zeros(1, 2, 128, 4)
    assert choose_backend(scheme, q, pos, pos, needs_grad=True) == "sdpa"
    shaw = relpos.make_scheme("shaw", d_model=8, num_heads=2, causal=True)
    assert choose_backend(shaw, q, pos, pos, needs_grad=True) == "chunked"  # value term


@pytest.mark.parametrize(
    ("name", "needs_grad", "frozen", "dropout", "expected"),
    [
        ("t5", True, False, 0.0, "chunked"),  # a learned table: sdpa's math kernel is slower
        ("t5", False, False, 0.0, "sdpa"),  # inference, one (1, h, i, j) mask: sdpa
        ("t5", True, True, 0.0, "sdpa"),  # a frozen table: sdpa's fused kernel takes the mask
        ("music", False, False, 0.0, "chunked"),  # q·Eᵀ: sdpa would build (b, h, i, j)
        ("music", True, False, 0.0, "chunked"),
        ("music", True, False, 0.1, "sdpa"),  # dropout in training: no region path
        ("alibi", True, False, 0.0, "sdpa"),  # not a region scheme: 512² still holds
        ("rope", True, False, 0.0, "sdpa"),
    ],
)
def test_auto_takes_the_region_path_from_medium_lengths(
    name, needs_grad, frozen, dropout, expected
):
    """Between SMALL_RELATIVE and SMALL (here 256 tokens) the region path wins where sdpa would
    differentiate its mask with the math kernel or build a per-batch bias."""
    n = 256
    assert auto_mod.SMALL_RELATIVE < n * n <= auto_mod.SMALL
    scheme = relpos.make_scheme(name, d_model=8, num_heads=2, causal=True)
    scheme.requires_grad_(not frozen)
    pos = Positions.from_length(n)
    q = torch.zeros(2, 2, n, 4)
    got = choose_backend(
        scheme, q, pos, pos, needs_grad=needs_grad, dropout_p=dropout, training=True
    )
    assert got == expected


def test_auto_runs_the_chosen_backend(monkeypatch):
    calls = []
    for name in ("sdpa", "chunked"):
        real = auto_mod._PICKS[name]
        spy = lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw)  # noqa: E731
        monkeypatch.setitem(auto_mod._PICKS, name, spy)
    scheme = relpos.make_scheme("t5", d_model=8, num_heads=2, causal=True)
    pos = Positions.from_length(600)
    q = torch.randn(1, 2, 600, 4, requires_grad=True)
    auto_mod.auto_attention(q, q, q, scheme, pos, pos, causal=True)
    assert calls == ["chunked"]


def test_module_with_each_backend_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 30, 16)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :7] = False
    ref_layer = relpos.MultiheadAttention(16, 2, "t5", causal=True)
    ref = ref_layer(x, padding_mask=mask)
    for backend in ("sdpa", "chunked", "auto"):
        layer = relpos.MultiheadAttention(16, 2, "t5", causal=True, backend=backend)
        layer.load_state_dict(ref_layer.state_dict())
        torch.testing.assert_close(layer(x, padding_mask=mask), ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "auto"])
def test_bad_shapes_raise_value_errors(backend):
    scheme = relpos.make_scheme("nope", d_model=8, num_heads=2, causal=False)
    pos = Positions.from_length(5)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"q must have shape \(b, h, n, d\)"):
        call(backend, q[0], q, q, scheme, pos, pos, False)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        call(backend, q, q, q[..., :3], scheme, pos, pos, False)
    with pytest.raises(ValueError, match="k_positions"):
        call(backend, q, q, q, scheme, pos, Positions.from_length(4), False)


def test_chunked_rejects_bad_blocks():
    scheme = relpos.make_scheme("nope", d_model=8, num_heads=2, causal=False)
    pos = Positions.from_length(5)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="q_block must be a positive int"):
        chunked_attention(q, q, q, scheme, pos, pos, causal=False, q_block=0)


# ------------------------------------------------------------------------------ flex
FLEX_CASES = [
    ({"name": "alibi"}, True, "plain"),
    ({"name": "t5", "num_buckets": 8, "max_distance": 12}, False, "packed"),
]
FLEX_SLOW_CASES = [
    (spec, causal, layout)
    for spec in BACKEND_SPECS
    if not has_value_term(spec) and spec["name"] != "fire"  # flex declines both (test_fire.py)
    for causal in (True, False)
    for layout in ("plain", "left-pad", "packed", "cached")
    if causal or not layout.startswith("cached")
]


def check_flex(spec: dict, causal: bool, layout: str) -> None:
    if not flex_available():
        pytest.skip("FlexAttention is not available in this torch")
    rng = random.Random(zlib.crc32(f"{spec_id(spec)}{causal}{layout}".encode()))
    torch.manual_seed(0)
    b, h, d, n = 2, 2, 8, 40
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal)
    randomize_parameters(scheme)
    qp, kp = make_layout(layout, rng, b, n)
    q = torch.randn(b, h, len(qp), d)
    k, v = (torch.randn(b, h, n, d) for _ in range(2))
    qr, kr = scheme.rotate(q, k, qp, kp)
    with torch.no_grad():
        ref = BACKENDS["eager"](qr, kr, v, scheme, qp, kp, causal=causal)
        try:
            out = flex_attention_backend(qr, kr, v, scheme, qp, kp, causal=causal)
        except Exception as e:  # no C++ compiler, unsupported build
            if isinstance(e, ValueError):
                raise
            pytest.skip(f"FlexAttention does not compile here: {type(e).__name__}: {e}")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("spec", "causal", "layout"), FLEX_CASES, ids=str)
def test_flex_matches_eager_in_inference(spec, causal, layout):
    check_flex(spec, causal, layout)


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "causal", "layout"), FLEX_SLOW_CASES, ids=str)
def test_flex_matches_eager_every_scheme(spec, causal, layout):
    check_flex(spec, causal, layout)


def test_flex_declines_gradients_on_cpu_and_value_terms():
    scheme = relpos.make_scheme("t5", d_model=8, num_heads=2, causal=True)
    shaw = relpos.make_scheme("shaw", d_model=8, num_heads=2, causal=True)
    assert not flex_supports(scheme, device=torch.device("cpu"), needs_grad=True)
    assert not flex_supports(shaw, device=torch.device("cpu"), needs_grad=False)
    if not flex_available():
        return
    assert flex_supports(scheme, device=torch.device("cpu"), needs_grad=False)
    pos = Positions.from_length(6)
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    with pytest.raises(ValueError, match="gradients"):
        flex_attention_backend(q, q, q, scheme, pos, pos, causal=True)
    with torch.no_grad(), pytest.raises(ValueError, match="ShawRelative"):
        flex_attention_backend(q, q, q, shaw, pos, pos, causal=True)


@pytest.mark.parametrize("layout", ["plain", "left-pad", "packed", "cached"])
def test_rows_with_keys_matches_the_allowed_mask(layout):
    qp, kp = make_layout(layout, random.Random(3), 3, 30)
    for causal in (True, False):
        expected = qp.allowed(kp, causal=causal).any(-1)
        assert torch.equal(rows_with_keys(qp, kp, causal), expected)
        assert not (layout == "left-pad" and bool(expected.all()))  # the test sees padding


def test_rows_with_keys_takes_any_segment_ids():
    """Document ids as segment ids (up to 2**62): the table is per row's distinct ids, not per id
    value, in cross-attention too (queries' and keys' ids differ)."""
    big = 2**62
    q_ids = torch.tensor([[big, big, 7, -1, big + 1], [-1, -1, 3, 3, 3]])
    k_ids = torch.tensor([[big + 1, 7, big, big, -1, 7], [3, -1, 3, 9, 9, 9]])
    qp, kp = Positions.from_segments(q_ids), Positions.from_segments(k_ids)
    for causal in (True, False):
        expected = qp.allowed(kp, causal=causal).any(-1)
        assert torch.equal(rows_with_keys(qp, kp, causal), expected)
    assert not bool(expected.all()) and bool(expected.any())


# ------------------------------------------------------------------------------ bench
def test_bench_writes_table_plot_and_json(tmp_path):
    from relpos.cli import bench

    argv = ["--lengths", "32,64", "--schemes", "alibi,shaw", "--impls", "chunked,sdpa,eager"]
    argv += ["--repeats", "5", "--warmup", "1", "--no-memory", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    table = (tmp_path / "bench.md").read_text()
    assert "| none | sdpa-plain | 64 | 1 | causal |" in table
    assert "| alibi | chunked | 64 | 1 | causal |" in table
    assert "| shaw | sdpa |" not in table  # sdpa declines Shaw's value term
    rows = json.loads((tmp_path / "bench.json").read_text())
    timed = [r for r in rows if r["config"]["impl"] != "sdpa-plain"]
    assert timed and all(r["fwd_ratio"] > 0 and len(r["runs"]["fwd"]) == 5 for r in timed)
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes left no temporary file


def test_bench_times_each_configuration_alternating_with_plain_sdpa():
    from relpos.cli import bench

    calls = []

    def run(tag):
        def fn(setup):
            calls.append(tag)
            return torch.zeros(())

        return fn

    times, base = bench.measure_paired(
        run("x"), None, run("plain"), None, backward=False, repeats=3, warmup=1, device="cpu"
    )
    assert calls == ["x", "plain"] * 4 and len(times) == len(base) == 3
    # The median of run-by-run ratios, not the ratio of medians (4 / 3 here).
    assert bench.paired_ratio([2.0, 4.0, 30.0], [1.0, 4.0, 3.0]) == 2.0


def test_bench_memory_subprocess_sees_the_l_by_l_logits():
    from relpos.cli import bench

    spec = {"scheme": "t5", "L": 2048, "B": 1, "causal": True, "heads": 8, "head_dim": 16}
    spec.update(device="cpu", dtype="float32", threads=1)
    eager, why = bench.measure_memory({**spec, "impl": "eager"}, timeout=120)
    chunked, why2 = bench.measure_memory({**spec, "impl": "chunked"}, timeout=120)
    assert eager is not None and chunked is not None, (why, why2)
    logits = 8 * 2048 * 2048 * 4  # one (1, 8, L, L) float32 tensor
    assert eager > 2 * logits
    assert chunked < logits / 2


def test_bench_rejects_too_few_repeats():
    from relpos.cli import bench
    from relpos.cli.checks import CLIError

    with pytest.raises(CLIError, match="--repeats: expected an integer >= 5, got 3"):
        bench.main(["--repeats", "3"])
