"""Hypothesis fuzz of the public API, ``relpos.MultiheadAttention``, on every scheme and backend.

Random schemes (``SCHEME_SPECS``), causal or not, batch 1–3, length 0–40, heads 1–3, head dim 1–8,
float32 / float64 / bfloat16. Properties:

* **parity**: with positions given as nothing, ``padding_mask=`` (all-True, all-False rows, left,
  right, random), ``segment_ids=`` (packed or interleaved, -1 padding) or ``positions=Positions…``,
  ``sdpa``, ``chunked`` and ``auto`` equal ``eager`` on the same weights; padding outputs are
  exactly 0; finite inputs give finite outputs. Or a clear ``ValueError``: ``sdpa`` with Shaw's
  value term (documented unsupported), a geometry the scheme rejects (odd width, rotary dim);
* **KV cache**: decoding in random chunk sizes (a padded or packed prompt first) equals the full
  forward pass;
* **batch isolation**: NaN or ±inf anywhere in one batch row leaves every other row bit-identical;
* **length 0**: every backend returns an empty ``(b, 0, d_model)`` result (issue 21 item 8);
* **malformed input**: a ``ValueError``/``TypeError`` whose message names the argument.

* **non-finite values**: NaN/inf at a padding position never reach a real token; inside one
  packed document they may reach the row's other documents (documented; a strict xfail, so a
  fix is noticed);
* **non-finite inputs and weights** (issue 45): NaN or ±inf in any token or any parameter gives
  on every backend what ``eager`` gives (the same NaN and inf entries, the same numbers
  elsewhere, padding 0: ``attention.contract.propagate_nonfinite``); NaN or ±inf in padding
  tokens reach no gradient (every gradient equals that of the same batch with finite padding).
  Cheap draws by default, wide ones (``_wide``) under ``@pytest.mark.slow`` (``make test-all``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relpos import KVCache, MultiheadAttention, Positions
from relpos.attention.backends import BACKENDS as ATTENTION
from tests.helpers import (
    ATTENTION_SPECS,
    SCHEME_SPECS,
    absolute,
    causal_only,
    length_dependent,
    random_segments,
    randomize_parameters,
    spec_id,
    tiles_refuse,
)

BACKENDS = ["eager", "sdpa", "chunked", "auto"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2}


def fuzz(examples: int) -> settings:
    """Deterministic (CI is reproducible), no deadline; the whole file runs in ~15 s."""
    return settings(
        max_examples=examples, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def unsupported(spec: dict, backend: str) -> bool:
    """``sdpa`` documents Shaw's value term as unsupported, ``chunked`` a key bias with no
    relative form (CoPE's): a clear ValueError. ``fused`` runs CUDA tensors (``tests/fused`` has
    its own cases)."""
    if backend == "fused" or (backend == "chunked" and tiles_refuse(spec)):
        return True
    return backend == "sdpa" and spec["name"] == "shaw" and spec.get("values", True)


def build(spec: dict, h: int, d: int, causal: bool, dtype=torch.float32):
    """The module (``eager``) with random weights; None where the scheme rejects the geometry
    or the direction (a causal-only scheme, bidirectional)."""
    if not causal and causal_only(spec):
        with pytest.raises(ValueError, match="causal"):
            MultiheadAttention(h * d, h, spec, causal=causal)
        return None
    if absolute(spec):  # it acts at the input (TokenPositionEmbedding)
        with pytest.raises(ValueError, match=r"absolute|d_model"):
            MultiheadAttention(h * d, h, spec, causal=causal)
        return None
    rotary = spec.get("rotary_dim", d)
    if causal_only(spec) and not causal:
        with pytest.raises(ValueError, match="causal attention only"):
            MultiheadAttention(h * d, h, spec, causal=causal)
        return None
    if (spec["name"] in ("sinusoidal", "transformer_xl") and h * d % 2) or (
        spec["name"] == "rope" and (rotary % 2 or rotary > d)
    ):
        with pytest.raises(ValueError, match=r"d_model|dim"):
            MultiheadAttention(h * d, h, spec, causal=causal)
        return None
    m = MultiheadAttention(h * d, h, spec, causal=causal, backend="eager")
    randomize_parameters(m)
    return m.to(dtype)


@st.composite
def masks(draw, b: int, n: int) -> torch.Tensor:
    rows = []
    for _ in range(b):
        kind = draw(st.sampled_from(["all", "none", "left", "right", "random"]))
        k = draw(st.integers(0, n))
        rows.append({
            "all": [True] * n, "none": [False] * n,
            "left": [False] * k + [True] * (n - k), "right": [True] * k + [False] * (n - k),
        }.get(kind) or draw(st.lists(st.booleans(), min_size=n, max_size=n)))  # fmt: skip
    return torch.tensor(rows, dtype=torch.bool).reshape(b, n)


@st.composite
def segments(draw, b: int, n: int) -> torch.Tensor:
    """Per row: packed documents with padding at the ends, or arbitrary interleaved ids."""
    rows = [
        random_segments(draw(st.randoms(use_true_random=False)), n)
        if draw(st.booleans())
        else draw(st.lists(st.integers(-1, 2), min_size=n, max_size=n))
        for _ in range(b)
    ]
    return torch.tensor(rows, dtype=torch.long).reshape(b, n)


@st.composite
def where(draw, b: int, n: int) -> dict:
    """Keyword arguments placing the tokens, in every form ``forward`` accepts."""
    kind = draw(st.sampled_from(["none", "mask", "segments", "length", "row-offset", "lengths"]))
    if kind == "mask":
        return {"padding_mask": draw(masks(b, n))}
    if kind == "segments":
        return {"segment_ids": draw(segments(b, n))}
    if kind == "length":
        return {"positions": Positions.from_length(n, offset=draw(st.integers(0, 20)))}
    if kind == "row-offset":
        offsets = torch.tensor(draw(st.lists(st.integers(0, 20), min_size=b, max_size=b)))
        return {"positions": Positions.from_padding_mask(draw(masks(b, n)), offset=offsets)}
    if kind == "lengths":
        rows = []
        for _ in range(b):
            rows.append([])
            for _ in range(draw(st.integers(0, 3))):
                rows[-1].append(draw(st.integers(0, n - sum(rows[-1]))))
        return {"positions": Positions.from_lengths(rows, n)}
    return {}


def valid_of(b: int, n: int, kw: dict) -> torch.Tensor:
    if "padding_mask" in kw:
        return kw["padding_mask"]
    if "segment_ids" in kw:
        return kw["segment_ids"] != -1
    if "positions" in kw:
        return kw["positions"].valid.expand(b, n)
    return torch.ones(b, n, dtype=torch.bool)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    if dtype == torch.bfloat16:  # 8 mantissa bits: relative to the output's scale
        out, ref = out.float(), ref.float()
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
        torch.testing.assert_close(out, ref, atol=tol * scale, rtol=tol)
    else:
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


shapes = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 8))  # b, h, d
lengths = st.sampled_from(range(41))  # uniform: 0 and 1 included, long rows common
specs = st.sampled_from(SCHEME_SPECS)


@fuzz(250)
@given(
    spec=specs, causal=st.booleans(), backend=st.sampled_from(BACKENDS[1:]), shape=shapes,
    dtype=st.sampled_from(list(TOL)), n=lengths, data=st.data(),
)  # fmt: skip
def test_backend_matches_eager(spec, causal, backend, shape, dtype, n, data):
    b, h, d = shape
    m, kw = build(spec, h, d, causal, dtype), data.draw(where(b, n))
    if m is None:
        return
    x = torch.randn(b, n, h * d, dtype=dtype)
    with torch.no_grad():
        ref = m(x, **kw)
        m.backend = backend
        if unsupported(spec, backend):
            with pytest.raises(ValueError, match=r"backend cannot add the (value term|key bias)"):
                m(x, **kw)
            return
        out = m(x, **kw)
    assert out.shape == (b, n, h * d) and out.dtype == dtype
    assert_close(out, ref, dtype)
    assert torch.isfinite(out).all()
    assert (out[~valid_of(b, n, kw)] == 0).all()


@fuzz(100)
@given(
    spec=specs, backend=st.sampled_from(BACKENDS), shape=shapes, n=st.integers(1, 24),
    dtype=st.sampled_from([torch.float32, torch.float64]), data=st.data(),
    prompt=st.sampled_from(["none", "mask", "segments"]),
)  # fmt: skip
def test_kv_cache_matches_full_forward(spec, backend, shape, n, dtype, data, prompt):
    b, h, d = shape
    m = build(spec, h, d, True, dtype)
    # A length-dependent RoPE equals the forward over each step's prefix, not over all n tokens
    # (docs/rope.md); test_rope_scaling and the conformance suite check that on every backend.
    if m is None or unsupported(spec, backend) or length_dependent(spec):
        return
    sizes, left = [], n  # chunk sizes: the prompt (>= 1 token), then any, 0 included
    while left:
        sizes.append(data.draw(st.integers(0 if sizes else 1, left)))
        left -= sizes[-1]
    p, x, first, full = sizes[0], torch.randn(b, n, h * d, dtype=dtype), {}, {}
    if prompt == "mask":
        mask = data.draw(masks(b, p))
        rest = torch.ones(b, n - p, dtype=torch.bool)
        first, full = {"padding_mask": mask}, {"padding_mask": torch.cat([mask, rest], 1)}
    elif prompt == "segments":
        ids = data.draw(segments(b, p))
        # New tokens continue each row's last document (document 0 when the row has none).
        last = [next((s for s in reversed(row) if s != -1), 0) for row in ids.tolist()]
        rest = torch.tensor(last).reshape(b, 1).expand(b, n - p)
        first, full = {"segment_ids": ids}, {"segment_ids": torch.cat([ids, rest], 1)}
    with torch.no_grad():
        ref = m(x, **full)
        m.backend, cache, outs = backend, KVCache(), []
        for i, t in enumerate(torch.tensor([0, *sizes]).cumsum(0)[:-1].tolist()):
            outs.append(m(x[:, t : t + sizes[i]], cache=cache, **(first if i == 0 else {})))
    out = torch.cat(outs, 1)
    assert len(cache) == n
    assert_close(out, ref, dtype)
    assert (out[~valid_of(b, n, full)] == 0).all() and torch.isfinite(out).all()


@fuzz(120)
@given(
    spec=specs, causal=st.booleans(), backend=st.sampled_from(BACKENDS), shape=shapes,
    n=st.integers(1, 40), bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    data=st.data(),
)  # fmt: skip
def test_nan_inf_stay_in_their_batch_row(spec, causal, backend, shape, n, bad, data):
    b, h, d = max(shape[0], 2), shape[1], shape[2]
    m = build(spec, h, d, causal)
    if m is None or unsupported(spec, backend):
        return
    m.backend, kw, x = backend, data.draw(where(b, n)), torch.randn(b, n, h * d)
    r, t, c = (data.draw(st.integers(0, s - 1)) for s in (b, n, h * d))
    dirty = x.clone()
    dirty[r, t, c] = bad
    with torch.no_grad():
        clean, out = m(x, **kw), m(dirty, **kw)
    others = [i for i in range(b) if i != r]
    assert torch.equal(out[others], clean[others])


ISOLATION_CASES = [
    pytest.param(spec, backend, id=f"{backend}-{spec_id(spec)}")
    for spec in ATTENTION_SPECS for backend in BACKENDS if not unsupported(spec, backend)
]  # fmt: skip


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30], ids=["nan", "inf", "1e30"])
@pytest.mark.parametrize(("spec", "backend"), ISOLATION_CASES)
@pytest.mark.matrix
def test_a_bad_token_stays_in_its_batch_row_for_every_scheme(spec, backend, bad):
    """Every scheme and backend, not only those the fuzz draws: a whole token of NaN, inf or a
    value whose products overflow (CoPE's gates turn them into NaN positions) changes no other
    row."""
    m = build(spec, 2, 4, True)
    m.backend, x = backend, torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    dirty = x.clone()
    dirty[1, 2] = bad
    with torch.no_grad():
        assert torch.equal(m(dirty)[0], m(x)[0])


BAD_VALUES = st.sampled_from([float("nan"), float("inf"), -float("inf")])


def _poison(m: MultiheadAttention, x: torch.Tensor, target: str, bad: float, data) -> None:
    """Put ``bad`` into one entry of ``x`` (any token, real or padding) or of one parameter."""
    if target == "token":
        x[tuple(data.draw(st.integers(0, s - 1)) for s in x.shape)] = bad
        return
    params = [p for p in m.parameters() if p.numel()]
    p = params[data.draw(st.integers(0, len(params) - 1))]
    with torch.no_grad():
        p.view(-1)[data.draw(st.integers(0, p.numel() - 1))] = bad


def check_nonfinite_forward(spec, causal, backend, shape, n, bad, target, dtype, data):
    """Issue 45 item 1: one rule on every backend for NaN and inf in the input or the weights,
    ``eager``'s: the same NaN and inf entries, the same finite numbers elsewhere, padding 0."""
    b, h, d = shape
    m, kw = build(spec, h, d, causal, dtype), data.draw(where(b, n))
    if m is None or unsupported(spec, backend):
        return
    x = torch.randn(b, n, h * d, dtype=dtype)
    _poison(m, x, target, bad, data)
    with torch.no_grad():
        ref = m(x, **kw)
        m.backend = backend
        out = m(x, **kw)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    assert (out[~valid_of(b, n, kw)] == 0).all()


def check_nonfinite_padding_backward(spec, causal, backend, shape, n, bad, data):
    """Issue 45 item 4: NaN or inf in padding tokens reach no gradient: the loss over the real
    outputs gives every parameter and input the gradients of the same batch with finite padding
    (and of ``eager``); the padding tokens' own gradient is 0."""
    b, h, d = shape
    m = build(spec, h, d, causal, torch.float64)
    if data.draw(st.booleans()):
        kw = {"padding_mask": data.draw(masks(b, n))}
    else:
        kw = {"segment_ids": data.draw(segments(b, n))}
    valid = valid_of(b, n, kw)
    if m is None or unsupported(spec, backend) or valid.all():
        return
    clean = torch.randn(b, n, h * d, dtype=torch.float64)
    dirty = clean.clone()
    pads = (~valid).nonzero().tolist()
    r, t = pads[data.draw(st.integers(0, len(pads) - 1))]
    dirty[r, t, data.draw(st.integers(0, h * d - 1))] = bad

    def grads(x: torch.Tensor, name: str) -> list[torch.Tensor]:
        m.backend, m.training = name, True
        m.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        m(x, **kw)[valid].sum().backward()
        return [x.grad] + [p.grad for p in m.parameters() if p.grad is not None]

    want, got = grads(clean, "eager"), grads(dirty, backend)
    assert all(torch.isfinite(g).all() for g in got)
    assert (got[0][~valid] == 0).all()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)


