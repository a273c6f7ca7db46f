"""The ``fused`` backend and its Triton kernel (``relpos.kernels.relative_attention``).

Runs where Triton is: on CUDA, or on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, which ``tests/run_suites.py`` sets for this folder; the PyTorch suite
leaves it out). The interpreter runs the kernels' own code, block by block, so every mask, gather,
row reduction and tile skip is checked on any machine; only timing needs a GPU. Its ``tl.dot`` in
bfloat16 is wrong (a Triton interpreter limitation), so bfloat16 runs on CUDA only; float16 stands
for the half-precision path on CPU.

Checks: the kernel against a loop over ``(i, j)`` (``tests/oracles.py``) and ``eager``, outputs and
every gradient (inputs and the scheme's tables) for every relative scheme and every layout
(plain, padding, packing, a KV cache); the register, stored and atomic row reductions; packed =
alone; queries with no key; dropout against the definition under the kernel's own mask; the
refusals.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

import relpos
from relpos.attention.backends import BACKENDS
from relpos.attention.contract import is_contiguous_self
from relpos.attention.fused import (
    fused_attention,
    fused_sums_atomically,
    fused_sums_by_entry,
    fused_supports,
    fused_takes_keys,
)
from relpos.functional.distance_form import DISTANCE_FORMS, DistanceForm
from relpos.kernels.aot import variant_launches
from relpos.kernels.relative_attention import (
    MAX_LOOP_ROWS,
    Tiles,
    block_ranges,
    dropout_keep,
    keyed_logits,
    launch_config,
    lut_with_runs,
    recorded_launches,
    relative_flash_attention,
    tile_options,
)
from relpos.schemes.base import RelativeScheme
from tests import oracles
from tests.helpers import (
    BACKEND_SPECS,
    fused_device,
    make_layout,
    randomize_parameters,
    spec_id,
)

DEVICE = fused_device()

#: Every spec the fused backend runs (the relative schemes, ALiBi, the distance biases), each
#: path of its own: learned ALiBi's slopes' gradient, KERPLE's two closed forms (the backend
#: suites' KERPLE is its log form), a distance bias's learned table (DPB).
OWN_PATHS = [{"name": "learned_alibi"}, {"name": "kerple", "variant": "power"}, {"name": "dpb"}]
FUSED_SPECS = [
    s
    for s in [*BACKEND_SPECS, *OWN_PATHS]
    if fused_supports(relpos.make_scheme(s, d_model=8, num_heads=2, causal=True), device=DEVICE)
]
LAYOUTS = ["plain", "left-pad", "packed", "cached"]
#: The specs with a relative table (not ALiBi's slopes nor a distance bias's function).
RELATIVE_SPECS = [
    s
    for s in FUSED_SPECS
    if isinstance(relpos.make_scheme(s, d_model=8, num_heads=2, causal=True), RelativeScheme)
]


def _rows(p: relpos.Positions, b: int) -> tuple[list, list]:
    p = p.expand(b)
    return p.pos.tolist(), p.seg.tolist()


def _case(spec, layout, causal, seed, *, b=2, h=2, d=8, n=37, dtype=torch.float32):
    rng = random.Random(f"{spec_id(spec)}{layout}{causal}{seed}")
    torch.manual_seed(rng.randrange(1 << 30))
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal)
    randomize_parameters(scheme, seed)
    scheme.to(DEVICE)
    qp, kp = make_layout(layout, rng, b, n)
    same = kp is qp  # plain self-attention: one object, as the layers pass it
    qp = qp.to(DEVICE)
    kp = qp if same else kp.to(DEVICE)
    assert (layout == "plain") == is_contiguous_self(qp, kp)
    kw = {"dtype": dtype, "device": DEVICE, "requires_grad": True}
    q = torch.randn(b, h, len(qp), d, **kw)
    k = torch.randn(b, h, n, d, **kw)
    v = torch.randn(b, h, n, d, **kw)
    return scheme, q, k, v, qp, kp


def _grads(out, scheme, q, k, v, grad_out):
    inputs = [q, k, v, *scheme.parameters()]
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True)


def _assert_close(got, want, tol, what):
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol, msg=what)


def _assert_all_close(got, want, tol, what):
    """Outputs and gradients, pairwise (a gradient None on one side is None on the other)."""
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"{what}: tensor {t}"
            continue
        _assert_close(g, w, tol, f"{what}: tensor {t}")


def _assert_equals_eager64(out, scheme, q, k, v, qp, kp, causal, grad_out, what) -> None:
    """``out`` and its gradients (``q``, ``k``, ``v``, the scheme's parameters) within 1e-4 of
    float64 ``eager``'s; the scheme is left in float32."""
    got = (out, *_grads(out, scheme, q, k, v, grad_out))
    wide = scheme.double()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = BACKENDS["eager"](q64, k64, v64, wide, qp, kp, causal=causal)
    want = (ref, *_grads(ref, wide, q64, k64, v64, grad_out.double()))
    _assert_all_close(got, want, 1e-4, what)
    scheme.float()


def _eager_cases() -> list:
    """Every spec × layout × direction; the default run keeps two per spec, rotating through the
    layouts so that every layout and direction is covered (``-m slow``: the rest; the
    interpreter takes about a second a case)."""
    cases = []
    for n, spec in enumerate(FUSED_SPECS):
        default = {(LAYOUTS[n % 4], True), (LAYOUTS[(n + 1) % 4], False)}
        for layout in LAYOUTS:
            for causal in (True, False):
                marks = () if (layout, causal) in default else pytest.mark.slow
                name = f"{spec_id(spec)}-{layout}-{'causal' if causal else 'bidirectional'}"
                cases.append(pytest.param(spec, layout, causal, marks=marks, id=name))
    return cases


@pytest.mark.parametrize(("spec", "layout", "causal"), _eager_cases())
def test_fused_equals_eager_outputs_and_gradients(spec, layout, causal):
    """Float32, against float64 ``eager``: outputs, ``q``, ``k``, ``v`` and the tables' grads."""
    scheme, q, k, v, qp, kp = _case(spec, layout, causal, 0)
    out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
    assert out.dtype == q.dtype
    grad_out = torch.randn_like(out)
    got = _grads(out, scheme, q, k, v, grad_out)
    wide = scheme.double()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = BACKENDS["eager"](q64, k64, v64, wide, qp, kp, causal=causal)
    want = _grads(ref, wide, q64, k64, v64, grad_out.double())
    _assert_close(out, ref, 1e-4, "output")
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), f"gradient {t}"
        if g is not None:
            _assert_close(g, w, 1e-4, f"gradient {t}")


@pytest.mark.parametrize("spec", FUSED_SPECS, ids=spec_id)
def test_fused_equals_the_loop_oracle(spec):
    """The paper's formula one pair at a time, on a padded and packed batch, bidirectional."""
    scheme, q, k, v, qp, kp = _case(spec, "packed", False, 1, n=21)
    with torch.no_grad():
        qr, kr = scheme.rotate(q, k, qp, kp)  # Transformer-XL's query shift; the oracle's own
        out = fused_attention(qr, kr, v, scheme, qp, kp, causal=False)
        want = oracles.attention(
            scheme.cpu(), q.cpu(), k.cpu(), v.cpu(), *_rows(qp, 2), *_rows(kp, 2), causal=False
        )
    _assert_close(out.cpu(), want, 1e-4, "output")


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "music", "max_distance": 129},
        {"name": "deberta", "position_buckets": 0, "max_relative_positions": 80},
        pytest.param({"name": "shaw", "max_distance": 3}, marks=pytest.mark.slow),
    ],
    ids=spec_id,
)
def test_both_row_reductions(spec):
    """``R`` past :data:`MAX_LOOP_ROWS` reduces ``d rel`` and ``d relk`` by atomic adds over packed
    positions (the Music Transformer, 130 rows; DeBERTa, 160, with a key term; 170 tokens, so
    some tiles lie wholly past the clipping distance and take one add per query or key) and
    stores each query's and key's own rows over plain positions (DeBERTa's tables read per entry
    of its clip, 161), within it in registers (Shaw)."""
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True)
    assert (scheme.num_relative > MAX_LOOP_ROWS) == (spec["name"] != "shaw")
    for layout in ("plain", "packed"):
        scheme, q, k, v, qp, kp = _case(spec, layout, True, 2, n=170)
        out = fused_attention(q, k, v, scheme, qp, kp, causal=True)
        grad_out = torch.randn_like(out)
        got = _grads(out, scheme, q, k, v, grad_out)
        ref = BACKENDS["eager"](q, k, v, scheme, qp, kp, causal=True)
        want = _grads(ref, scheme, q, k, v, grad_out)
        _assert_close(out, ref, 1e-4, layout)
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_close(g, w, 1e-4, f"{layout}: gradient {t}")


