"""The band engine of the ``chunked`` region path (``relpos.attention.chunked.band``).

The strided skew and its adjoint against loops over (i, j); the region path against ``eager``
(outputs and gradients) with groups of many blocks and with one block per group, where the first
and last blocks drop their padding keys.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.attention import BACKENDS
from relpos.attention.chunked import band as band_mod
from relpos.attention.chunked import chunked_path
from relpos.attention.chunked import geometry as geometry_mod
from relpos.attention.chunked import kernels as kernels_mod
from relpos.attention.chunked import narrow as narrow_mod
from relpos.functional.skew import gather_relative
from tests.helpers import randomize_parameters, spec_id
from tests.test_backends import assert_same, run_case


def skew_oracle(rel: torch.Tensor, offset: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile, valid)``: ``tile[.., i, j] = rel[.., i, offset + j - i]`` where it exists."""
    *lead, rows, cols = rel.shape
    tile = torch.zeros(*lead, rows, keys, dtype=rel.dtype)
    valid = torch.zeros(rows, keys, dtype=torch.bool)
    for i in range(rows):
        for j in range(keys):
            t = offset + j - i
            if 0 <= t < cols:
                tile[..., i, j] = rel[..., i, t]
                valid[i, j] = True
    return tile, valid


def unskew_oracle(tile: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    *lead, rows, keys = tile.shape
    out = torch.zeros(*lead, rows, width, dtype=tile.dtype)
    for i in range(rows):
        for j in range(keys):
            t = offset + j - i
            if 0 <= t < width:
                out[..., i, t] += tile[..., i, j]
    return out


@given(
    rows=st.integers(1, 7),
    cols=st.integers(1, 9),
    data=st.data(),
)
def test_skew_view_and_unskew_match_loops(rows, cols, data):
    keys = data.draw(st.integers(1, rows + cols - 1))
    # skew_view needs offset >= 0 and offset + keys - rows <= cols - 1 (see its docstring).
    offset = data.draw(st.integers(0, max(0, cols - 1 + rows - keys)))
    torch.manual_seed(rows * 100 + cols)
    rel = torch.randn(2, rows, cols, dtype=torch.float64)
    if offset + keys - rows <= cols - 1:
        view = geometry_mod.skew_view(rel, offset, keys)
        tile, valid = skew_oracle(rel, offset, keys)
        assert torch.equal(view[..., valid], tile[..., valid])
    grid = torch.randn(2, rows, keys, dtype=torch.float64)
    torch.testing.assert_close(
        geometry_mod.unskew(grid, offset, cols), unskew_oracle(grid, offset, cols)
    )
    # diagonals: unskew with every diagonal kept (offset rows - 1, width rows + keys - 1).
    torch.testing.assert_close(
        geometry_mod.diagonals(grid), unskew_oracle(grid, rows - 1, rows + keys - 1)
    )


def test_skew_view_of_a_column_slice_and_its_bounds():
    wide = torch.randn(3, 5, 12)
    rel = wide[..., 2:9]  # rows of stride 12, 7 columns
    view = geometry_mod.skew_view(rel, 2, 6)
    tile, valid = skew_oracle(rel, 2, 6)
    assert torch.equal(view[..., valid], tile[..., valid])
    with pytest.raises(ValueError, match="cannot hold"):
        geometry_mod.skew_view(rel, 5, 9)  # the last row's last column would be 5 + 8 - 4 > 6


BAND_SPECS = [
    {"name": "shaw", "max_distance": 3},
    {"name": "shaw", "max_distance": 2, "keys": False},
    {"name": "shaw", "max_distance": 4, "per_head": False, "values": False},
    {"name": "t5", "num_buckets": 8, "max_distance": 12},
    {"name": "shaw", "max_distance": 3, "per_head": True},
    {"name": "music", "max_distance": 20},
    # A band wider than a block: the first blocks multiply only the distances they reach.
    {"name": "music", "max_distance": 150},
    # q·Eᵀ plus a constant per distance (relative_row_bias), narrow and wide.
    {"name": "transformer_xl", "max_distance": 20},
    {"name": "transformer_xl", "max_distance": 150},
]


def use_engine(monkeypatch, engine: str) -> None:
    """Route every band to one engine: ``tiles`` (band.py) or ``distance`` (narrow.py)."""
    monkeypatch.setattr(narrow_mod, "NARROW_WIDTH", -1 if engine == "tiles" else 1 << 30)
    monkeypatch.setattr(narrow_mod, "NARROW_RATIO", 0)


@pytest.mark.parametrize("engine", ["tiles", "distance"])
@pytest.mark.parametrize("group_elements", [1, 1 << 20], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BAND_SPECS, ids=spec_id)
@pytest.mark.parametrize("n", [70, 200])
@pytest.mark.matrix
def test_region_path_matches_eager(spec, causal, group_elements, n, engine, monkeypatch):
    """Both band engines against eager; ``one-block`` makes the tile engine's groups one block
    and the distance engine's chunks one (batch, head) row."""
    use_engine(monkeypatch, engine)
    monkeypatch.setattr(geometry_mod, "GROUP_ELEMENTS", group_elements)
    monkeypatch.setattr(narrow_mod, "CHUNK_ELEMENTS", group_elements)
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=causal)
    pos = Positions.from_length(n)
    assert chunked_path(scheme, torch.zeros(1, 2, n, 4), pos, pos) == "region"
    results, _ = run_case("chunked", spec, causal, "plain", n=n, seed=n)
    assert_same(results, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BAND_SPECS, ids=spec_id)