nonfinite_forward = {
    "spec": specs, "causal": st.booleans(), "backend": st.sampled_from(BACKENDS[1:]),
    "shape": shapes, "n": st.integers(1, 24), "bad": BAD_VALUES,
    "target": st.sampled_from(["token", "weight"]),
    "dtype": st.sampled_from([torch.float32, torch.float64]), "data": st.data(),
}  # fmt: skip
padding_backward = {
    "spec": specs, "causal": st.booleans(), "backend": st.sampled_from(BACKENDS),
    "shape": shapes, "n": st.integers(1, 24), "bad": BAD_VALUES, "data": st.data(),
}  # fmt: skip


@fuzz(120)
@given(**nonfinite_forward)
def test_nonfinite_inputs_and_weights_match_eager(**kw):
    check_nonfinite_forward(**kw)


@pytest.mark.slow
@fuzz(1500)
@given(**nonfinite_forward)
def test_nonfinite_inputs_and_weights_match_eager_wide(**kw):
    check_nonfinite_forward(**kw)


@fuzz(60)
@given(**padding_backward)
def test_nonfinite_padding_reaches_no_gradient(**kw):
    check_nonfinite_padding_backward(**kw)


@pytest.mark.slow
@fuzz(800)
@given(**padding_backward)
def test_nonfinite_padding_reaches_no_gradient_wide(**kw):
    check_nonfinite_padding_backward(**kw)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_at_padding_never_reach_a_real_token(backend, bad):
    """Issue 21 item 1: keys and values at padding positions are zeroed before every kernel, so
    a bad value there changes no real token (not even as 0·NaN), and padding outputs stay 0."""
    m = build({"name": "t5", "num_buckets": 8, "max_distance": 12}, 2, 4, False)
    m.backend, x = backend, torch.randn(1, 6, 8)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    dirty = x.clone()
    dirty[0, 5, 3] = bad
    with torch.no_grad():
        out = m(dirty, padding_mask=mask)
        assert torch.equal(out[:, :4], m(x, padding_mask=mask)[:, :4])
        assert torch.equal(out[:, 4:], torch.zeros_like(out[:, 4:]))


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_at_padding_never_reach_a_gradient(backend, bad, cross):
    """Issue 45 item 4: the weight gradients of ``y[mask].sum().backward()`` were NaN with a NaN
    in a padding token (``NaN·0`` in every projection's weight gradient); the layer now drops
    padding tokens (``torch.where``) before any projection, so every gradient is finite and equal
    to that of the same batch with finite padding."""
    m = build({"name": "t5", "num_buckets": 8, "max_distance": 12}, 2, 4, True)
    m.backend = backend
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] + [True] * 5])
    clean = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    dirty = clean.clone()
    dirty[0, 5, 3], dirty[1, 0, 0] = bad, bad
    grads = []
    for x in (clean, dirty):
        m.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        kw = {"padding_mask": mask}
        if cross:  # the queries and the context both padded
            kw |= {"context": x * 2, "context_padding_mask": mask}
        m(x, **kw)[mask].sum().backward()
        grads.append([x.grad, *(p.grad for p in m.parameters())])
    for g, want in zip(grads[1], grads[0], strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, want)