def _queries_backward(runs: list) -> object:
    """The queries' backward among one pass's recorded launches (``d q``, ``d rel``)."""
    (launch,) = [r for r in runs if r.kernel.__name__ == "_backward_q_kernel"]
    return launch


#: DeBERTa past the register rows: 144 rows of log buckets, a clip of 149 entries (reach 74).
ENTRIES_SPEC = {"name": "deberta", "position_buckets": 72, "max_relative_positions": 66}
#: Owned rows' cases: causal and bidirectional, with one-row tiles and without (two by default).
OWNED_CASES = [
    pytest.param(True, True, id="causal-one-row"),
    pytest.param(False, False, id="bidirectional-per-pair"),
    pytest.param(True, False, id="causal-per-pair", marks=pytest.mark.slow),
    pytest.param(False, True, id="bidirectional-one-row", marks=pytest.mark.slow),
]


def _assert_tiles_equal_eager(scheme, q, k, v, qp, kp, causal, one_row) -> None:
    """Outputs and every gradient at 32×32 tiles (``one_row`` on or off) against ``eager``."""
    grad_out = torch.randn(*q.shape, device=DEVICE)
    with launch_config(tile=32, one_row=one_row):
        out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
        got = (out, *_grads(out, scheme, q, k, v, grad_out))
    ref = BACKENDS["eager"](q, k, v, scheme, qp, kp, causal=causal)
    want = (ref, *_grads(ref, scheme, q, k, v, grad_out))
    _assert_all_close(got, want, 1e-4, f"causal={causal} one_row={one_row}")


@pytest.mark.parametrize(("causal", "one_row"), OWNED_CASES)
def test_owned_rows_match_eager(causal, one_row):
    """Past :data:`MAX_LOOP_ROWS` rows over plain positions, a shifted clip's ``d rel`` needs no
    atomic adds (``OWN_ROWS``): each query's rows inside the clip are one pair's, stored, and the
    clip's end rows sum per query. The Music Transformer (130 rows causal, 141 bidirectional:
    both end rows), 230 tokens so that tiles lie wholly past the clip, with ``one_row`` tiles
    (one end row per tile) and without: outputs and every gradient against ``eager``."""
    spec = {"name": "music", "max_distance": 129 if causal else 70}
    n = 230
    scheme, q, k, v, qp, kp = _case(spec, "plain", causal, 8, n=n)
    assert scheme.num_relative > MAX_LOOP_ROWS and _one_row_tiles(scheme, n, 32) > 0
    with launch_config(tile=32, one_row=one_row), recorded_launches() as runs:
        torch.autograd.grad(fused_attention(q, k, v, scheme, qp, kp, causal=causal).sum(), q)
    queries = _queries_backward(runs)
    assert queries.constexprs["OWN_ROWS"] and queries.constexprs["ONE_ROW"] == one_row
    _assert_tiles_equal_eager(scheme, q, k, v, qp, kp, causal, one_row)


@pytest.mark.parametrize(("causal", "one_row"), OWNED_CASES)
def test_tables_read_per_entry_own_their_rows(causal, one_row, deterministic):
    """DeBERTa over plain positions, past :data:`MAX_LOOP_ROWS` rows that are log buckets (not
    the clip's distances shifted): ``fused`` hands the kernels both tables read per entry of the
    clip (``row_base`` 0), so each query's and each key's entries are its own and both kernels
    store them (``OWN_ROWS``), summing only the clip's end rows, with no atomic add: the call runs
    in deterministic mode. 144 rows, 149 entries, 160 tokens (tiles wholly past the clip), with
    ``one_row`` tiles and without: outputs and every gradient against ``eager``."""
    n = 160
    scheme, q, k, v, qp, kp = _case(ENTRIES_SPEC, "plain", causal, 9, n=n)
    lut = scheme.relative_index(qp[:1], qp)[0, 0]  # rows of distances 0..n-1 from the first
    assert scheme.num_relative > MAX_LOOP_ROWS and not bool((lut.diff().abs() == 1).all())
    assert 2 * scheme.config.reach + 1 > MAX_LOOP_ROWS and _one_row_tiles(scheme, n, 32) > 0
    deterministic(True)
    assert not fused_sums_atomically(scheme, qp, kp)
    with launch_config(tile=32, one_row=one_row), recorded_launches() as runs:
        out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
        torch.autograd.grad(out.sum(), [q, k, *scheme.parameters()])
    backward = [r for r in runs if r.kernel.__name__ != "_forward_kernel"]
    assert [r.constexprs["OWN_ROWS"] for r in backward] == [True, True]
    _assert_tiles_equal_eager(scheme, q, k, v, qp, kp, causal, one_row)


def test_tables_read_per_entry_fit_the_register_rows_on_short_sequences():
    """A sequence shorter than DeBERTa's clip has fewer entries (79 at 40 tokens) than its 144
    rows, within :data:`MAX_LOOP_ROWS`: both gradients then sum in registers per query and per
    key (``LOOP_ROWS``), matching float64 ``eager``, causal and bidirectional."""
    for causal in (True, False):
        scheme, q, k, v, qp, kp = _case(ENTRIES_SPEC, "plain", causal, 3, n=40)
        assert scheme.num_relative > MAX_LOOP_ROWS
        with recorded_launches() as runs:
            fused_attention(q, k, v, scheme, qp, kp, causal=causal).sum().backward()
        assert [r.constexprs["LOOP_ROWS"] for r in runs[1:]] == [True, True]
        grad_out = torch.randn(*q.shape, device=DEVICE)
        out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
        _assert_equals_eager64(out, scheme, q, k, v, qp, kp, causal, grad_out, f"causal={causal}")


def test_tables_read_per_entry_take_one_load_in_half_precision():
    """In half precision DeBERTa's tables read per entry are read in one load (``SHIFTED``, row
    ``= entry``) by every kernel, both still storing their own rows, with the numbers of the path
    that reads the row from ``lut`` first (``lut_only``): outputs and every gradient."""
    scheme, q, k, v, qp, kp = _case(ENTRIES_SPEC, "plain", True, 4, n=110, dtype=torch.float16)
    grad_out = torch.randn(*q.shape, device=DEVICE)
    results = []
    for lut_only in (False, True):
        with launch_config(tile=32, lut_only=lut_only), recorded_launches() as runs:
            out = fused_attention(q, k, v, scheme, qp, kp, causal=True)
            torch.autograd.grad(out.sum(), [q, k])
        assert {r.constexprs["SHIFTED"] for r in runs} == {not lut_only}
        assert [r.constexprs["OWN_ROWS"] for r in runs[1:]] == [True, True]
        with launch_config(tile=32, lut_only=lut_only):
            out = fused_attention(q, k, v, scheme, qp, kp, causal=True)
            results.append((out, *_grads(out, scheme, q, k, v, grad_out)))
    _assert_all_close(*results, 1e-3, "one load against lut_only")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["left-pad", "right-pad", "packed", "cached"])