@pytest.mark.matrix
def test_region_path_with_groups_of_two_blocks_matches_eager(spec, causal, monkeypatch):
    """Groups of several blocks inside the sequence: T5's shared ``(1, h, B, J)`` mask is
    broadcast over the group's blocks (and the batch), forward and backward."""
    use_engine(monkeypatch, "tiles")

    def pairs(self, batch, heads):
        return [(c, min(c + 2, self.num_blocks)) for c in range(0, self.num_blocks, 2)]

    monkeypatch.setattr(geometry_mod.Band, "groups", pairs)
    n = 450  # 8 blocks of 64: groups (0, 2) … (6, 8); the middle ones lie inside the sequence
    results, _ = run_case("chunked", spec, causal, "plain", n=n, seed=7)
    assert_same(results, atol=1e-9, rtol=1e-9)


def test_t5_inside_groups_share_one_broadcast_mask():
    spec = {"name": "t5", "num_buckets": 8, "max_distance": 12}
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True)
    band = geometry_mod.Band.build(scheme, 450, -12, 1, 64, torch.device("cpu"))
    q = torch.randn(3, 2, 450, 4)
    with torch.no_grad():  # as in the backends: the table's gradient comes from dS, not here
        masks = band_mod._ConstMasks(band, band.to_distance(scheme.relative_logits(q[:, :, :1])), 3)
    cols = (0, band.keys)
    inside = [(2, 4), (4, 6), (3, 4)]
    assert all(band.inside(c0, c1) for c0, c1 in inside) and not band.inside(0, 2)
    shared = {id(masks.mask(c0, c1, cols, band.mask(c0, c1, q, 3)[1], 3)) for c0, c1 in inside}
    assert len(shared) == 1
    c0, c1 = inside[0]
    got = masks.mask(c0, c1, cols, band.mask(c0, c1, q, 3)[1], 3)
    assert got.shape == (1, 2, 64, band.keys)
    # The same numbers as the per-group mask it replaces.
    full = band_mod._group_mask(
        band, masks.lin[:, :, : (c1 - c0) * 64], band.mask(c0, c1, q, 3)[1], 3, cols
    )
    torch.testing.assert_close(got.expand_as(full), full, atol=0, rtol=0)


def test_groups_share_one_interior_mask():
    spec = {"name": "shaw", "max_distance": 4}
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True)
    band = geometry_mod.Band.build(scheme, 1000, -4, 1, 16, torch.device("cpu"))
    like = torch.zeros(1)
    groups = band.groups(1, 2)
    assert groups[0][0] == 0 and groups[-1][1] == band.num_blocks
    geometry_mod.BAND_MASKS.clear()
    masks = [band.mask(c0, c1, like, 1) for c0, c1 in groups]
    assert len(geometry_mod.BAND_MASKS) <= 3  # the first group, the interior, the last
    # A later call of the same geometry (another layer, the next step) builds nothing.
    again = geometry_mod.Band.build(scheme, 1000, -4, 1, 16, torch.device("cpu"))
    for (c0, c1), (blocked, neg) in zip(groups, masks, strict=True):
        hit = again.mask(c0, c1, like, 1)
        assert hit[0] is blocked and hit[1] is neg