@pytest.mark.xfail(
    strict=True,
    reason="documented (README): packed documents are isolated for finite inputs; a NaN or inf "
    "in one document reaches the others of its row as 0·NaN in the probabilities·values product",
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_in_one_packed_document_reach_the_others(backend, bad):
    m = build({"name": "t5", "num_buckets": 8, "max_distance": 12}, 2, 4, False)
    m.backend, x = backend, torch.randn(1, 6, 8)
    kw = {"segment_ids": torch.tensor([[0, 0, 0, 1, 1, 1]])}
    dirty = x.clone()
    dirty[0, 1, 3] = bad
    with torch.no_grad():
        assert torch.equal(m(dirty, **kw)[:, 3:], m(x, **kw)[:, 3:])


EMPTY = {
    "none": {}, "mask": {"padding_mask": torch.zeros(3, 0, dtype=torch.bool)},
    "segments": {"segment_ids": torch.zeros(3, 0, dtype=torch.long)}, "cache": {"cache": None},
}  # fmt: skip
EMPTY_CASES = [
    pytest.param(
        backend, spec, causal, how, id=f"{backend}-{spec_id(spec)}-{causal}-{how}"
    )
    for backend in BACKENDS for spec in ATTENTION_SPECS if not unsupported(spec, backend)
    for causal in (True, False) if causal or not causal_only(spec) for how in EMPTY
]  # fmt: skip


@pytest.mark.parametrize(("backend", "spec", "causal", "how"), EMPTY_CASES)
@pytest.mark.matrix
def test_empty_length(backend, spec, causal, how):
    """Issue 21 item 8: length 0 gives an empty (b, 0, d_model) result on every backend."""
    m = build(spec, 2, 4, causal)
    m.backend = backend
    with torch.no_grad():
        out = m(torch.randn(3, 0, 8), **({"cache": KVCache()} if how == "cache" else EMPTY[how]))
    assert out.shape == (3, 0, 8)


EMPTY_BATCH_CASES = [
    pytest.param(backend, spec, id=f"{backend}-{spec_id(spec)}")
    for backend in BACKENDS for spec in ATTENTION_SPECS if not unsupported(spec, backend)
]  # fmt: skip


@pytest.mark.parametrize(("backend", "spec"), EMPTY_BATCH_CASES)
@pytest.mark.matrix
def test_empty_batch(backend, spec):
    """Batch 0 (an empty last shard): an empty (0, n, d_model) result on every backend, with a
    padding mask or a context too, and a backward pass; a KV cache is refused clearly."""
    m = build(spec, 2, 4, True)
    m.backend = backend
    x = torch.randn(0, 5, 8, requires_grad=True)
    outs = [m(x), m(x, padding_mask=torch.ones(0, 5, dtype=torch.bool))]
    if "contextualize" not in m.scheme.hooks:  # the forget gate is self-attention only
        outs.append(m(x, context=torch.randn(0, 3, 8)))
    for out in outs:
        assert out.shape == (0, 5, 8)
        out.sum().backward()
    with pytest.raises(ValueError, match="empty batch"):
        m(x, cache=KVCache())


@pytest.mark.parametrize(("backend", "spec"), EMPTY_BATCH_CASES)
@pytest.mark.matrix
def test_empty_batch_called_directly(backend, spec):
    """A backend called with zero rows and batch-1 positions (which broadcast over any batch),
    padded or not: an empty ``(0, h, i, d)`` result and a backward pass, not a broadcast error."""
    scheme = build(spec, 2, 4, True).scheme
    plain = Positions.from_length(5)
    padded = Positions.from_padding_mask(torch.tensor([[False, True, True, True, True]]))
    q = torch.randn(0, 2, 5, 4, requires_grad=True)
    k, v = torch.randn(0, 2, 5, 4), torch.randn(0, 2, 5, 4)
    for positions in (plain, padded):
        out = ATTENTION[backend](q, k, v, scheme, positions, positions, causal=True)
        assert out.shape == (0, 2, 5, 4)
        out.sum().backward()


def malformed(b: int, n: int) -> dict:
    """Kinds of bad input to an 8-wide layer: ``(args, kwargs, the argument's name)``."""
    x, ones = torch.randn(b, n, 8), torch.ones(b, n, dtype=torch.bool)
    return {
        "x rank 2": ((x[0],), {}, "x"),
        "x rank 4": ((x[None],), {}, "x"),
        "x last dim": ((torch.randn(b, n, 6),), {}, "x"),
        "x integer": ((x.long(),), {}, "x"),
        "mask shape": ((x,), {"padding_mask": ones[:, :-1]}, "padding_mask"),
        "mask rank": ((x,), {"padding_mask": ones[..., None]}, "padding_mask"),
        "mask float": ((x,), {"padding_mask": ones.float()}, "padding_mask"),
        "mask list": ((x,), {"padding_mask": ones.tolist()}, "padding_mask"),
        "segments list": ((x,), {"segment_ids": ones.long().tolist()}, "segment_ids"),
        "segments float": ((x,), {"segment_ids": ones.float()}, "segment_ids"),
        "segments bool": ((x,), {"segment_ids": ones}, "segment_ids"),
        "segments below -1": ((x,), {"segment_ids": -2 * ones.long()}, "segment_ids"),
        "segments shape": ((x,), {"segment_ids": ones.long()[:1, :, None]}, "segment_ids"),
        "positions tensor": ((x, torch.arange(n)), {}, "positions"),
        "positions length": ((x, Positions.from_length(n + 1)), {}, "positions"),
        "mask and segments": ((x,), {"padding_mask": ones, "segment_ids": ones.long()}, "one of"),
    }


KINDS = list(malformed(1, 2))


@pytest.mark.parametrize("kind", KINDS)
@fuzz(4)
@given(b=st.integers(1, 3), n=st.integers(1, 9), backend=st.sampled_from(BACKENDS))
def test_malformed_input_names_the_argument(kind, b, n, backend):
    args, kwargs, name = malformed(b, n)[kind]
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        MultiheadAttention(8, 2, "t5", causal=True, backend=backend)(*args, **kwargs)