def test_block_ranges_hold_every_allowed_pair(layout, causal):
    """The tiles a block visits (``block_ranges``, unaligned: ``step=1``) contain every pair that
    may attend, from the queries' side and from the keys'; a block of padding visits none."""
    for seed in range(6):
        qp, kp = make_layout(layout, random.Random(seed), 3, 45)
        allowed = qp.allowed(kp, causal=causal).expand(3, -1, -1)
        args = {"step": 1, "causal": causal, "batch": 3}
        q = block_ranges(qp.pos, qp.seg, kp.pos, kp.seg, block=8, queries=True, **args)
        k = block_ranges(kp.pos, kp.seg, qp.pos, qp.seg, block=8, queries=False, **args)
        for side, ranges, pairs in (("queries", q, allowed), ("keys", k, allowed.transpose(1, 2))):
            for b, a, o in pairs.nonzero().tolist():
                start, end = ranges[b, a // 8].tolist()
                assert start <= o < end, f"{layout} seed {seed}: {side} block {a // 8} ({b})"
        pad = (qp.seg.expand(3, -1) == -1).view(3, -1)
        for b in range(3):
            for blk in range(q.shape[1]):
                if pad[b, blk * 8 : blk * 8 + 8].all():
                    assert q[b, blk].tolist() == [0, 0]


@pytest.mark.parametrize("spec", RELATIVE_SPECS, ids=spec_id)
def test_lut_runs_end_where_the_row_changes(spec):
    """A tile whose distances lie in one run reads one row (``_one_row``): each entry's run end
    is the last entry of equal rows from it on, against a loop, for every relative scheme's
    table, and a tile has one row exactly when its ends share a run."""
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=False)
    lut = scheme.rows_by_distance(-40, 40, "cpu").to(torch.int32)
    rows, ends = lut_with_runs(lut).tolist()
    assert rows == lut.tolist()
    n = len(rows)
    for x in range(n):
        y = x
        while y + 1 < n and rows[y + 1] == rows[x]:
            y += 1
        assert ends[x] == y, f"entry {x}"
    for lo in range(n):
        for hi in range(lo, n):
            assert (ends[lo] >= hi) == (len(set(rows[lo : hi + 1])) == 1)


def test_packed_documents_equal_each_alone():
    """Two documents in one row give what each gives in a row of its own."""
    spec = {"name": "shaw", "max_distance": 3}
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True).to(DEVICE)
    randomize_parameters(scheme)
    torch.manual_seed(3)
    x = torch.randn(3, 1, 2, 30, 8, device=DEVICE).unbind(0)
    packed = relpos.Positions.from_segments(torch.tensor([[0] * 18 + [1] * 12], device=DEVICE))
    out = fused_attention(*x, scheme, packed, packed, causal=True)
    for lo, hi in ((0, 18), (18, 30)):
        alone = relpos.Positions.from_length(hi - lo, device=DEVICE)
        part = [t[..., lo:hi, :] for t in x]
        want = fused_attention(*part, scheme, alone, alone, causal=True)
        _assert_close(out[..., lo:hi, :], want, 1e-5, f"document {lo}:{hi}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_any_int64_segment_ids(causal):
    """Document ids as segment ids: ids that wrap to one another, or to -1, in int32 (0 and
    2**32, 2**32 - 1) and ids past block_ranges' 2**30 sentinel keep their documents apart, in
    cross-attention too (the queries' and keys' ids are renumbered together)."""
    spec = {"name": "t5", "num_buckets": 8, "max_distance": 12}
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=causal).to(DEVICE)
    randomize_parameters(scheme)
    big = 2**32
    ids = [[0] * 9 + [big] * 9 + [big - 1] * 7 + [2**30 + 5] * 8 + [-1] * 3]
    kids = [[big] * 5 + [0] * 11 + [big - 1] * 6 + [2**30 + 5] * 6]
    qp = relpos.Positions.from_segments(torch.tensor(ids, device=DEVICE))
    kp = relpos.Positions.from_segments(torch.tensor(kids, device=DEVICE))
    g = torch.Generator().manual_seed(5)
    for keys in (qp, kp):
        q = torch.randn(1, 2, len(qp), 8, generator=g).to(DEVICE)
        k, v = (torch.randn(1, 2, len(keys), 8, generator=g).to(DEVICE) for _ in range(2))
        want = BACKENDS["eager"](q, k, v, scheme, qp, keys, causal=causal)
        got = fused_attention(q, k, v, scheme, qp, keys, causal=causal)
        _assert_close(got, want, 1e-5, "cross" if keys is kp else "self")
    # Batch-1 queries (broadcast) against two rows of keys: positions and ids expand together.
    qp1 = relpos.Positions.from_length(7, device=DEVICE)
    kp2 = relpos.Positions.from_segments(torch.tensor([kids[0], kids[0][::-1]], device=DEVICE))
    q = torch.randn(2, 2, 7, 8, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 2, len(kp2), 8, generator=g).to(DEVICE) for _ in range(2))
    want = BACKENDS["eager"](q, k, v, scheme, qp1, kp2, causal=causal)
    _assert_close(fused_attention(q, k, v, scheme, qp1, kp2, causal=causal), want, 1e-5, "b=1")


@pytest.mark.parametrize(
    "spec", [{"name": "alibi"}, {"name": "shaw", "max_distance": 4}], ids=spec_id
)
def test_positions_past_int32(spec):
    """Rows whose positions cross ``2**31`` (where int32 wraps) and the block ranges' ``2**30``
    sentinel, one with left padding, and a KV-cache step continuing them: the kernel's int32
    positions count from each row's first real token, so their order survives. Outputs and
    gradients against ``eager``, causal."""
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True).to(DEVICE)
    randomize_parameters(scheme)
    n = 150  # three blocks of keys
    far = torch.tensor([2**31 - 70, 2**30 - 40], device=DEVICE)
    mask = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    mask[1, :6] = False  # left padding
    keys = relpos.Positions.from_padding_mask(mask, offset=far)
    step = relpos.Positions.from_length(3, offset=far + keys.valid.sum(1))  # the next tokens
    g = torch.Generator().manual_seed(11)
    for qp in (keys, step):
        q = torch.randn(2, 2, len(qp), 8, generator=g).to(DEVICE).requires_grad_()
        k, v = (torch.randn(2, 2, n, 8, generator=g).to(DEVICE).requires_grad_() for _ in "kv")
        got = fused_attention(q, k, v, scheme, qp, keys, causal=True)
        want = BACKENDS["eager"](q, k, v, scheme, qp, keys, causal=True)
        grad_out = torch.randn_like(want)
        _assert_all_close(
            (got, *_grads(got, scheme, q, k, v, grad_out)),
            (want, *_grads(want, scheme, q, k, v, grad_out)),
            1e-5,
            "self" if qp is keys else "cached",
        )


@pytest.mark.parametrize(
    ("spec", "p_drop"),
    [({"name": "music", "max_distance": 129}, 0.0), ({"name": "shaw", "max_distance": 5}, 0.3)],
    ids=["music-wide", "shaw-values-dropout"],
)
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(tile=16, num_warps=8), id="16", marks=pytest.mark.slow),
        pytest.param(dict(tile=64, num_warps=8), id="64"),
        # Tiles of every shape, each kernel its own, and the unchecked loop's whole tiles over
        # them (causal: the key tiles before a query block's first query, cut to whole key
        # tiles where the two sides differ).
        pytest.param(
            dict(forward=(64, 16, 4, 2), keys=(16, 64, 4), queries=(32, 64, 8, 1), unmasked=True),
            id="long-queries",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(forward=(16, 64, 4), keys=(64, 32, 4, 2), queries=(64, 16, 4), unmasked=True),
            id="long-keys",
        ),
    ],
)
@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.matrix
def test_every_tile_size_gives_the_same_numbers(config, layout, spec, p_drop):
    """The tiles (``launch_config``) change only how the work is cut: the block ranges, the
    causal skip and the row sums (the Music Transformer's stored or atomic ones; Shaw's registers
    with its value term) agree with the default tiles to float32 rounding, outputs and gradients,
    square or not, each kernel with its own. The backward pass runs with the launches the forward
    took, wherever it is called. Dropout's mask is drawn per pair, not per tile: the same under
    any tiles."""
    scheme, q, k, v, qp, kp = _case(spec, layout, True, 4, n=150)
    grad_out = torch.randn(*q.shape, device=DEVICE)

    def attend():
        torch.manual_seed(7)  # the kernel's dropout seed
        training = p_drop > 0
        return fused_attention(
            q, k, v, scheme, qp, kp, causal=True, dropout_p=p_drop, training=training
        )

    out = attend()
    want = (out, *_grads(out, scheme, q, k, v, grad_out))
    with launch_config(**config):
        out = attend()
    got = (out, *_grads(out, scheme, q, k, v, grad_out))  # the backward keeps its tiles
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_close(g, w, 1e-5, f"{spec_id(spec)} {layout}: output/gradient {t}")


