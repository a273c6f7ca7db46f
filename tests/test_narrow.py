"""The distance-coordinate band engine (``relpos.attention.chunked.narrow``).

Its strided views against loops, its chunking, and the region path through it against ``eager``
(outputs and every gradient) on random shapes, chunk sizes and schemes. ``tests/test_band.py``
runs both band engines over the same band specs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.attention.chunked import chunked_attention, chunked_path
from relpos.attention.chunked import geometry as geometry_mod
from relpos.attention.chunked import narrow as narrow_mod
from relpos.attention.chunked.band import Band
from relpos.attention.eager import eager_attention
from tests.test_backends import assert_same


def test_diagonal_view_matches_a_loop():
    tile = torch.randn(3, 5, 9)
    view = geometry_mod.diagonal_view(tile, 5)
    for i in range(5):
        for t in range(5):
            assert view[:, i, t].equal(tile[:, i, i + t])
    with pytest.raises(ValueError, match="no 6 full diagonals"):
        geometry_mod.diagonal_view(tile, 6)  # row 4 would need column 4 + 5 = 9


def _band(n: int, lo: int, hi: int, block: int) -> Band:
    scheme = relpos.make_scheme(
        {"name": "shaw", "max_distance": 4}, d_model=8, num_heads=2, causal=False
    )
    return Band.build(scheme, n, lo, hi, block, torch.device("cpu"))


@pytest.mark.parametrize(
    ("n", "lo", "hi", "block"), [(10, -4, 1, 4), (37, -3, 3, 8), (8, -9, 9, 4)]
)
def test_windows_hold_each_blocks_keys_and_fold_is_their_adjoint(n, lo, hi, block):
    band = _band(n, lo, hi, block)
    b, h, d = 2, 3, 2
    x = torch.randn(b, h, n, d, dtype=torch.float64)
    flat = narrow_mod._flat(band, x, "test")
    rows = b * h
    win = narrow_mod._windows(band, flat)  # (rows·nb, J, d)
    assert win.shape == (rows * band.num_blocks, band.keys, d)
    for r in range(rows):
        for c in range(band.num_blocks):
            for j in range(band.keys):
                pos = c * block - band.left + j  # the key's position in its sequence
                if 0 <= pos < n:
                    got = win[r * band.num_blocks + c, j]
                    assert got.equal(x[r // h, r % h, pos])
    # <windows(x), w> == <x, fold(w)> over the whole flat buffer.
    w = torch.randn_like(win)
    out = torch.zeros_like(flat)
    narrow_mod._fold(band, out, w)
    torch.testing.assert_close((win * w).sum(), (flat * out).sum())
    # What the unflat view reads back is x itself.
    assert narrow_mod._unflat(band, flat, x).equal(x)


@pytest.mark.parametrize(("budget", "b", "h"), [(1, 2, 3), (2 * 96 * 35, 3, 2), (1 << 30, 2, 3)])
def test_chunks_cover_every_row_once_in_contiguous_ranges(budget, b, h, monkeypatch):
    monkeypatch.setattr(narrow_mod, "CHUNK_ELEMENTS", budget)
    band = _band(90, -4, 1, 32)  # n_pad 96, J 35
    seen = []
    for b0, b1, h0, h1 in narrow_mod._chunks(band, b, h):
        assert h1 - h0 == h or b1 - b0 == 1  # contiguous rows of the flat buffers
        seen += [(bi, hi) for bi in range(b0, b1) for hi in range(h0, h1)]
    assert sorted(seen) == [(bi, hi) for bi in range(b) for hi in range(h)]
    assert len(seen) == len(set(seen))


def test_default_bounds_send_shaw_and_t5_here_and_wide_or_long_bands_to_tiles():
    assert narrow_mod.is_narrow(16, 2048)  # Shaw k=16, causal
    assert narrow_mod.is_narrow(181, 2048)  # T5's default band, bidirectional
    assert narrow_mod.is_narrow(256, 1024)  # a Music Transformer at M = 256
    assert not narrow_mod.is_narrow(256, 512)  # … over a sequence only twice as long
    assert not narrow_mod.is_narrow(1024, 2048)  # Music Transformer, M=1024


SPECS = st.one_of(
    st.builds(
        lambda k, keys, values, per_head: {
            "name": "shaw",
            "max_distance": k,
            "keys": keys,
            "values": values or not keys,
            "per_head": per_head,
        },
        st.integers(0, 6),
        st.booleans(),
        st.booleans(),
        st.booleans(),
    ),
    st.builds(
        # max_distance must exceed the exact buckets (num_buckets / 2 when causal).
        lambda nb, extra: {"name": "t5", "num_buckets": nb, "max_distance": nb + extra},
        st.sampled_from([4, 6, 8]),
        st.integers(0, 12),
    ),
    st.builds(lambda m: {"name": "music", "max_distance": m}, st.integers(0, 12)),
    st.builds(lambda m: {"name": "transformer_xl", "max_distance": m}, st.integers(0, 12)),
)


@settings(max_examples=40, deadline=None)
@given(
    spec=SPECS,
    causal=st.booleans(),
    n=st.integers(1, 90),
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    budget=st.sampled_from([1, 3_000, 10_000, 1 << 22]),
    block=st.sampled_from([4, 32]),
    seed=st.integers(0, 2**16),
)
def test_distance_engine_matches_eager(spec, causal, n, b, h, budget, block, seed):
    """Random shapes, schemes, chunk budgets and block sizes: outputs and the gradients of q, k,
    v and every table against eager, in float64; both passes in distance coordinates."""
    torch.manual_seed(seed)
    d = 4
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal).double()
    for p in scheme.parameters():
        p.data.normal_()
    pos = Positions.from_length(n)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(b, h, n, d, dtype=torch.float64)
    inputs = [q, k, v, *scheme.parameters()]
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(narrow_mod, "NARROW_WIDTH", 1 << 30)
        mp.setattr(narrow_mod, "NARROW_RATIO", 0)
        mp.setattr(narrow_mod, "CHUNK_ELEMENTS", budget)
        mp.setattr("relpos.attention.chunked.narrow.NARROW_BLOCK", block)
        results = []
        for fn in (eager_attention, chunked_attention):
            out = fn(q, k, v, scheme, pos, pos, causal=causal)
            results.append((out, torch.autograd.grad(out, inputs, grad_out, allow_unused=True)))
    finally:
        mp.undo()
    assert_same(results, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("loud", [0, 1], ids=["head-0-loud", "head-1-loud"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_row_never_reads_its_neighbours_keys(causal, loud, monkeypatch):
    """Windows at a sequence's ends overlap the neighbouring (batch, head) row in the flat buffer
    (with no padding between them when ``n`` is a multiple of the block); those pairs must weigh
    exactly 0. Values of 1e30 in one head leave the other's output and gradients unchanged."""
    torch.manual_seed(0)
    spec = {"name": "shaw", "max_distance": 5, "per_head": True}
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=causal).double()
    n = 2 * narrow_mod.NARROW_BLOCK
    pos = Positions.from_length(n)
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 2, n, 4, dtype=torch.float64)
    noisy = v.detach().clone()
    noisy[:, loud] *= 1e30
    noisy.requires_grad_(True)
    quiet = 1 - loud
    results = []
    for values in (v, noisy):
        out = chunked_attention(q, k, values, scheme, pos, pos, causal=causal)
        grads = torch.autograd.grad(out[:, quiet], [q, k], grad_out[:, quiet])
        results.append((out[:, quiet], tuple(g[:, quiet] for g in grads)))
    assert_same(results, atol=0, rtol=0)