def test_mask_cache_is_bounded(monkeypatch):
    """Masks past the cache budget evict the least recently used; one larger is not kept."""
    scheme = relpos.make_scheme(
        {"name": "shaw", "max_distance": 4}, d_model=8, num_heads=2, causal=False
    )
    like = torch.zeros(1)
    geometry_mod.BAND_MASKS.clear()
    one = 16 * 24 * 5  # a (1, 1, 16, 24) bool and float32 mask, 5 bytes an element
    monkeypatch.setattr(geometry_mod.BAND_MASKS, "budget", 2 * one)
    for n in (100, 200, 300):  # first groups of three lengths: three different masks
        geometry_mod.Band.build(scheme, n, -5, 5, 16, torch.device("cpu")).mask(0, 1, like, 1)
    assert len(geometry_mod.BAND_MASKS) == 2
    assert geometry_mod.BAND_MASKS.total == 2 * one
    monkeypatch.setattr(geometry_mod.BAND_MASKS, "budget", one - 1)
    geometry_mod.BAND_MASKS.clear()
    geometry_mod.Band.build(scheme, 400, -5, 5, 16, torch.device("cpu")).mask(0, 1, like, 1)
    assert len(geometry_mod.BAND_MASKS) == 0


@pytest.mark.parametrize(
    "spec",
    [{"name": "shaw", "max_distance": 8}, {"name": "music", "max_distance": 400}],
    ids=["distance", "tiles"],
)
def test_cached_mask_built_in_inference_mode_serves_training(spec):
    """A mask first built under inference_mode is a normal tensor: a later training call of the
    same geometry runs forward and backward (both engines: distance coordinates and tiles)."""
    geometry_mod.BAND_MASKS.clear()  # both engines' masks (the distance engine's edge masks too)
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=True)
    q, k, v = (torch.randn(1, 2, 300, 4) for _ in range(3))
    pos = Positions.from_length(300)
    with torch.inference_mode():
        BACKENDS["chunked"](q, k, v, scheme, pos, pos, causal=True)
    assert len(geometry_mod.BAND_MASKS) > 0
    q.requires_grad_(True)
    BACKENDS["chunked"](q, k, v, scheme, pos, pos, causal=True).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "music", "max_distance": 150},
        {"name": "shaw", "max_distance": 3},
        {"name": "transformer_xl", "max_distance": 150},
    ],
    ids=spec_id,
)
@pytest.mark.parametrize("engine", ["tiles", "distance"])
def test_region_path_with_frozen_tables_and_constant_queries(spec, engine, monkeypatch):
    """The band skips the relative term's gradients nobody asked for, and gets the rest right."""
    use_engine(monkeypatch, engine)
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=12, num_heads=2, causal=True).double()
    scheme.requires_grad_(False)
    n = 203
    pos = Positions.from_length(n)
    q = torch.randn(2, 2, n, 6, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(2, 2, n, 6, dtype=torch.float64)
    results = []
    for backend in ("eager", "chunked"):
        out = BACKENDS[backend](q, k, v, scheme, pos, pos, causal=True)
        results.append((out, torch.autograd.grad(out, [k, v], grad_out)))
    assert_same(results, atol=1e-9, rtol=1e-9)


def test_cpu_flash_misreads_a_float32_mask_with_float64_queries():
    """Canary for the cast in ``chunked.kernels``: torch's CPU kernel reads a float32 mask with
    float64 ``q`` wrongly and says nothing. When this fails, upstream is fixed and the cast can
    go."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, generator=g) for _ in range(3))
    mask = torch.randn(1, 2, 16, 16, dtype=torch.float64, generator=g)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + mask, -1) @ v
    raw = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, _ = raw(q, k, v, 0.0, False, attn_mask=mask.float(), scale=8**-0.5)
    assert (out - ref).abs().max() > 0.1
    out, _ = kernels_mod.flash(q, k, v, 0.0, False, attn_mask=mask.float(), scale=8**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)  # the mask's float32 rounding


@pytest.mark.parametrize("engine", ["tiles", "distance"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BAND_SPECS, ids=spec_id)
@pytest.mark.parametrize("dtypes", [(64, 32), (32, 64)], ids=["f64-inputs", "f64-table"])
@pytest.mark.matrix
def test_region_path_with_a_table_in_another_dtype_matches_eager(
    spec, causal, engine, dtypes, monkeypatch
):
    """Inputs in one float dtype, the scheme's parameters in another (a backend called
    directly): the band's masks follow the inputs, as eager does; outputs and gradients."""
    use_engine(monkeypatch, engine)
    inputs, table = (getattr(torch, f"float{bits}") for bits in dtypes)
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=causal)
    randomize_parameters(scheme, seed=3)
    scheme.to(table)
    n = 150
    pos = Positions.from_length(n)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 4, dtype=inputs, generator=g) for _ in range(3))
    assert chunked_path(scheme, q, pos, pos) == "region"
    grad_out = torch.randn(2, 2, n, 4, dtype=inputs, generator=g)
    results = []
    for backend in ("eager", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        params = [p for p in scheme.parameters() if p.requires_grad]
        out = BACKENDS[backend](*leaves, scheme, pos, pos, causal=causal)
        results.append((out, torch.autograd.grad(out, leaves + params, grad_out)))
    (out_ref, g_ref), (out, g) = results
    for a, r in zip([out, *g], [out_ref, *g_ref], strict=True):
        exact = a.dtype == inputs == torch.float64  # else float32 sums in another order
        tol = 1e-9 if exact else 1e-5
        torch.testing.assert_close(a, r, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "music", "max_distance": 6},
        {"name": "shaw", "max_distance": 3, "per_head": False},
        {"name": "transformer_xl", "max_distance": 6},
    ],
    ids=spec_id,
)
def test_relative_keys_at_rows_equal_those_rows_of_relative_keys(spec):
    """The band reads only the rows it needs (``relative_keys_at``; Transformer-XL projects just
    those); they equal the full table's, and so does the row bias computed from them."""
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=False).double()
    randomize_parameters(scheme)
    full = scheme.relative_keys(torch.float64)
    bias = scheme.relative_row_bias(full)
    for rows in (slice(2, 6), torch.tensor([4, 0, 6, 4]), [1, 6]):
        picked = full.index_select(-2, rows) if isinstance(rows, torch.Tensor) else full[:, rows]
        keys = scheme.relative_keys_at(rows, torch.float64)
        torch.testing.assert_close(keys, picked, rtol=1e-12, atol=1e-12)
        if bias is not None:
            want = bias.index_select(-1, rows) if isinstance(rows, torch.Tensor) else bias[:, rows]
            torch.testing.assert_close(scheme.relative_row_bias(keys), want)