def _one_row_tiles(scheme, n: int, tile: int) -> int:
    """How many of a plain ``n``-token sequence's tile pairs read one relative row (their
    distances in one run of ``lut_with_runs``): the cases below must have some, or they test
    nothing of that path."""
    _, ends = lut_with_runs(scheme.rows_by_distance(1 - n, n - 1, "cpu")).tolist()
    count = 0
    for m in range(0, n, tile):
        for j in range(0, n, tile):
            lo = j - min(m + tile, n) + 1 + n - 1  # the tile's distances, as entries
            hi = min(j + tile, n) - 1 - m + n - 1
            count += ends[lo] >= hi
    return count


def _one_row_cases() -> list:
    """The first spec of each kind of table, one layout each: a shared table (T5) plain and
    packed, per query with a value term (Shaw) cached, with a key term (DeBERTa) plain
    (``-m slow``: every spec, every layout)."""
    fast = {"t5": ("plain", "packed"), "shaw": ("cached",), "deberta": ("plain",)}
    names = [s["name"] for s in RELATIVE_SPECS]
    return [
        pytest.param(spec, layout, id=f"{spec_id(spec)}-{layout}", marks=() if quick else slow)
        for n, spec in enumerate(RELATIVE_SPECS)
        for layout in ("plain", "packed", "cached")
        for quick in [names.index(names[n]) == n and layout in fast.get(names[n], ())]
        for slow in [pytest.mark.slow]
    ]


@pytest.mark.parametrize(("spec", "layout"), _one_row_cases())
def test_one_row_tiles_give_the_same_numbers(spec, layout):
    """``launch_config(one_row=True)`` reads a tile whose distances share a row once: outputs and
    every gradient as the per-pair path gives them (itself checked against the oracle above), on
    sequences long enough for far-field tiles, causal and not, plain positions and not. With a
    value term only where the queries' backward runs unpipelined (``tile_options``: Triton 3.6
    cannot compile that kernel pipelined for sm_90)."""
    value = "value_term" in relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True).hooks
    for causal in (True, False):
        scheme, q, k, v, qp, kp = _case(spec, layout, causal, 5, n=110)
        assert _one_row_tiles(scheme, 110, 32) > 0
        grad_out = torch.randn(*q.shape, device=DEVICE)
        with launch_config(tile=32, one_row=False):
            out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
            want = (out, *_grads(out, scheme, q, k, v, grad_out))
        unpipelined = {"queries": (32, 32, 4, 1)} if value else {}
        for launches in ({}, unpipelined) if value else ({},):
            with launch_config(tile=32, one_row=True, **launches):
                with torch.no_grad(), recorded_launches() as runs:
                    fused_attention(q, k, v, scheme, qp, kp, causal=causal)
                assert runs[0].constexprs["ONE_ROW"] == (not value or bool(launches))
                out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
                got = (out, *_grads(out, scheme, q, k, v, grad_out))
            what = f"{spec_id(spec)} {layout} causal={causal} {launches}"
            _assert_all_close(got, want, 1e-5, what)


@pytest.mark.parametrize(
    ("variant", "dtype", "one_row", "unmasked"),
    [
        ("t5", torch.bfloat16, True, True),  # a table in half precision: both
        ("music", torch.float16, True, True),
        ("deberta", torch.bfloat16, True, True),  # a key term is a table too
        ("shaw-values", torch.bfloat16, False, True),  # never one row with the mass
        ("alibi", torch.bfloat16, False, False),  # no table: neither
        ("t5", torch.float32, False, False),  # float32: neither (not timed)
    ],
)
def test_tile_options_default_to_what_the_gpu_measured(variant, dtype, one_row, unmasked):
    """With :func:`launch_config` unset the kernels take :func:`tile_options`' measured defaults
    (both kernels of a pass, forward and backward, launched alike), and ``launch_config`` sets
    each either way, except one-row tiles with the mass."""
    assert tile_options(True, False, torch.bfloat16) == (True, True)
    runs = variant_launches(variant, dtype, 64)
    assert {(r.constexprs["ONE_ROW"], r.constexprs["UNMASKED"]) for r in runs} == {
        (one_row, unmasked)
    }, variant
    for flag in (False, True):
        with launch_config(one_row=flag, unmasked=flag):
            assert tile_options(True, False, dtype) == (flag, flag)
            assert tile_options(False, True, dtype) == (False, flag)
            for stages, with_mass in ((None, False), (2, False), (1, flag)):  # the mass: stages 1
                queries = Tiles(64, 32, 8, stages)
                assert tile_options(True, True, dtype, queries) == (with_mass, flag)
        runs = variant_launches(variant, dtype, 64, one_row=flag, unmasked=flag)
        want = flag and "values" not in variant
        assert {(r.constexprs["ONE_ROW"], r.constexprs["UNMASKED"]) for r in runs} == {
            (want, flag)
        }, (variant, flag)


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize(
    "spec",
    [
        {"name": "music", "max_distance": 129},  # 130 rows: owned over plain positions only
        {"name": "deberta"},  # 512 rows: read per entry, so owned, over plain positions only
        {"name": "t5"},  # within MAX_LOOP_ROWS: a register sum
        {"name": "shaw"},
        {"name": "learned_alibi"},
    ],
    ids=spec_id,
)
def test_fused_sums_atomically_says_what_the_kernel_does(spec, layout, deterministic):
    """``fused_sums_atomically`` (what ``auto`` asks in deterministic mode) agrees with the
    kernel's own refusal of atomic row sums there, both ways (no kernel runs: recorded)."""
    scheme, q, k, v, qp, kp = _case(spec, layout, True, 3, n=40)
    deterministic(True)
    summed = fused_sums_atomically(scheme, qp, kp)
    assert summed == (spec["name"] in ("deberta", "music") and layout != "plain")
    _assert_refused_where_summed(scheme, q, k, v, qp, kp, summed)


def _assert_refused_where_summed(scheme, q, k, v, qp, kp, summed: bool) -> None:
    """In deterministic mode the kernel refuses the call where it would sum atomically, and only
    there (recorded: nothing runs)."""
    with recorded_launches():
        if summed:
            with pytest.raises(RuntimeError, match="not deterministic"):
                fused_attention(q, k, v, scheme, qp, kp, causal=True)
        else:
            fused_attention(q, k, v, scheme, qp, kp, causal=True)


@pytest.mark.parametrize(
    ("spec", "n", "summed"),
    [
        ({"name": "dpb"}, 40, False),  # 79 distances: a register sum per query
        ({"name": "dpb"}, 80, True),  # 159: by entry, atomic
        ({"name": "sandwich"}, 80, False),  # nothing learned: no gradient to sum
        ({"name": "kerple"}, 80, False),  # a closed form: no table
    ],
    ids=["dpb-short", "dpb-long", "sandwich-long", "kerple-long"],
)
def test_a_distance_bias_sums_atomically_where_the_kernel_does(spec, n, summed, deterministic):
    """A distance bias's table holds every distance the call sees: past
    :data:`MAX_LOOP_ROWS` of them, a learned one's gradient is summed by atomic adds, and
    ``fused_sums_atomically`` says so as the kernel's own refusal does; KERPLE's closed form
    reads no table, so nothing is summed atomically at any length."""
    scheme, q, k, v, qp, kp = _case(spec, "plain", True, 3, n=n)
    deterministic(True)
    assert fused_sums_atomically(scheme, qp, kp) == summed
    _assert_refused_where_summed(scheme, q, k, v, qp, kp, summed)


