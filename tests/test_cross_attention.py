"""Cross-attention: ``MultiheadAttention(x, context=...)``, keys and values at their own Positions.

The reference is ``tests/oracles.py: attention``, a loop over (b, h, i, j) that takes the queries'
and the keys' positions separately, fed by projections written out here: queries from ``x`` by the
first ``h·d`` rows of the fused ``qkv`` weight, keys and values from the context by the rest, key
head ``i // (h / num_kv_heads)`` for query head ``i``. Every backend must give its outputs and
gradients (to ``x``, the context and every parameter) on layouts where queries and keys differ in
length, offset, padding and packing. Properties: packed (query, context) pairs and padded rows
each equal the pair alone; grouped-query attention equals the repeated-heads layer.
"""

from __future__ import annotations

import functools
import random
import zlib

import pytest
import torch

import relpos
from relpos import KVCache, MultiheadAttention, Positions
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_attention
from relpos.attention.flex import flex_available, flex_supports
from relpos.attention.sdpa import sdpa_supports
from tests import oracles
from tests.helpers import BACKEND_SPECS, gqa_and_repeated, randomize_parameters, spec_id

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # tiny shapes: threads only add overhead
    pytest.mark.filterwarnings("ignore::UserWarning"),
    # emitted from inside Inductor while it compiles FlexAttention
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

H, HEAD_DIM = 2, 4
D = H * HEAD_DIM
#: Schemes that act inside attention (an ``embed``-only scheme never reaches the layer).
ATTENTION_SPECS = [s for s in BACKEND_SPECS if relpos.SCHEMES[s["name"]].hooks != {"embed"}]
#: plain: both ``from_length``, more queries than keys; offsets: both ``from_length`` with
#: different offsets, fewer queries than keys; aligned: both ``from_length``, as many queries as
#: keys, different offsets (what a fast path that took equal lengths for self-attention would get
#: wrong); padded: left/right padding on both sides (a context row all padding); packed:
#: documents on both sides, some without context; shared: one ``Positions`` object for both sides
#: (the self-attention fast paths, over different tokens).
LAYOUTS = ["plain", "offsets", "aligned", "padded", "packed", "shared"]
#: Every backend that differentiates on CPU, and ``chunked``'s general path with tiny tiles (so
#: that tiles cut through documents, padding and the causal boundary).
GRAD_BACKENDS = [n for n in BACKENDS if n not in ("eager", "flex", "fused")] + ["chunked-tiles"]
TINY_TILES = functools.partial(chunked_attention, path="tiles", q_block=3, k_block=2)


def supports(backend: str, scheme: relpos.Scheme, *, grad: bool) -> bool:
    """What the backend declares it runs (sdpa and flex refuse some schemes)."""
    if backend == "sdpa":
        return sdpa_supports(scheme)
    if backend == "flex":
        return flex_available() and flex_supports(
            scheme, device=torch.device("cpu"), needs_grad=grad
        )
    return True


def packed_ids(lengths: list[int], n: int, *, left: bool) -> list[int]:
    """Segment ids of documents of ``lengths`` (document ``s`` = segment ``s``), padded to ``n``."""
    ids = [s for s, length in enumerate(lengths) for _ in range(length)]
    pad = [-1] * (n - len(ids))
    return pad + ids if left else ids + pad