def _shaw_call(seed: int):
    """Outputs and gradients of one chunked call and of eager (Shaw with values, n=200)."""
    torch.manual_seed(seed)
    scheme = relpos.make_scheme(
        {"name": "shaw", "max_distance": 6, "per_head": True}, d_model=8, num_heads=2, causal=False
    ).double()
    pos = Positions.from_length(200)
    q, k, v = (torch.randn(2, 2, 200, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 2, 200, 4, dtype=torch.float64)
    results = []
    for fn in (eager_attention, chunked_attention):
        out = fn(q, k, v, scheme, pos, pos, causal=False)
        results.append((out, torch.autograd.grad(out, [q, k, v, *scheme.parameters()], grad_out)))
    return results


def test_scratch_buffers_are_reused_and_nothing_returned_lives_in_them():
    narrow_mod._SCRATCH.buffers.clear()  # this thread's
    first = _shaw_call(0)
    assert_same(first, atol=1e-9, rtol=1e-9)
    kept = {name: buf.data_ptr() for name, buf in narrow_mod._SCRATCH.buffers.items()}
    assert {"tile", "s", "dp_tile", "ds", "dwin"} <= {name for name, *_ in kept}
    second = _shaw_call(1)  # other inputs through the same buffers: no stale state
    assert_same(second, atol=1e-9, rtol=1e-9)
    assert {name: buf.data_ptr() for name, buf in narrow_mod._SCRATCH.buffers.items()} == kept
    spans = [
        (buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
        for _, buf in narrow_mod._SCRATCH.buffers.items()
    ]
    out, grads = second[1]
    for t in (out, *grads):
        lo = t.untyped_storage().data_ptr()
        hi = lo + t.untyped_storage().nbytes()
        assert all(hi <= a or b <= lo for a, b in spans)


def test_scratch_keeps_nothing_past_its_budget(monkeypatch):
    monkeypatch.setattr(narrow_mod._SCRATCH.buffers, "budget", 0)
    narrow_mod._SCRATCH.buffers.clear()
    assert_same(_shaw_call(2), atol=1e-9, rtol=1e-9)
    assert narrow_mod._SCRATCH.buffers.items() == []


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_nan_value_stays_in_its_batch_row(causal):
    """The flat key buffers keep whole padding blocks between (batch, head) rows: a window never
    reads the next row's values, where a zero probability times NaN would cross batch rows."""
    torch.manual_seed(0)
    scheme = relpos.make_scheme(
        {"name": "shaw", "max_distance": 2}, d_model=2, num_heads=1, causal=causal
    )
    pos = Positions.from_length(18)
    q, k, v = (torch.randn(2, 1, 18, 2) for _ in range(3))
    assert chunked_path(scheme, q, pos, pos) == "region"
    clean = chunked_attention(q, k, v, scheme, pos, pos, causal=causal)
    v[1, 0, 0, 0] = float("nan")
    dirty = chunked_attention(q, k, v, scheme, pos, pos, causal=causal)
    assert torch.equal(dirty[0], clean[0])