def test_fused_names_the_tables_it_sums_by_entry():
    """``fused_sums_by_entry`` (which ``auto`` keeps on ``flex`` for training until timed): the
    distance biases with no closed form, T5 past :data:`MAX_LOOP_ROWS` buckets; no other table."""
    wide = [{"name": "sandwich"}, {"name": "dpb"}]
    wide += [{"name": "t5", "num_buckets": 160, "max_distance": 300}]
    narrow = [{"name": "t5"}, {"name": "learned_alibi"}, {"name": "alibi"}, {"name": "kerple"}]
    narrow += [{"name": "music", "max_distance": 200}, {"name": "deberta"}]
    for specs, expected in ((wide, True), (narrow, False)):
        for spec in specs:
            scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True)
            assert fused_sums_by_entry(scheme) is expected, spec


def _wide_tables() -> list:
    """Tables shared by every query past :data:`MAX_LOOP_ROWS` rows, whose gradient is summed
    by entry (``BY_ENTRY``): a distance bias's over a long sequence, T5 with many buckets; in
    each layout, and ``gaps`` (every other position: no tile's pairs lie on its diagonals)."""
    specs = {"dpb": {"name": "dpb"}}
    specs["t5-wide"] = {"name": "t5", "num_buckets": 160, "max_distance": 300}
    fast = {("dpb", "plain"), ("dpb", "gaps")}
    return [
        pytest.param(spec, layout, id=f"{name}-{layout}", marks=() if fast_case else slow)
        for name, spec in specs.items()
        for layout in [*LAYOUTS, "gaps"]
        for fast_case in [(name, layout) in fast]
        for slow in [pytest.mark.slow]
    ]


@pytest.mark.parametrize(("spec", "layout"), _wide_tables())
def test_a_wide_shared_table_sums_its_gradient_by_entry(spec, layout):
    """Past the register rows a table shared by every query sums its gradient per entry: one
    atomic add per diagonal of a tile where its pairs lie on diagonals (the layouts), one per
    pair otherwise (gaps between positions). Outputs and every gradient against float64
    ``eager``, causal and bidirectional, on 100 tokens (199 distances or more; 150 where they
    are cut into documents; T5's 160 buckets), tiles of two shapes."""
    for causal, launch in ((True, dict(tile=32)), (False, dict(tile=16, forward=(32, 16, 4)))):
        n = 100 if layout in ("plain", "gaps") else 150  # documents long enough
        scheme, q, k, v, qp, kp = _case(
            spec, "plain" if layout == "gaps" else layout, causal, 6, n=n
        )
        if layout == "gaps":
            qp = kp = relpos.Positions(qp.pos * 2, qp.seg)
        grad_out = torch.randn(*q.shape, device=DEVICE)
        with launch_config(**launch):
            with recorded_launches() as runs:
                fused_attention(q, k, v, scheme, qp, kp, causal=causal).sum().backward()
            assert _queries_backward(runs).constexprs["BY_ENTRY"]
            out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
        what = f"{spec_id(spec)} {layout} causal={causal}"
        _assert_equals_eager64(out, scheme, q, k, v, qp, kp, causal, grad_out, what)


#: The distance biases in closed form, and the form each is computed in (causal).
CLOSED_FORMS = [
    ({"name": "alibi"}, "linear"),
    ({"name": "learned_alibi"}, "linear"),
    ({"name": "kerple"}, "kerple_log"),
    ({"name": "kerple", "variant": "power", "heads": [1]}, "kerple_power"),
]


@pytest.mark.parametrize(("spec", "form"), CLOSED_FORMS, ids=[spec_id(s) for s, _ in CLOSED_FORMS])
def test_a_closed_form_reads_no_table_and_sums_no_atomics(spec, form, deterministic):
    """A distance bias in closed form (``distance_form``: ALiBi's line, KERPLE's kernels) is
    computed per pair from two parameters per head: every kernel takes its form (``DIST_FN``)
    and reads no table, and its parameters' gradient is summed per query, never atomically,
    so deterministic mode runs it at any length (80 tokens: 159 distances, past
    :data:`MAX_LOOP_ROWS`), causal and bidirectional, over a KV cache's queries too (recorded:
    nothing runs). The numbers are the suite's (``FUSED_SPECS``); here KERPLE's power form with
    a head left out (``heads``) against float64 ``eager``."""
    deterministic(True)
    for layout, causal in (("plain", True), ("cached", False)):
        scheme, q, k, v, qp, kp = _case(spec, layout, causal, 9, n=80)
        name = "symmetric_linear" if form == "linear" and not causal else form
        assert not fused_sums_atomically(scheme, qp, kp)
        with recorded_launches() as runs:
            fused_attention(q, k, v, scheme, qp, kp, causal=causal).sum().backward()
        flags = {(r.constexprs["DIST_FN"], r.constexprs["HAS_REL"]) for r in runs}
        assert len(runs) == 3 and flags == {(DISTANCE_FORMS.index(name) + 1, False)}, flags
    if form == "kerple_power":
        scheme, q, k, v, qp, kp = _case(spec, "cached", False, 10)
        grad_out = torch.randn(*q.shape, device=DEVICE)
        out = fused_attention(q, k, v, scheme, qp, kp, causal=False)
        _assert_equals_eager64(out, scheme, q, k, v, qp, kp, False, grad_out, spec_id(spec))


def _one_load_cases() -> list:
    """Every relative spec but those whose table reaches the kernels as another's does (a head
    selection, Shaw per head, DeBERTa with one term): ``-m slow`` runs them too."""
    alike = ("heads", "per_head", "pos_att_type")
    slow = pytest.mark.slow
    return [
        pytest.param(s, id=spec_id(s), marks=slow if set(alike) & set(s) else ())
        for s in RELATIVE_SPECS
    ]


@pytest.mark.parametrize("spec", _one_load_cases())
def test_one_load_forms_match_the_table_path(spec):
    """A pair's logit in one load: clipped distances' rows computed (``SHIFTED``: Shaw's keys, the
    Music Transformer, Transformer-XL; with a value term only at tiles under 64×64), a table
    shared by every query read per distance (``BY_DISTANCE``: T5). The kernels are launched so
    (recorded), and give the numbers of the path that reads the row from ``lut`` and then the
    logit (``launch_config(lut_only=True)``), outputs and every gradient, on sequences past the
    clip, plain, packed and cached. In half precision: float32 keeps the table path (its shared
    memory)."""
    for layout, causal in (("plain", True), ("packed", False), ("cached", True)):
        scheme, q, k, v, qp, kp = _case(spec, layout, causal, 6, n=50, dtype=torch.float16)
        clip, mass = scheme.distance_clip, "value_term" in scheme.hooks
        shifted = clip is not None and clip.shifted
        by_distance = scheme.query_independent and not {"value_term", "key_bias"} & scheme.hooks
        assert clip is None or clip.hi - clip.lo < 49, "the case must reach past the clip"
        for lut_only in (False, True):
            with torch.no_grad(), launch_config(tile=32, lut_only=lut_only):
                with recorded_launches() as runs:
                    fused_attention(q, k, v, scheme, qp, kp, causal=causal)
            flags = runs[0].constexprs
            assert flags["SHIFTED"] == (shifted and not lut_only)
            assert flags["BY_DISTANCE"] == (by_distance and not lut_only)
            with torch.no_grad(), recorded_launches() as runs:  # float32: the table path
                fused_attention(q.float(), k.float(), v.float(), scheme, qp, kp, causal=causal)
            assert not runs[0].constexprs["SHIFTED"] and not runs[0].constexprs["BY_DISTANCE"]
        with torch.no_grad(), launch_config(tile=64), recorded_launches() as runs:
            fused_attention(q, k, v, scheme, qp, kp, causal=causal)  # a value term: the lut path
        assert runs[0].constexprs["SHIFTED"] == (shifted and not mass)
        grad_out = torch.randn(*q.shape, device=DEVICE)
        results = []
        for lut_only in (False, True):
            with launch_config(tile=32, lut_only=lut_only):
                out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
                results.append((out, *_grads(out, scheme, q, k, v, grad_out)))
        _assert_all_close(*results, 1e-3, f"{spec_id(spec)} {layout}")