def make_layout(layout: str, rng: random.Random, b: int) -> tuple[Positions, Positions]:
    """``(query positions, context positions)`` of one layout (see :data:`LAYOUTS`)."""
    if layout == "plain":
        m = rng.randint(2, 5)
        return Positions.from_length(m + rng.randint(1, 4)), Positions.from_length(m)
    if layout == "offsets":
        n = rng.randint(2, 5)
        q_off, k_off = rng.sample(range(0, 8), 2)
        return (
            Positions.from_length(n, offset=q_off),
            Positions.from_length(n + rng.randint(1, 4), offset=k_off),
        )
    if layout == "aligned":
        n = rng.randint(3, 8)
        q_off, k_off = rng.sample(range(0, 6), 2)
        return Positions.from_length(n, offset=q_off), Positions.from_length(n, offset=k_off)
    if layout == "shared":
        p = Positions.from_length(rng.randint(3, 8), offset=rng.randint(0, 3))
        return p, p
    if layout == "padded":
        n, m = rng.sample(range(4, 9), 2)
        q_mask, k_mask = torch.ones(b, n, dtype=torch.bool), torch.ones(b, m, dtype=torch.bool)
        q_mask[0, : rng.randint(1, n // 2)] = False  # left padding
        q_mask[1, n - rng.randint(1, n // 2) :] = False  # right padding
        k_mask[0, m - rng.randint(1, m // 2) :] = False
        k_mask[1, : rng.randint(1, m // 2)] = False
        k_mask[2:] = False  # no context at all
        return Positions.from_padding_mask(q_mask), Positions.from_padding_mask(k_mask)
    # packed: per row, documents 0..s-1 on both sides; a document may have no context tokens
    docs = [rng.randint(1, 3) for _ in range(b)]
    q_len = [[rng.randint(1, 3) for _ in range(s)] for s in docs]
    k_len = [[rng.randint(0, 3) for _ in range(s)] for s in docs]
    n = max(map(sum, q_len)) + rng.randint(0, 2)
    m = max(map(sum, k_len)) + rng.randint(1, 2)
    q_ids = torch.tensor([packed_ids(lens, n, left=r % 2 == 1) for r, lens in enumerate(q_len)])
    k_ids = torch.tensor([packed_ids(lens, m, left=r % 2 == 0) for r, lens in enumerate(k_len)])
    return Positions.from_segments(q_ids), Positions.from_segments(k_ids)


def rows(p: Positions, b: int) -> tuple[list[list[int]], list[list[int]]]:
    p = p.expand(b)
    return p.pos.tolist(), p.seg.tolist()


def reference(mha: MultiheadAttention, x, context, qp: Positions, kp: Positions):
    """The layer written out: projections, :func:`oracles.attention`, output projection; a query
    with no key to attend to outputs 0."""
    b, n, _ = x.shape
    m = context.shape[1]
    h, kvh, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    w, bias = mha.qkv.weight, mha.qkv.bias
    wq, wk, wv = w.split([h * d, kvh * d, kvh * d])
    bq, bk, bv = bias.split([h * d, kvh * d, kvh * d])
    q = (x @ wq.T + bq).view(b, n, h, d).transpose(1, 2)
    k = (context @ wk.T + bk).view(b, m, kvh, d).transpose(1, 2)
    v = (context @ wv.T + bv).view(b, m, kvh, d).transpose(1, 2)
    group = [head // (h // kvh) for head in range(h)]  # the key/value head of each query head
    k, v = k[:, group], v[:, group]
    (q_pos, q_seg), (k_pos, k_seg) = rows(qp, b), rows(kp, b)
    att = oracles.attention(
        mha.scheme, q, k, v, q_pos, q_seg, k_pos, k_seg, causal=mha.causal
    )  # (b, h, n, d)
    y = att.transpose(1, 2).reshape(b, n, D) @ mha.out.weight.T + mha.out.bias
    sees = [
        [
            q_seg[r][i] != -1
            and any(
                k_seg[r][j] == q_seg[r][i] and (not mha.causal or k_pos[r][j] <= q_pos[r][i])
                for j in range(m)
            )
            for i in range(n)
        ]
        for r in range(b)
    ]
    return y * torch.tensor(sees, dtype=y.dtype).unsqueeze(-1), sees


def case(spec: dict, causal: bool, layout: str):
    """A float64 layer with random parameters (GQA or not), inputs and positions for one case."""
    seed = zlib.crc32(f"{spec_id(spec)}{causal}{layout}".encode())
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b = 3 if layout == "padded" else 2
    kvh = rng.choice([1, H])
    mha = MultiheadAttention(D, H, spec, causal=causal, num_kv_heads=kvh).double()
    randomize_parameters(mha, seed)
    qp, kp = make_layout(layout, rng, b)
    x = torch.randn(b, len(qp), D, dtype=torch.float64, requires_grad=True)
    context = torch.randn(b, len(kp), D, dtype=torch.float64, requires_grad=True)
    return mha, x, context, qp, kp


def kwargs(qp: Positions, kp: Positions) -> dict:
    return {"positions": qp, "context_positions": kp}


def assert_close(got, want, tol: float, what: str) -> None:
    """Outputs and gradients (a ``None`` gradient is zero) agree to ``tol``."""
    (out, grads), (out_ref, grads_ref) = got, want
    torch.testing.assert_close(out, out_ref, atol=tol, rtol=tol, msg=lambda s: f"{what}: {s}")
    for t, (g, r) in enumerate(zip(grads, grads_ref, strict=True)):
        if g is None or r is None:
            for a in (g, r):
                assert a is None or torch.count_nonzero(a) == 0, f"{what}, grad {t}"
            continue
        torch.testing.assert_close(
            g, r, atol=tol, rtol=tol, msg=lambda s, t=t: f"{what}, grad {t}: {s}"
        )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", ATTENTION_SPECS, ids=spec_id)
@pytest.mark.matrix
def test_every_backend_matches_the_oracle(spec, causal, layout, monkeypatch):
    """Outputs and gradients (to x, the context and every parameter) of every backend against
    the loop oracle, in float64: ``eager`` to the oracle's 1e-6 (RoPE's frequencies are float32
    numbers, the oracle's exact), every other backend to ``eager`` within rounding."""
    monkeypatch.setitem(BACKENDS, "chunked-tiles", TINY_TILES)
    mha, x, context, qp, kp = case(spec, causal, layout)
    inputs = [x, context, *mha.parameters()]
    ref, sees = reference(mha, x, context, qp, kp)
    grad_out = torch.randn_like(ref)
    results = {"oracle": (ref, torch.autograd.grad(ref, inputs, grad_out, allow_unused=True))}
    for backend in ["eager", *GRAD_BACKENDS]:
        if not supports(backend, mha.scheme, grad=True):
            continue
        mha.backend = backend
        out = mha(x, context=context, **kwargs(qp, kp))
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        results[backend] = (out, grads)
        blind = ~torch.tensor(sees)  # queries with no key: exactly 0
        assert torch.equal(out[blind], torch.zeros_like(out[blind])), backend
    assert_close(results["eager"], results["oracle"], 1e-6, "eager vs oracle")
    for backend in GRAD_BACKENDS:
        if backend in results:
            assert_close(results[backend], results["eager"], 1e-9, f"{backend} vs eager")
    # the layouts reach what they are meant to: i > j, i < j, queries that see nothing
    assert layout != "plain" or len(qp) > len(kp)
    assert layout != "offsets" or len(qp) < len(kp)
    assert layout != "aligned" or (len(qp) == len(kp) and not torch.equal(qp.pos, kp.pos))
    assert layout != "padded" or not any(sees[2])


FLEX_CASES = [
    ({"name": "nope"}, True, "aligned"),  # a block mask only (cached for self-attention)
    ({"name": "t5", "num_buckets": 8, "max_distance": 12}, False, "packed"),
    ({"name": "alibi"}, True, "padded"),
]
FLEX_SLOW_CASES = [
    (spec, causal, layout)
    for spec in ATTENTION_SPECS
    for causal in (True, False)
    for layout in LAYOUTS
    if (spec, causal, layout) not in FLEX_CASES
]


def check_flex(spec: dict, causal: bool, layout: str) -> None:
    mha, x, context, qp, kp = case(spec, causal, layout)
    if not supports("flex", mha.scheme, grad=False):
        pytest.skip("flex does not support this scheme (or is not available)")
    with torch.no_grad():
        ref, _ = reference(mha, x, context, qp, kp)
        mha.backend = "flex"
        try:
            out = mha(x, context=context, **kwargs(qp, kp))
        except Exception as e:  # no C++ compiler, unsupported build
            if isinstance(e, ValueError):
                raise
            pytest.skip(f"FlexAttention does not compile here: {type(e).__name__}: {e}")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # flex computes in float32


@pytest.mark.parametrize(("spec", "causal", "layout"), FLEX_CASES, ids=str)
def test_flex_matches_the_oracle_in_inference(spec, causal, layout):
    check_flex(spec, causal, layout)


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "causal", "layout"), FLEX_SLOW_CASES, ids=str)
def test_flex_matches_the_oracle_every_scheme(spec, causal, layout):
    check_flex(spec, causal, layout)


# ------------------------------------------------------------------------------ properties
PROPERTY_SPECS = ["nope", "rope", "alibi", {"name": "t5", "num_buckets": 8, "max_distance": 12}]
PROPERTY_SPECS += [{"name": "shaw", "max_distance": 2}, {"name": "music", "max_distance": 4}]


def layer(spec, causal: bool, backend: str) -> MultiheadAttention:
    torch.manual_seed(0)
    mha = MultiheadAttention(D, H, spec, causal=causal, backend=backend, num_kv_heads=1)
    randomize_parameters(mha)
    return mha.double().eval()


@pytest.mark.parametrize("backend", ["eager", "chunked", "auto"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", PROPERTY_SPECS, ids=str)
@pytest.mark.matrix
def test_packed_pairs_equal_each_pair_alone(spec, causal, backend):
    """One row packing three (query document, context document) pairs, padded on both sides,
    gives each pair's queries what the pair gives alone; a document with no context gives 0."""
    mha = layer(spec, causal, backend)
    q_len, k_len = [3, 4, 2], [5, 0, 3]
    q_ids = torch.tensor([[-1] + [s for s, n in enumerate(q_len) for _ in range(n)] + [-1, -1]])
    k_ids = torch.tensor([[s for s, n in enumerate(k_len) for _ in range(n)] + [-1]])
    x = torch.randn(1, q_ids.shape[1], D, dtype=torch.float64)
    context = torch.randn(1, k_ids.shape[1], D, dtype=torch.float64)
    with torch.no_grad():
        packed = mha(x, segment_ids=q_ids, context=context, context_segment_ids=k_ids)
        for s in range(len(q_len)):
            xq, xk = x[:, q_ids[0] == s], context[:, k_ids[0] == s]
            alone = mha(xq, context=xk)
            torch.testing.assert_close(packed[:, q_ids[0] == s], alone, atol=1e-12, rtol=1e-12)
        assert torch.equal(packed[:, q_ids[0] == 1], torch.zeros(1, 4, D, dtype=torch.float64))
        assert torch.equal(packed[:, q_ids[0] == -1], torch.zeros(1, 3, D, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", PROPERTY_SPECS, ids=str)
@pytest.mark.matrix
def test_padded_rows_equal_each_row_alone(spec, causal, backend):
    """Left- and right-padded queries and context in one batch: each row equals it alone."""
    mha = layer(spec, causal, backend)
    if not supports(backend, mha.scheme, grad=False):
        pytest.skip(f"{backend} does not support {spec}")
    q_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    k_mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    context = torch.randn(2, 4, D, dtype=torch.float64)
    with torch.no_grad():
        both = mha(x, padding_mask=q_mask, context=context, context_padding_mask=k_mask)
        for r in range(2):
            alone = mha(x[r : r + 1, q_mask[r]], context=context[r : r + 1, k_mask[r]])
            torch.testing.assert_close(both[r : r + 1, q_mask[r]], alone, atol=1e-12, rtol=1e-12)
        assert torch.equal(both[~q_mask], torch.zeros(4, D, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("kvh", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", PROPERTY_SPECS, ids=str)
@pytest.mark.matrix
def test_gqa_with_context_equals_the_repeated_heads_layer(spec, causal, kvh, backend):
    gqa, full = gqa_and_repeated(spec, kvh, causal, backend, d_model=16, num_heads=4)
    if not supports(backend, gqa.scheme, grad=False):
        pytest.skip(f"{backend} does not support {spec}")
    x, context = torch.randn(3, 5, 16), torch.randn(3, 8, 16)
    k_ids = torch.tensor([[0] * 8, [0] * 3 + [1] * 4 + [-1], [-1] * 2 + [0] * 6])
    q_ids = torch.tensor([[0] * 5, [0] * 2 + [1] * 3, [0] * 4 + [-1]])
    with torch.no_grad():
        for kw in ({}, {"segment_ids": q_ids, "context_segment_ids": k_ids}):
            got, want = gqa(x, context=context, **kw), full(x, context=context, **kw)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_one_state_dict_for_self_and_cross_attention():
    """Cross-attention adds no parameters; with ``context=x`` it is self-attention."""
    mha = layer("rope", True, "auto")
    plain = MultiheadAttention(D, H, "rope", causal=True, num_kv_heads=1).double()
    assert mha.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mha(x, context=x), mha(x), atol=1e-12, rtol=1e-12)


def test_rotary_rotates_keys_by_the_context_positions():
    """Shifting queries and context by the same offset changes nothing (RoPE is relative);
    shifting the context alone does."""
    mha = layer("rope", False, "auto")
    x, context = (
        torch.randn(1, 4, D, dtype=torch.float64),
        torch.randn(1, 6, D, dtype=torch.float64),
    )
    with torch.no_grad():
        base = mha(x, context=context)
        both = mha(
            x,
            Positions.from_length(4, offset=5),
            context=context,
            context_positions=Positions.from_length(6, offset=5),
        )
        ctx_only = mha(x, context=context, context_positions=Positions.from_length(6, offset=5))
    torch.testing.assert_close(both, base, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(ctx_only, base, atol=1e-6)


# ------------------------------------------------------------------------------ errors
ERRORS = [
    ("context not 3-D", {"context": torch.randn(2, D)}, ValueError,
     r"context must have shape \(b=2, m, d_model=8\), got \(2, 8\)"),
    ("context of wrong width", {"context": torch.randn(2, 4, 6)}, ValueError,
     r"context must have shape \(b=2, m, d_model=8\), got \(2, 4, 6\)"),
    ("context batch mismatch", {"context": torch.randn(3, 4, D)}, ValueError,
     r"context must have shape \(b=2, m, d_model=8\), got \(3, 4, 8\)"),
    ("context not a tensor", {"context": [[0.0]]}, TypeError, "context must be a torch.Tensor"),
    ("context of another dtype", {"context": torch.randn(2, 4, D, dtype=torch.float64)},
     TypeError, "context must have x's dtype torch.float32, got dtype torch.float64"),
    ("context_positions without context", {"context_positions": Positions.from_length(4)},
     ValueError, "context_positions given without context="),
    ("context masks without context",
     {"context_padding_mask": torch.ones(2, 4, dtype=torch.bool),
      "context_segment_ids": torch.zeros(2, 4, dtype=torch.long)},
     ValueError, "context_padding_mask, context_segment_ids given without context="),
    ("two context position sources",
     {"context": torch.randn(2, 4, D), "context_positions": Positions.from_length(4),
      "context_padding_mask": torch.ones(2, 4, dtype=torch.bool)},
     ValueError,
     r"pass at most one of context_positions, context_padding_mask, context_segment_ids; "
     r"got \['context_positions', 'context_padding_mask'\]"),
    ("context mask of wrong shape",
     {"context": torch.randn(2, 4, D), "context_padding_mask": torch.ones(2, 5, dtype=torch.bool)},
     ValueError, r"context_padding_mask must have shape \(b, n\) = \(2, 4\), got \(2, 5\)"),
    ("context segment ids of wrong shape",
     {"context": torch.randn(2, 4, D), "context_segment_ids": torch.zeros(4, dtype=torch.long)},
     ValueError, r"context_segment_ids must have shape \(b, n\) = \(2, 4\), got \(4,\)"),
    ("context positions of wrong length",
     {"context": torch.randn(2, 4, D), "context_positions": Positions.from_length(3)},
     ValueError,
     r"context_positions have shape \(b, n\) = \(1, 3\); expected \(2, 4\) or \(1, 4\)"),
    ("context mask not bool",
     {"context": torch.randn(2, 4, D), "context_padding_mask": torch.ones(2, 4)},
     TypeError, "context_padding_mask must be a bool tensor"),
    ("cache with context", {"context": torch.randn(2, 4, D), "cache": KVCache()}, ValueError,
     "cache cannot be combined with context: .* pass the context at every decoding step"),
    ("packed queries, one-document context",
     {"context": torch.randn(2, 4, D), "segment_ids": torch.tensor([[0, 0, 1]] * 2)}, ValueError,
     "segment_ids given without context_segment_ids or context_positions: .* its own segment"),
    ("packed context, one-document queries",
     {"context": torch.randn(2, 4, D), "context_segment_ids": torch.tensor([[0, 0, 1, 1]] * 2)},
     ValueError, "context_segment_ids given without segment_ids or positions"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "error", "match"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_bad_context_inputs(kw, error, match):
    mha = MultiheadAttention(D, H, "rope")
    with pytest.raises(error, match=match):
        mha(torch.randn(2, 3, D), **kw)