class LogitsWithoutKeys(relpos.MusicRelative):
    """A query-dependent relative term given only as ``relative_logits`` (no ``relative_keys``)."""

    @property
    def has_relative_keys(self):
        return False

    def relative_keys(self, dtype=torch.float32):
        return None

    def relative_logits(self, q):
        return q @ (self.table / self.head_dim**0.5).transpose(-1, -2)

    def score_bias(self, q, q_positions, k_positions):
        index = self.relative_index(q_positions, k_positions)
        return gather_relative(self.relative_logits(q), index)


def test_a_query_dependent_term_without_relative_keys_takes_the_general_path():
    scheme = LogitsWithoutKeys(
        relpos.MusicConfig(max_distance=6), d_model=8, num_heads=2, causal=True
    )
    pos = Positions.from_length(40)
    q, k, v = (torch.randn(1, 2, 40, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scheme = scheme.double()
    assert chunked_path(scheme, q, pos, pos) == "tiles"
    grad_out = torch.randn(1, 2, 40, 4, dtype=torch.float64)
    results = []
    for backend in ("eager", "chunked"):
        out = BACKENDS[backend](q, k, v, scheme, pos, pos, causal=True)
        results.append((out, torch.autograd.grad(out, [q, k, v, scheme.table], grad_out)))
    assert_same(results, atol=1e-9, rtol=1e-9)