def _first_of_each_kind() -> list:
    """Every fused spec; in the default run the first of each kind of term (Shaw's value term,
    the Music Transformer's table per query, T5's shared one, DeBERTa's key term, ALiBi's line:
    the other distance biases read as T5 or compute as ALiBi), ``-m slow``: the rest."""
    kinds = ("shaw", "music", "t5", "deberta", "alibi")
    names = [s["name"] for s in FUSED_SPECS]
    return [
        pytest.param(s, id=spec_id(s), marks=() if first else pytest.mark.slow)
        for n, (s, name) in enumerate(zip(FUSED_SPECS, names, strict=True))
        for first in [name in kinds and names.index(name) == n]
    ]


@pytest.mark.parametrize("spec", _first_of_each_kind())
def test_unmasked_tiles_give_the_same_numbers(spec):
    """``launch_config(unmasked=True)`` runs the tiles every pair of which may attend (plain
    positions: whole tiles, in the causal past) in a loop that checks nothing per pair: outputs
    and every gradient as the checked loop gives them, causal and bidirectional, with dropout
    for one spec (its mask is drawn per pair, whichever loop draws it)."""
    n, tile = 70, 32  # two whole query blocks: unmasked tiles both ways
    for causal in (True, False):
        scheme, q, k, v, qp, kp = _case(spec, "plain", causal, 8, n=n)
        p_drop = 0.3 if spec == FUSED_SPECS[0] else 0.0
        grad_out = torch.randn(*q.shape, device=DEVICE)
        results = []
        for unmasked in (False, True):
            with launch_config(tile=tile, unmasked=unmasked):
                with torch.no_grad(), recorded_launches() as runs:
                    fused_attention(q, k, v, scheme, qp, kp, causal=causal)
                assert runs[0].constexprs["UNMASKED"] == unmasked
                torch.manual_seed(9)  # the dropout seed
                out = fused_attention(
                    q, k, v, scheme, qp, kp, causal=causal, dropout_p=p_drop, training=p_drop > 0
                )
                results.append((out, *_grads(out, scheme, q, k, v, grad_out)))
        _assert_all_close(*results, 1e-5, f"{spec_id(spec)} causal={causal}")


def test_queries_with_no_key_get_zeros_and_finite_gradients():
    """A decoding step whose queries are padding: zeros out, zeros (not NaN) back."""
    spec = {"name": "shaw", "max_distance": 2}
    scheme, q, k, v, qp, kp = _case(spec, "cached", True, 4)
    seg = qp.seg.clone()
    seg[0] = -1  # every query of row 0 is padding
    qp = relpos.Positions(qp.pos, seg)
    out = fused_attention(q, k, v, scheme, qp, kp, causal=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    grads = _grads(out, scheme, q, k, v, torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads if g is not None)
    assert torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))


def test_half_precision_stays_near_float32():
    """Float16 on CPU (the interpreter's bfloat16 products are wrong), bfloat16 too on CUDA."""
    dtypes = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    spec = {"name": "t5", "num_buckets": 8, "max_distance": 12}
    for dtype in dtypes:
        scheme, q, k, v, qp, kp = _case(spec, "left-pad", True, 5)
        ref = fused_attention(q, k, v, scheme, qp, kp, causal=True)
        half = [t.detach().to(dtype) for t in (q, k, v)]
        out = fused_attention(*half, scheme, qp, kp, causal=True)
        assert out.dtype == dtype
        err = (out.float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, f"{dtype}: relative error {err:.3g}"


@pytest.mark.parametrize("rows", [21, 130], ids=["register-rows", "own-rows"])
def test_keyed_half_precision_stays_near_float32(rows):
    """With the keys and float16 inputs (the interpreter's bfloat16 products are wrong), the
    kernels store ``d rel`` in float16, in registers' rows or each query's own past
    :data:`MAX_LOOP_ROWS`, and it is multiplied out in float16: the output and every gradient
    (``q``, ``k``, ``v``, the table) stay within 2e-2 of float32's, relative to the largest."""
    spec = {"name": "music", "max_distance": rows - 1}
    scheme, q, k, v, qp, kp = _case(spec, "plain", True, 7, n=rows + 10)
    grad_out = torch.randn(*q.shape, device=DEVICE)
    results = []
    for dtype in (torch.float32, torch.float16):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with launch_config(keyed=True):
            out = fused_attention(*inputs, scheme, qp, kp, causal=True)
        assert out.dtype == dtype
        results.append([out, *_grads(out, scheme, *inputs, grad_out.to(dtype))])
    for name, half, full in zip(["out", "q", "k", "v", "E"], results[1], results[0], strict=False):
        err = (half.float() - full).abs().max() / full.abs().max()
        assert err < 2e-2, f"rows={rows} {name}: relative error {err:.3g}"


def test_raw_kernel_without_a_logit_term_gives_plain_attention_and_its_mass():
    """``rel=None``: softmax attention, and ``mass`` sums every query's probabilities to 1."""
    torch.manual_seed(6)
    n = 25
    q, k, v = (torch.randn(1, 2, n, 8, device=DEVICE) for _ in range(3))
    pos = torch.arange(n, device=DEVICE, dtype=torch.int32)[None]
    seg = torch.zeros_like(pos)
    lut = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)  # δ < 0, 0, > 0
    out, mass = relative_flash_attention(
        q, k, v, None, lut, 1, pos, seg, pos, seg, rows=3, causal=False, plain=True, mass=True
    )
    want = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1)
    _assert_close(out, want @ v, 1e-5, "output")
    _assert_close(mass.sum(-1), torch.ones_like(mass[..., 0]), 1e-5, "mass")
    _assert_close(mass[..., 1], torch.diagonal(want, dim1=-2, dim2=-1), 1e-5, "diagonal mass")


def _raw_inputs(**change):
    """Valid arguments of :func:`relative_flash_attention` (b=2, h=3, i=5, j=7, d=8, R=4),
    with ``change`` applied."""
    args = {
        "q": torch.randn(2, 3, 5, 8),
        "k": torch.randn(2, 3, 7, 8),
        "v": torch.randn(2, 3, 7, 8),
        "rel": torch.randn(1, 3, 1, 4),
        "lut": torch.arange(4, dtype=torch.int32),
        "offset": 2,
        "q_pos": torch.zeros(2, 5, dtype=torch.int32),
        "q_seg": torch.zeros(2, 5, dtype=torch.int32),
        "k_pos": torch.zeros(1, 7, dtype=torch.int32),
        "k_seg": torch.zeros(1, 7, dtype=torch.int32),
    }
    return {
        name: t.to(DEVICE) if torch.is_tensor(t) else t for name, t in {**args, **change}.items()
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": torch.randn(2, 3, 7, 16)}, r"k must have shape \(2, 3, j, 8\), got \(2, 3, 7, 16\)"),
        ({"v": torch.randn(2, 3, 6, 8)}, r"v must have shape \(2, 3, 7, 8\) \(k's\)"),
        ({"v": torch.randn(2, 3, 7, 8).half()}, "share a dtype"),
        ({"q_pos": torch.zeros(3, 5, dtype=torch.int32)}, r"q_pos must have shape \(1\|2, 5\)"),
        ({"k_seg": torch.zeros(2, 7, dtype=torch.int32)}, r"k_seg must have shape \(1, 7\)"),
        ({"rel": torch.randn(1, 3, 4, 4)}, r"rel must have shape \(1\|2, 3, 1\|5, 4\)"),
        ({"rel": torch.randn(1, 3, 1, 5)}, r"rel must have shape"),
        ({"relk": torch.randn(2, 3, 5, 4)}, r"relk must have shape \(2, 3, 7, 4\)"),
        (
            {"distance_form": DistanceForm("linear", torch.rand(3))},
            r"distance_form.params must have shape \(h, 1\) = \(3, 1\) for 'linear', got \(3,\)",
        ),
        (
            {"distance_form": DistanceForm("kerple_log", torch.rand(3, 1))},
            r"must have shape \(h, 2\) = \(3, 2\) for 'kerple_log', got \(3, 1\)",
        ),
        ({"distance_form": DistanceForm("cubic", torch.rand(3, 2))}, "name must be one of"),
        (
            {"lut": torch.zeros(3, 4, dtype=torch.int32)},
            r"lut must be \(n,\) or \(2, n\) .*\(3, 4\)",
        ),
        ({"lut": torch.zeros(0, dtype=torch.int32)}, r"with n >= 1 \(lut_with_runs\), got \(0,\)"),
    ],
    ids=[
        "k-dim",
        "v-length",
        "dtype",
        "q_pos",
        "k_seg",
        "rel-queries",
        "rel-rows",
        "relk",
        "form-params",
        "form-width",
        "form-name",
        "lut-rows",
        "lut-empty",
    ],
)
def test_raw_kernel_refuses_shapes_it_would_misread(change, message):
    """The kernels read every input through strides: a wrong shape is refused by name, with the
    shape expected, before anything runs."""
    with pytest.raises(ValueError, match=message):
        relative_flash_attention(**_raw_inputs(**change), rows=4, causal=True, plain=False)
    relative_flash_attention(**_raw_inputs(), rows=4, causal=True, plain=False)  # the valid ones


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"keys": torch.randn(3, 4, 8)}, "pass rel or keys, not both"),
        ({"rel": None, "keys": torch.randn(3, 4, 8)}, r"keys need plain positions \(plain=True\)"),
        ({"rel": None, "row_bias": torch.randn(3, 4)}, "pass keys with it, got keys=None"),
    ],
    ids=["both", "positions", "bias-alone"],
)
def test_raw_kernel_refuses_keys_it_cannot_use(change, message):
    """The keys stand for ``rel``: not beside it, and only over plain positions (elsewhere a
    tile's distances may span any number of rows)."""
    with pytest.raises(ValueError, match=message):
        relative_flash_attention(**_raw_inputs(**change), rows=4, causal=True, plain=False)


@pytest.mark.parametrize(
    ("keys", "row_bias", "message"),
    [
        ((3, 4, 4), None, r"keys must have shape \(1\|3, 4, 8\), got \(3, 4, 4\)"),
        ((2, 4, 8), None, r"keys must have shape \(1\|3, 4, 8\), got \(2, 4, 8\)"),
        ((1, 4, 8), (3, 5), r"row_bias must have shape \(1\|3, 4\), got \(3, 5\)"),
    ],
)
def test_raw_kernel_refuses_keys_of_the_wrong_shape(keys, row_bias, message):
    args = _raw_inputs(rel=None, k_pos=torch.zeros(1, 5, dtype=torch.int32))
    args |= {"k": args["k"][:, :, :5], "v": args["v"][:, :, :5], "q_pos": args["q_pos"][:1]}
    args |= {"q_seg": args["q_seg"][:1], "k_seg": args["k_seg"][:, :5]}
    bias = None if row_bias is None else torch.randn(row_bias, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        relative_flash_attention(
            **args, keys=torch.randn(keys, device=DEVICE), row_bias=bias, rows=4, causal=True,
            plain=True,
        )  # fmt: skip


def _keyed_specs() -> list:
    """The specs whose logit term is ``q·Eᵀ`` (plus a bias per row): the keys ``fused`` may hand
    the kernels (:func:`keyed_logits`); the first Music Transformer's and Transformer-XL's (its
    row bias) by default; DeBERTa past the register rows (:data:`ENTRIES_SPEC`: its keys read
    per entry, 149 of them at 90 tokens) under ``-m slow``."""
    keyed = [
        spec
        for spec in RELATIVE_SPECS
        if fused_takes_keys(relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True))
    ]
    names = [s["name"] for s in keyed]
    entries = ENTRIES_SPEC
    return [
        pytest.param(s, id=spec_id(s), marks=() if fast else pytest.mark.slow)
        for n, s in enumerate(keyed)
        for fast in [names.index(s["name"]) == n and s["name"] in ("music", "transformer_xl")]
    ] + [pytest.param(entries, id="deberta-read-per-entry", marks=pytest.mark.slow)]


@pytest.mark.parametrize("spec", _keyed_specs())
def test_keyed_logits_equal_eager(spec):
    """With :func:`keyed_logits` on, the kernels take the table's keys and compute each tile's
    ``q·Eᵀ`` themselves (no ``(b, h, i, R)`` logits): outputs and every gradient (``q``, ``k``,
    ``v``, the tables, Transformer-XL's biases through its row bias) against float64 ``eager``.
    Causal with one-row tiles (the far field: one dot product per query), bidirectional with
    tiles of another shape in each kernel (the window of keys spans ``BM + BN - 1`` rows)."""
    n = 90
    launches = {
        True: dict(tile=32, one_row=True, unmasked=True),
        False: dict(forward=(32, 16, 4), keys=(16, 32, 4), queries=(32, 16, 4)),
    }
    for causal, launch in launches.items():
        scheme, q, k, v, qp, kp = _case(spec, "plain", causal, 5, n=n)
        grad_out = torch.randn(*q.shape, device=DEVICE)
        with launch_config(keyed=True, **launch):
            with recorded_launches() as runs:
                fused_attention(q, k, v, scheme, qp, kp, causal=causal).sum().backward()
            assert [r.constexprs["REL_KEYS"] for r in runs] == [True] * 3
            out = fused_attention(q, k, v, scheme, qp, kp, causal=causal)
        what = f"{spec_id(spec)} causal={causal}"
        _assert_equals_eager64(out, scheme, q, k, v, qp, kp, causal, grad_out, what)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op produces (the host's ops: the interpreted kernels
    run outside PyTorch's dispatch, on their own arrays)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_keyed_logits_build_no_logits_per_query_and_row():
    """With the keys, no ``(b, h, i, R)`` tensor is built for a forward pass, with or without
    gradients (so none is kept for the backward pass, which builds its one gradient of that
    shape); without them ``rel`` is one."""
    spec = {"name": "music", "max_distance": 64}
    scheme, q, k, v, qp, kp = _case(spec, "plain", True, 4, n=40)
    logits = (*q.shape[:3], scheme.num_relative)
    for keyed in (False, True):
        for grad in (False, True):
            with launch_config(keyed=keyed), torch.set_grad_enabled(grad), _Shapes() as seen:
                out = fused_attention(q, k, v, scheme, qp, kp, causal=True)
            assert (logits in seen.shapes) != keyed, (keyed, grad)
        with launch_config(keyed=keyed), _Shapes() as seen:
            out.sum().backward()
        assert logits in seen.shapes  # d rel, to be multiplied out


def test_keyed_logits_stay_off_by_default_and_off_plain_positions():
    """Untimed on a GPU, so off unless asked for; asked for, only plain positions take it (a
    packed batch reads ``rel``)."""
    spec = {"name": "music", "max_distance": 6}
    assert not keyed_logits()
    for layout, keyed in (("plain", False), ("packed", True)):
        scheme, q, k, v, qp, kp = _case(spec, layout, True, 3, n=40)
        with launch_config(keyed=keyed), torch.no_grad(), recorded_launches() as runs:
            fused_attention(q, k, v, scheme, qp, kp, causal=True)
        assert runs[0].constexprs["REL_KEYS"] is False
    with launch_config(keyed=True):
        assert keyed_logits()


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"name": "fire"}, "does not support scheme"),  # its bias reads the query's position
        ({"name": "cope", "npos_max": 6}, "scheme"),  # its gates read σ(q·k) per pair
        ({"name": "shaw", "max_distance": 100}, "scheme"),  # a value term over 201 rows
    ],
    ids=["fire", "cope", "shaw-wide-values"],
)
def test_refusals_name_what_is_unsupported(spec, why):
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True).to(DEVICE)
    x = torch.randn(1, 2, 5, 8, device=DEVICE)
    p = relpos.Positions.from_length(5, device=DEVICE)
    with pytest.raises(ValueError, match=why):
        fused_attention(x, x, x, scheme, p, p, causal=True)


def test_refuses_float64():
    scheme = relpos.make_scheme({"name": "t5"}, d_model=16, num_heads=2, causal=True).to(DEVICE)
    y = torch.randn(1, 2, 5, 8, device=DEVICE, dtype=torch.float64)
    p = relpos.Positions.from_length(5, device=DEVICE)
    with pytest.raises(ValueError, match="float64"):
        fused_attention(y, y, y, scheme.double(), p, p, causal=True)


def test_deterministic_mode_refuses_atomic_row_sums(deterministic):
    """More than :data:`MAX_LOOP_ROWS` rows with a table gradient (the Music Transformer, 129
    rows) over general positions (here two packed documents) sums by atomic adds: refused under
    deterministic algorithms, a warning with ``warn_only``; without a gradient, with a register
    sum (T5, 32 rows) or over plain positions (each query's rows stored, not added), it runs."""
    p = relpos.Positions.from_lengths([[2, 3]], 5, device=DEVICE)
    plain = relpos.Positions.from_length(5, device=DEVICE)
    x = torch.randn(1, 2, 5, 8, device=DEVICE)
    music, t5 = (
        relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True).to(DEVICE)
        for spec in ({"name": "music", "max_distance": 128}, {"name": "t5"})
    )
    assert music.num_relative > MAX_LOOP_ROWS >= t5.num_relative
    deterministic(True)
    fused_attention(x, x, x, music, plain, plain, causal=True).sum().backward()
    with pytest.raises(RuntimeError, match="not deterministic"):
        fused_attention(x, x, x, music, p, p, causal=True)
    with torch.no_grad():
        fused_attention(x, x, x, music, p, p, causal=True)
    fused_attention(x, x, x, t5, p, p, causal=True).sum().backward()
    deterministic(True, warn_only=True)
    with pytest.warns(UserWarning, match="atomic adds for 129 rows"):
        fused_attention(x, x, x, music, p, p, causal=True).sum().backward()
    deterministic(False)
    fused_attention(x, x, x, music, p, p, causal=True)


def _reference(q, k, v, rel, lut, offset, qp, qs, kp, ks, causal, rows, keep, p_drop):
    """The kernel's definition, float64, with ``(b, h, i, j)`` tensors: logits plus
    ``rel[.., i, lut[p_j - p_i + offset]]``, masked softmax, dropout by ``keep``, ``out`` and
    ``mass``."""
    s = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    delta = kp[:, None, :] - qp[:, :, None]
    row = lut[(delta + offset).clamp(0, lut.numel() - 1)].long()[:, None].expand(s.shape)
    allowed = (ks[:, None, :] == qs[:, :, None]) & (qs[:, :, None] != -1)
    if causal:
        allowed = allowed & (delta <= 0)
    allowed = allowed[:, None]
    if rel is not None:
        s = s + torch.gather(rel.double().expand(*s.shape[:3], rows), 3, row)
    probs = torch.softmax(s.masked_fill(~allowed, -1e300), -1) * allowed
    probs = probs * keep / (1 - p_drop)
    mass = probs.new_zeros(*probs.shape[:3], rows).scatter_add_(3, row, probs)
    return probs @ v.double(), mass


@pytest.mark.parametrize("form", ["registers", "atomics", "stored", "by-entry"])
@pytest.mark.parametrize("plain", [True, False], ids=["plain", "packed"])
def test_dropout_equals_the_reference_with_the_kernels_mask(form, plain):
    """With dropout (p = 0.3) the kernel equals its definition under the mask
    :func:`dropout_keep` draws for the seed: outputs, mass and every gradient, with the row sums
    in registers (9 rows), atomic (150) or, given ``row_base`` (a table cut at the clip), stored
    per query over plain positions; and a table shared by every query (a distance bias's,
    150 rows), its gradient summed by entry."""
    rows = 9 if form == "registers" else 150
    torch.manual_seed(rows + plain)
    b, h, n, d, p_drop, seed = 2, 2, 40, 8, 0.3, 1234
    q, k, v = (torch.randn(b, h, n, d, device=DEVICE, requires_grad=True) for _ in range(3))
    shared = form == "by-entry"
    rel = torch.randn(1 if shared else b, h, 1 if shared else n, rows, device=DEVICE)
    rel.requires_grad_()
    lut = (torch.arange(-n + 1, n, device=DEVICE).clamp(-(rows - 1), 0) + rows - 1).int()
    offset, row_base = n - 1, None
    if form == "stored":  # distances -(rows - 1)..0 at rows 0..rows - 1
        lut, offset, row_base = torch.arange(rows, device=DEVICE, dtype=torch.int32), rows - 1, 0
    pos = torch.arange(n, device=DEVICE, dtype=torch.int32).expand(b, n).contiguous()
    seg = torch.zeros_like(pos)
    if not plain:
        seg[:, n // 2 :] = 1
        pos[:, n // 2 :] -= n // 2
        seg[1, :3] = -1
    args = (lut, offset, pos, seg, pos, seg)
    with recorded_launches() as runs:
        out, _ = relative_flash_attention(
            q, k, v, rel, *args, rows=rows, causal=True, plain=plain, mass=True, row_base=row_base
        )
        torch.autograd.grad(out.sum(), q)
    queries = _queries_backward(runs).constexprs
    assert queries["OWN_ROWS"] == (form == "stored" and plain) and queries["BY_ENTRY"] == shared
    out, mass = relative_flash_attention(
        q, k, v, rel, *args, rows=rows, causal=True, plain=plain, mass=True,
        dropout_p=p_drop, seed=seed, row_base=row_base,
    )  # fmt: skip
    keep = dropout_keep(seed, (b, h, n, n), p_drop, DEVICE)
    assert 0.6 < keep.float().mean() < 0.8
    want, want_mass = _reference(q, k, v, rel, *args, True, rows, keep, p_drop)
    go, gm = torch.randn_like(out), torch.randn_like(mass)
    got = torch.autograd.grad((out * go).sum() + (mass * gm).sum(), (q, k, v, rel))
    ref = torch.autograd.grad((want * go).sum() + (want_mass * gm).sum(), (q, k, v, rel))
    _assert_close(out, want, 1e-5, "output")
    _assert_close(mass, want_mass, 1e-5, "mass")
    for t, (g, w) in enumerate(zip(got, ref, strict=True)):
        _assert_close(g, w, 1e-5, f"gradient {t}")


def test_backend_dropout_is_reproducible_and_only_in_training():
    """``torch.manual_seed`` fixes the mask; another seed draws another; ``training=False`` (or
    ``dropout_p=0``) gives the output without dropout."""
    spec = {"name": "shaw", "max_distance": 2}
    scheme, q, k, v, qp, kp = _case(spec, "left-pad", True, 8)

    def run(seed, **kw):
        torch.manual_seed(seed)
        return fused_attention(q, k, v, scheme, qp, kp, causal=True, dropout_p=0.2, **kw)

    assert torch.equal(run(0, training=True), run(0, training=True))
    assert not torch.equal(run(0, training=True), run(1, training=True))
    want = fused_attention(q, k, v, scheme, qp, kp, causal=True)
    assert torch.equal(run(0, training=False), want)


def test_a_layer_runs_on_the_fused_backend():
    """``MultiheadAttention(backend="fused")`` equals ``eager`` on a padded batch."""
    torch.manual_seed(7)
    spec = {"name": "music", "max_distance": 16}
    layer = relpos.MultiheadAttention(16, 2, spec, causal=True, backend="fused").to(DEVICE)
    randomize_parameters(layer)
    x = torch.randn(2, 20, 16, device=DEVICE)
    mask = torch.ones(2, 20, dtype=torch.bool, device=DEVICE)
    mask[0, :6] = False
    p = relpos.Positions.from_padding_mask(mask)
    out = layer(x, p)
    layer.backend = "eager"
    _assert_close(out, layer(x, p), 1e-4, "layer output")


def test_no_queries_or_no_keys():
    """Empty calls return ``eager``'s empty result: ``(b, h, 0, d)``, or zeros for no keys."""
    scheme = relpos.make_scheme({"name": "t5"}, d_model=16, num_heads=2, causal=True).to(DEVICE)
    x = torch.randn(1, 2, 4, 8, device=DEVICE)
    none = x[:, :, :0]
    p, empty = (relpos.Positions.from_length(n, device=DEVICE) for n in (4, 0))
    assert fused_attention(none, x, x, scheme, empty, p, causal=False).shape == (1, 2, 0, 8)
    out = fused_attention(x, none, none, scheme, p, empty, causal=False)
    assert torch.equal(out, torch.zeros_like(x))
