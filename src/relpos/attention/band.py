"""The band of a relative scheme's self-attention, for the ``chunked`` backend's region path.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table; ``B`` queries in one block, ``J`` its keys, ``D`` distances in the band.

Over contiguous positions, a relative scheme's logit term depends on the query only through the
distance ``δ = j - i``, and beyond a band ``lo < δ < hi`` it is a per-query constant (clipping). The
far parts go to the fused kernel elsewhere (:mod:`relpos.attention.chunked`); this module computes
the band in query blocks of ``B``: block ``c`` holds queries ``[cB, cB + B)`` and the *window* of
``J = B + D - 1`` keys its band reaches, ``[cB + lo + 1, cB + B + hi - 1)``. Windows overlap and
all have the same length, so a *group* of blocks is one batch (a strided view of the keys): one
fused kernel call, one GEMM, one elementwise op each, however many blocks. Keys outside ``[0, n)``
are zero padding, masked — only groups at the ends have any, and a group of one block is trimmed to
the keys that exist.

* The logit term in *distance coordinates*: column ``t`` is distance ``δ = t + lo + 1``
  (``t < D = hi - lo - 1``), table row ``lut[t] = relative_index(δ)``. Window column ``j`` of
  block row ``i`` is ``t = j - i``.
* The ``(B, J)`` tile ``tile[i, j] = lin[i, j - i + offset]`` is a strided **view** of a
  ``(B, W)`` buffer, row stride ``W - 1`` (:func:`skew_view`: the skew of Huang et al., 2018,
  without a copy). For ``q·Eᵀ`` schemes (``relative_keys``: Shaw, Music Transformer) the group's
  queries are multiplied by the rows of the distances it reaches, straight into a buffer whose
  other columns hold ``-inf``; the view is then the fused kernel's float mask with the band
  applied. T5's query-independent term is gathered once and skewed the same way, plus a 0/-inf
  band mask.
* Back to distance coordinates: row ``i``, distance ``t`` is window column ``i + t``, a view with
  row stride ``J + 1`` (:func:`_distances`; a trimmed window goes through :func:`diagonals`) —
  the value term's mass per distance in the forward pass, ``dS_rel`` in the backward pass.
* Backward: tiles are recomputed from the final log-sum-exp (:func:`probs_and_dscores`), then
  ``dq += dS_rel·E`` and ``dE += dS_relᵀ·q`` per group, ``dE`` pushed through ``relative_keys`` once
  at the end — the per-pair gradient no fused kernel returns.

Nothing of size ``(i, j)`` or ``(i, j, d)`` exists: a group holds ``O(g·B·J)`` elements, with ``g``
chosen to keep that under :data:`GROUP_ELEMENTS`.

This is the *tile engine*, for wide bands (a Music Transformer with a large ``M``). A band of at
most :data:`~relpos.attention.narrow.NARROW_WIDTH` distances runs in
:mod:`relpos.attention.narrow` instead, with the same contract; :class:`RelativeTerm` and
:func:`finish_relative_grads` are the parts both engines share.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..positions import Positions
from ..schemes.base import Scheme
from .grads import GradSink, push_grad

__all__ = [
    "GROUP_ELEMENTS",
    "Band",
    "RelativeTerm",
    "band_backward",
    "band_forward",
    "diagonal_view",
    "diagonals",
    "finish_relative_grads",
    "probs_and_dscores",
    "skew_view",
    "supports",
    "unskew",
]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

#: Elements of one group's ``(b, g, h, B, J)`` tiles (16 MiB in float32).
GROUP_ELEMENTS = 1 << 20

#: Bytes of band masks kept between calls (:class:`_MaskCache`).
MASK_CACHE_BYTES = 64 << 20


class _MaskCache:
    """Band masks kept between calls, least recently used first out past :data:`MASK_CACHE_BYTES`.

    A mask depends on geometry only (``n``, the band, the block, the group, batch, dtype, device),
    never on values, so every call of one shape (every layer, every step) shares it. Building the
    edge blocks' masks anew each call cost about a tenth of the Music Transformer's forward pass
    at L=2048 (:mod:`relpos.bench` profile; ``docs/performance.md``).
    """

    def __init__(self) -> None:
        self._items: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple[Tensor, Tensor] | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: tuple, value: tuple[Tensor, Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in value)
        limit = MASK_CACHE_BYTES
        with self._lock:
            if size > limit or key in self._items:
                return
            self._items[key] = value
            self._bytes += size
            while self._bytes > limit:
                _, old = self._items.popitem(last=False)
                self._bytes -= sum(t.numel() * t.element_size() for t in old)

    def get_or_build(
        self, key: tuple, build: Callable[[], tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor]:
        """The cached masks of ``key``, built by ``build()`` (and kept) on a miss."""
        hit = self.get(key)
        if hit is None:
            with torch.inference_mode(False):  # cached: usable by later calls outside it
                hit = build()
            self.put(key, hit)
        return hit

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)


_MASKS = _MaskCache()


def skew_view(rel_lin: Tensor, offset: int, keys: int) -> Tensor:
    """The ``(.., B, keys)`` tile ``out[.., i, j] = rel_lin[.., i, offset + j - i]`` as a view.

    ``rel_lin`` (``(.., B, D)``, unit last stride) must hold the first row's first column and the
    last row's last: ``offset >= 0`` and ``offset + keys - B <= D - 1``. Entries whose column
    ``offset + j - i`` falls outside ``[0, D)`` read neighbouring storage and must be masked by the
    caller.
    """
    *lead, rows, cols = rel_lin.shape
    if rel_lin.stride(-1) != 1 or offset < 0 or offset + keys - rows > cols - 1:
        raise ValueError(
            f"skew_view: a (.., {rows}, {cols}) table with strides {rel_lin.stride()} cannot hold "
            f"a (.., {rows}, {keys}) tile at offset {offset}"
        )
    strides = (*rel_lin.stride()[:-2], rel_lin.stride(-2) - 1, 1)
    return rel_lin.as_strided((*lead, rows, keys), strides, rel_lin.storage_offset() + offset)


def diagonal_view(tile: Tensor, width: int) -> Tensor:
    """``(.., B, J)`` → the ``(.., B, width)`` view ``out[.., i, t] = tile[.., i, i + t]``: each
    row's first ``width`` diagonals, row stride ``J + 1`` (the inverse of :func:`skew_view`, no
    copy).

    Needs ``width <= J - B + 1`` (row ``B - 1`` reaches column ``B - 2 + width``) and a unit last
    stride.
    """
    *lead, rows, keys = tile.shape
    if tile.stride(-1) != 1 or width > keys - rows + 1:
        raise ValueError(
            f"diagonal_view: a (.., {rows}, {keys}) tile with strides {tile.stride()} has no "
            f"{width} full diagonals"
        )
    strides = (*tile.stride()[:-2], tile.stride(-2) + 1, 1)
    return tile.as_strided((*lead, rows, width), strides, tile.storage_offset())


def diagonals(tile: Tensor) -> Tensor:
    """``(.., B, J)`` → ``(.., B, B + J - 1)``: ``out[.., i, B - 1 + j - i] = tile[.., i, j]``, zero
    elsewhere — each diagonal of the tile in its own column, still one row per query. Column ``c``
    of the result holds distance column ``c + offset - B + 1`` of :func:`skew_view`'s table."""
    *lead, rows, keys = tile.shape
    # Its view with row stride (B + J - 2) >= J never writes one address twice.
    cols = rows + keys - 1
    scratch = tile.new_zeros(*lead, rows, cols)
    view = scratch.as_strided((*lead, rows, keys), (*scratch.stride()[:-2], cols - 1, 1), rows - 1)
    view.copy_(tile)
    return scratch


def unskew(tile: Tensor, offset: int, width: int) -> Tensor:
    """The adjoint of :func:`skew_view`: ``out[.., i, offset + j - i] += tile[.., i, j]``.

    Shapes: tile ``(.., B, J)``; returns ``(.., B, width)`` (columns outside ``[0, width)`` drop).
    """
    *lead, rows, _ = tile.shape
    scratch = diagonals(tile)
    cols = scratch.shape[-1]
    lo = offset - (rows - 1)  # distance column t of scratch column c is c + lo
    out = tile.new_zeros(*lead, rows, width)
    c0, c1 = max(0, -lo), min(cols, width - lo)
    if c1 > c0:
        out[..., c0 + lo : c1 + lo] = scratch[..., c0:c1]
    return out


@dataclass
class Band:
    """The band ``lo < j - i < hi`` of an ``n``-token self-attention, in query blocks of ``block``.

    Attributes:
        lut: ``(D,)`` long, the relative row of each band distance ``δ = t + lo + 1``.
        rows: ``lut`` as a slice when it is a contiguous increasing range (Shaw, Music
            Transformer: no copy to go to distance coordinates), else None (T5's buckets).
    """

    n: int
    lo: int
    hi: int
    block: int
    lut: Tensor
    rows: slice | None = None
    _logits: dict[tuple, _LogitScratch] = field(default_factory=dict)

    @classmethod
    def build(cls, scheme: Scheme, n: int, lo: int, hi: int, block: int, device) -> Band:
        width = hi - lo - 1
        # relative_index(query at a, keys at a + δ) for every δ in the band: keys 0..D-1.
        pos = Positions.from_length(width, device=device)
        anchor = -(lo + 1)
        lut = scheme.relative_index(pos[anchor : anchor + 1], pos).reshape(-1).to(torch.long)
        first = int(lut[0])
        rows = None
        if bool((lut == torch.arange(first, first + width, device=device)).all()):
            rows = slice(first, first + width)
        return cls(n, lo, hi, block, lut, rows)

    @property
    def width(self) -> int:
        """``D``: distances in the band."""
        return self.hi - self.lo - 1

    @property
    def left(self) -> int:
        """Keys before a block's first query that its band reaches (``-lo - 1``)."""
        return -self.lo - 1

    @property
    def keys(self) -> int:
        """``J``: the keys of one block."""
        return self.block + self.width - 1

    @property
    def num_blocks(self) -> int:
        return -(-self.n // self.block)

    def groups(self, batch: int, heads: int) -> list[tuple[int, int]]:
        """``[(c0, c1)]``: blocks per group, each at most :data:`GROUP_ELEMENTS` elements in its
        largest tensor (the ``(b·g, h, B, B + J - 1)`` scratch of :func:`unskew`)."""
        per = max(1, GROUP_ELEMENTS // (batch * heads * self.block * (self.block + self.keys)))
        # Make the interior groups the same size, so that they share one mask.
        per = -(-self.num_blocks // -(-self.num_blocks // per))
        return [(c, min(c + per, self.num_blocks)) for c in range(0, self.num_blocks, per)]

    def trim(self, c0: int, c1: int) -> tuple[int, int]:
        """``(a, e)``: the window columns a group computes. A group of one block drops the padding
        keys outside ``[0, n)`` (the first and last blocks of a wide band, the Music
        Transformer's, would otherwise spend up to half their work on padding)."""
        if c1 - c0 > 1:
            return 0, self.keys
        start = c0 * self.block - self.left  # absolute position of the window's first key
        return max(0, -start), min(self.keys, self.n - start)

    def mask(self, c0: int, c1: int, like: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """``(blocked bool, additive 0/-inf)``, both ``(batch·g, 1, B, J)`` for blocks
        ``[c0, c1)``: pairs outside the band or with a padding key. A padding query (past ``n``)
        blocks nothing, so that no row is empty; its output is dropped."""
        # Groups whose queries and keys all lie inside the sequence share one mask.
        group = None if self.inside(c0, c1) else c0
        key = (self.n, self.lo, self.hi, self.block, group, c1 - c0, batch, like.dtype, like.device)
        return _MASKS.get_or_build(key, lambda: self._build_mask(c0, c1, like, batch))

    def _build_mask(self, c0: int, c1: int, like: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """The mask of :meth:`mask`, computed (positions of the blocks' queries and keys)."""
        dev, b_, j_ = like.device, self.block, self.keys
        ii = torch.arange(b_, device=dev).view(1, b_, 1)
        jj = torch.arange(j_, device=dev).view(1, 1, j_)
        start = torch.arange(c0, c1, device=dev).view(-1, 1, 1) * b_
        query, key_ = start + ii, start + jj - self.left  # absolute positions
        dist = jj - self.left - ii
        blocked = (dist <= self.lo) | (dist >= self.hi) | (key_ < 0) | (key_ >= self.n)
        blocked &= query < self.n
        blocked = blocked.unsqueeze(1).repeat(batch, 1, 1, 1)
        neg = like.new_zeros(blocked.shape).masked_fill_(blocked, -math.inf)
        return blocked, neg

    def inside(self, c0: int, c1: int) -> bool:
        """Whether the queries and keys of blocks ``[c0, c1)`` all lie inside the sequence."""
        return c0 * self.block - self.left >= 0 and c1 * self.block + self.hi - 1 <= self.n

    def exact(self, c0: int, c1: int) -> bool:
        """Whether the band alone is the mask of blocks ``[c0, c1)`` (after :meth:`trim`): no
        padding query, and no padding key (inside the sequence, or trimmed to it)."""
        if c1 * self.block > self.n:
            return False
        return c1 - c0 == 1 or self.inside(c0, c1)

    def to_distance(self, rel: Tensor) -> Tensor:
        """``(.., R)`` relative rows → ``(.., D)`` distance coordinates (a view when possible)."""
        if self.rows is not None:
            return rel[..., self.rows]
        return rel.index_select(-1, self.lut)

    def add_rows(self, out: Tensor, lin: Tensor, t_lo: int, t_hi: int) -> None:
        """``out (.., R) += lin (.., t_hi - t_lo)``: distance columns ``[t_lo, t_hi)`` added to
        their relative rows."""
        if self.rows is not None:
            out[..., self.rows.start + t_lo : self.rows.start + t_hi] += lin
        else:
            out.index_add_(-1, self.lut[t_lo:t_hi], lin)

    def to_rows(self, lin: Tensor, num_rel: int) -> Tensor:
        """The adjoint of :meth:`to_distance`: ``(.., D)`` → ``(.., R)``, summing shared rows."""
        out = lin.new_zeros(*lin.shape[:-1], num_rel)
        if self.rows is not None:
            out[..., self.rows] = lin
        else:
            out.index_add_(-1, self.lut, lin)
        return out


# ------------------------------------------------------------------------- group layout helpers
def _queries(band: Band, x: Tensor, c0: int, c1: int) -> Tensor:
    """``(b, h, n_pad, d)`` rows of blocks ``[c0, c1)`` → ``(b·g, h, B, d)``."""
    b, h, _, d = x.shape
    g, bl = c1 - c0, band.block
    rows = x[:, :, c0 * bl : c1 * bl].reshape(b, h, g, bl, d)
    return rows.permute(0, 2, 1, 3, 4).reshape(b * g, h, bl, d)


def _as_groups(dst: Tensor, g: int) -> Tensor:
    """``(b, h, g·B, ..)`` → a ``(b, g, h, B, ..)`` view, the layout :func:`_queries` makes, to
    write a group's results in place."""
    return dst.unflatten(2, (g, dst.shape[2] // g)).transpose(1, 2)


def _window_span(band: Band, c0: int, c1: int, cols: tuple[int, int]) -> tuple[int, int]:
    """Absolute key positions ``[start, stop)`` that the windows of blocks ``[c0, c1)`` (columns
    ``cols`` of them) cover, padding included."""
    start = c0 * band.block - band.left + cols[0]
    return start, start + (c1 - c0 - 1) * band.block + cols[1] - cols[0]


def _windows(band: Band, x: Tensor, c0: int, c1: int, cols: tuple[int, int]) -> Tensor:
    """Keys ``(b, h, n, d)`` → each block's window, columns ``cols``: ``(b·g, h, e - a, d)``.

    Windows overlap; a strided view of ``x`` holds them all, and a group of one block is a plain
    slice. Only a group reaching past the sequence copies its span into zero padding first."""
    b, h, n, d = x.shape
    g, (a, e) = c1 - c0, cols
    start, stop = _window_span(band, c0, c1, cols)
    if start < 0 or stop > n:
        src = x.new_zeros(b, h, stop - start, d)
        lo, hi = max(0, start), min(n, stop)
        src[:, :, lo - start : hi - start] = x[:, :, lo:hi]
        x, start = src, 0
    if g == 1:
        return x[:, :, start : start + e - a]
    s0, s1, s2, s3 = x.stride()
    view = x.as_strided(
        (b, g, h, e - a, d), (s0, band.block * s2, s1, s2, s3), x.storage_offset() + start * s2
    )
    return view.reshape(b * g, h, e - a, d)


def _fold_windows(
    band: Band, dx: Tensor, dwin: Tensor, c0: int, c1: int, cols: tuple[int, int]
) -> None:
    """The adjoint of :func:`_windows`: add ``(b·g, h, e - a, d)`` windows into ``(b, h, n, d)``.

    Windows overlap; their ``B``-key chunks at the same offset do not, so each chunk offset is one
    strided add."""
    b, h, n, d = dx.shape
    g, bl, width = c1 - c0, band.block, cols[1] - cols[0]
    start, stop = _window_span(band, c0, c1, cols)
    target, base = dx, start
    if start < 0 or stop > n:  # past the sequence: fold into a padded span, then add what exists
        target, base = dx.new_zeros(b, h, stop - start, d), 0
    if g == 1:
        target[:, :, base : base + width] += dwin
    else:
        dwin = dwin.reshape(b, g, h, width, d)
        t0, t1, t2, t3 = target.stride()
        for c in range(0, width, bl):
            w = min(bl, width - c)
            view = target.as_strided(
                (b, g, h, w, d),
                (t0, bl * t2, t1, t2, t3),
                target.storage_offset() + (base + c) * t2,
            )
            view.add_(dwin[:, :, :, c : c + w])
    if target is not dx:
        lo, hi = max(0, start), min(n, stop)
        dx[:, :, lo:hi] += target[:, :, lo - start : hi - start]


def _distances(band: Band, tile: Tensor, cols: tuple[int, int]) -> tuple[Tensor, int, int]:
    """``(lin, t_lo, t_hi)``: a group tile ``(.., B, e - a)`` at band distances ``[t_lo, t_hi)``,
    ``lin[.., i, t - t_lo]`` (zero where row ``i`` has no key at distance ``t``).

    With the whole window every row holds every band distance, at column ``i + t``: a view with
    row stride ``J + 1`` (the skew's inverse, no copy). A trimmed window goes through
    :func:`diagonals`."""
    t0, t_lo, t_hi = _distance_range(band, cols)
    if cols == (0, band.keys) and tile.stride(-1) == 1:
        return diagonal_view(tile, band.width), 0, band.width
    return diagonals(tile)[..., t_lo - t0 : t_hi - t0], t_lo, t_hi


def _group_mask(band: Band, rel_lin: Tensor, neg: Tensor, b: int, cols: tuple[int, int]) -> Tensor:
    """Distance-coordinate logit term ``(1|b, h, g·B, D)`` plus the ``(b·g, 1, B, J)`` band mask
    → the group's float mask ``(b·g, h, B, J)`` (the skew is a strided view; this add is the one
    copy, written in the kernel's batch layout)."""
    bb, h, gb, dd = rel_lin.shape
    g = gb // band.block
    # rel_lin may be a column slice of a wider row: keep its strides, split the rows into blocks.
    s0, s1, s2, s3 = rel_lin.stride()
    blocks = rel_lin.as_strided(
        (bb, h, g, band.block, dd),
        (s0, s1, band.block * s2, s2, s3),
        rel_lin.storage_offset(),
    )
    a, e = cols
    tiles = skew_view(blocks, a, e - a).transpose(1, 2)  # (bb, g, h, B, J)
    out = rel_lin.new_empty(b, g, h, band.block, e - a)
    torch.add(tiles, neg.unflatten(0, (b, g)), out=out)
    return out.view(b * g, h, band.block, e - a)


def query_independent(scheme: Scheme, q: Tensor) -> bool:
    """Whether ``scheme.relative_logits`` is the same for every query (T5): ``(.., 1, R)``."""
    return scheme.relative_logits(q.new_zeros(1, q.shape[1], 2, q.shape[3])).shape[2] == 1


def supports(scheme: Scheme, q: Tensor) -> bool:
    """Whether the band computes ``scheme``'s logit term: a query-independent one (T5) or one
    given by ``relative_keys`` (``q·Eᵀ``: Shaw, the Music Transformer)."""
    return getattr(scheme, "relative_keys", None) is not None or query_independent(scheme, q)


class _ConstMasks:
    """The float masks of a query-independent logit term (T5), for one call's groups.

    Every block sees the same term, and every block of a group inside the sequence also sees the
    same band mask: such groups share one ``(1, h, B, J)`` mask, built once per call, which the
    fused kernel and the backward pass's add broadcast over the group's blocks. Before, each
    group wrote its own ``(b·g, h, B, J)`` copy (about 5 % of T5's forward pass at L=2048). A term
    that differs per batch row (``(b, h, 1, R)``) cannot broadcast over the ``b·g`` kernel batch
    and keeps one mask per group.
    """

    def __init__(self, band: Band, lin: Tensor, batch: int) -> None:
        """``lin``: the term in distance coordinates, ``(1|b, h, 1, D)``, without a graph."""
        self.band = band
        rows = _group_rows(band, batch, lin.shape[1])
        self.lin = lin.expand(*lin.shape[:2], rows, lin.shape[-1]).contiguous()
        self._shared: dict[tuple[int, int], Tensor] = {}

    def mask(self, c0: int, c1: int, cols: tuple[int, int], neg: Tensor, b: int) -> Tensor:
        """The ``(b·g | 1, h, B, e - a)`` float mask of blocks ``[c0, c1)``, window ``cols``."""
        band = self.band
        if self.lin.shape[0] == 1 and band.inside(c0, c1):
            hit = self._shared.get(cols)
            if hit is None:
                hit = _group_mask(band, self.lin[:, :, : band.block], neg[:1], 1, cols)
                self._shared[cols] = hit
            return hit
        return _group_mask(band, self.lin[:, :, : (c1 - c0) * band.block], neg, b, cols)


def _group_rows(band: Band, b: int, h: int) -> int:
    """Query rows of the largest group."""
    return max(c1 - c0 for c0, c1 in band.groups(b, h)) * band.block


def _padded_queries(band: Band, q: Tensor) -> Tensor:
    """Query rows padded to whole blocks (``q`` itself when they already are)."""
    extra = band.num_blocks * band.block - band.n
    return q if extra == 0 else torch.nn.functional.pad(q, (0, 0, 0, extra))


def _distance_range(band: Band, cols: tuple[int, int]) -> tuple[int, int, int]:
    """``(t0, t_lo, t_hi)`` for a tile of window columns ``[a, e)``: its :func:`diagonals` column
    ``c`` is distance column ``t0 + c``, and the distances it holds are ``[t_lo, t_hi)``."""
    a, e = cols
    t0 = a - band.block + 1
    return t0, max(0, t0), min(band.width, e)


class _LogitScratch:
    """The buffer that every group of one shape writes its ``q·Eᵀ`` logit term into.

    A group writes only its band columns, and the columns outside them that may hold anything
    else (at first the whole uninitialised buffer, then what the previous group wrote) are set to
    ``-inf`` — interior groups write the same columns, so in steady state nothing is filled (many
    short strided fills cost about a tenth of a GEMM; filling the whole buffer up front cost more
    than the band's own products in the backward pass). Its row stride stays the full width,
    which :func:`skew_view` allows.
    """

    def __init__(self, buf: Tensor) -> None:
        # Columns outside [lo, hi) hold -inf; at first, nothing is known to.
        self.buf, self.lo, self.hi = buf, 0, buf.shape[-1]

    def take(self, lo: int, hi: int, width: int) -> Tensor:
        """The first ``width`` columns, ``-inf`` outside ``[lo, hi)`` (which the caller fills)."""
        for a, e in ((self.lo, min(self.hi, lo)), (max(self.lo, hi), self.hi)):
            if e > a:
                self.buf[..., a:e].fill_(-math.inf)
        self.lo, self.hi = lo, hi
        return self.buf[..., :width]


def _keyed_logits(
    band: Band, c0: int, c1: int, qg: Tensor, keys: Tensor, cols: tuple[int, int]
) -> Tensor:
    """A ``q·Eᵀ`` logit term (Shaw, Music Transformer) for one group, in :func:`diagonals`
    layout: ``(b·g, h, B, e - a + B - 1)``, ``-inf`` in the columns outside the band.

    Only the distances the tile reaches are multiplied (the first blocks of a wide band reach
    fewer), straight into the buffer; its skewed view (offset ``B - 1``) is then the tile's float
    mask with the band already applied — no copy, no ``0/-inf`` add.
    """
    t0, t_lo, t_hi = _distance_range(band, cols)
    key = (qg.shape[:-1], qg.dtype, qg.device)
    scratch = band._logits.get(key)
    if scratch is None:
        scratch = band._logits[key] = _LogitScratch(
            qg.new_empty((*qg.shape[:-1], band.keys + band.block - 1))
        )
    buf = scratch.take(t_lo - t0, t_hi - t0, cols[1] - cols[0] + band.block - 1)
    dst, keys_t = buf[..., t_lo - t0 : t_hi - t0], keys[..., t_lo:t_hi, :].transpose(-1, -2)
    if qg.shape[0] == 1:  # few large products (a wide band): straight into the strided buffer
        torch.matmul(qg, keys_t, out=dst)
    else:  # many small ones: a strided `out=` runs them one by one (2-3× slower than a copy)
        dst.copy_(torch.matmul(qg, keys_t))
    return buf


def _tile_mask(
    band: Band,
    c0: int,
    c1: int,
    cols: tuple[int, int],
    neg: Tensor,
    qg: Tensor,
    keys: Tensor | None,
    const: _ConstMasks | None,
) -> Tensor:
    """The group's float mask ``(b·g | 1, h|1, B, e - a)``: logit term plus ``-inf`` where
    blocked."""
    a, e = cols
    b = qg.shape[0] // (c1 - c0)
    if keys is not None:
        mask = skew_view(_keyed_logits(band, c0, c1, qg, keys, cols), band.block - 1, e - a)
        return mask if band.exact(c0, c1) else mask + neg
    if const is not None:
        return const.mask(c0, c1, cols, neg, b)
    return neg


def _distance_keys(scheme: Scheme, band: Band, dtype: torch.dtype, far_rows: list[int]):
    """``(keys in distance coordinates (h|1, D, d), keys of far_rows (h|1, len, d) | None)``."""
    keys = scheme.relative_keys(dtype)
    if band.rows is not None:
        near = keys[..., band.rows, :]
    else:
        near = keys.index_select(-2, band.lut)
    return near, (keys[..., far_rows, :] if far_rows else None)


class RelativeTerm:
    """A band's logit term and its gradients, shared by the band engines (this module's and
    :mod:`relpos.attention.narrow`'s).

    Either query-independent (T5: ``rel (1|b, h, 1, R)``, in distance coordinates ``lin (1|b, h,
    1, D)``) or ``q·Eᵀ`` (``keys (h|1, D, d)`` in distance coordinates), or absent. With
    ``grads``, the term keeps its graph to the scheme's parameters and accumulates their
    gradient in distance coordinates (``drel_lin`` or ``dkeys``) for :func:`finish_relative_grads`.

    Attributes:
        cols: the term at ``far_rows`` for every query, ``(1|b, h, i, len(far_rows))`` (forward).
    """

    def __init__(
        self,
        scheme: Scheme,
        band: Band,
        q: Tensor,
        *,
        has_bias: bool,
        far_rows: list[int],
        grads: bool,
    ) -> None:
        _, h, n, d = q.shape
        self.const_rel = self.lin = self.keys = self.keys_g = self.cols = None
        self.drel_lin = self.dkeys = None
        if has_bias and query_independent(scheme, q):  # T5
            with torch.set_grad_enabled(grads):
                self.const_rel = scheme.relative_logits(q[:, :, :1])  # (1|b, h, 1, R)
            self.lin = band.to_distance(self.const_rel.detach())
            if grads and self.const_rel.requires_grad:
                self.drel_lin = q.new_zeros(1, h, 1, band.width)
            if not grads and far_rows:
                self.cols = self.const_rel[..., far_rows].expand(-1, -1, n, -1)
        elif has_bias:  # q·Eᵀ
            with torch.set_grad_enabled(grads):
                self.keys_g = _distance_keys(scheme, band, q.dtype, far_rows)
            self.keys = self.keys_g[0].detach()
            if grads and self.keys_g[0].requires_grad:
                self.dkeys = q.new_zeros(h, band.width, d)
            if not grads and self.keys_g[1] is not None:
                self.cols = torch.matmul(q, self.keys_g[1].transpose(-1, -2))

    def _keys(self, h0: int, h1: int) -> Tensor:
        return self.keys if self.keys.shape[0] == 1 else self.keys[h0:h1]

    def term(
        self, qc: Tensor, b0: int, b1: int, h0: int, h1: int, *, out: Tensor | None = None
    ) -> Tensor | None:
        """The term of rows ``[b0, b1) × [h0, h1)`` in distance coordinates: ``q·Eᵀ`` as a
        ``(bc, hc, i, D)`` tensor (new, or written into ``out``), T5's ``(1|bc, hc, 1, D)`` view,
        or None."""
        if self.keys is not None:
            return torch.matmul(qc, self._keys(h0, h1).transpose(-1, -2), out=out)
        if self.lin is not None:
            lin = self.lin if self.lin.shape[0] == 1 else self.lin[b0:b1]
            return lin[:, h0:h1]
        return None

    def add_grads(
        self, ds: Tensor, qc: Tensor, dqc: Tensor, h0: int, h1: int, needs_q: bool
    ) -> None:
        """Accumulate the term's gradient from ``ds (bc, hc, i, D)``, the score gradient in
        distance coordinates of queries ``qc``; ``dq·E`` into ``dqc`` for a ``q·Eᵀ`` term."""
        if self.keys is not None:
            if needs_q:
                dqc += torch.matmul(ds, self._keys(h0, h1))
            if self.dkeys is not None:
                self.dkeys[h0:h1] += torch.einsum("bhnt,bhnd->htd", ds, qc)
        elif self.drel_lin is not None:
            self.drel_lin[0, h0:h1, 0] += ds.sum((0, 2))


def finish_relative_grads(
    term: RelativeTerm,
    band: Band,
    q: Tensor,
    dq: Tensor,
    num_rel: int,
    far_rows: list[int],
    far_grads: Tensor | None,
    needs_q: bool,
    sink: GradSink,
) -> None:
    """Push the accumulated gradient of the term (band distances plus ``far_grads (b, h, i,
    len(far_rows))``, the far rows' share) through the scheme once: into ``dq`` for ``q·Eᵀ``'s
    far rows and into ``sink`` for the parameters."""
    if term.drel_lin is not None:  # (1, h, 1, D) → (1, h, 1, R)
        drel = band.to_rows(term.drel_lin, num_rel)
        if far_grads is not None:
            drel[..., far_rows] += far_grads.sum((0, 2), keepdim=True)
        push_grad(term.const_rel, drel, None, None, sink)
    if term.keys_g is not None:
        near, far = term.keys_g
        outs, outs_grads = [near], [term.dkeys]
        if far is not None and far_grads is not None:
            if needs_q:
                dq += torch.matmul(far_grads, far.detach())
            outs.append(far)
            outs_grads.append(torch.einsum("bhnr,bhnd->hrd", far_grads, q))
        if term.dkeys is not None:  # one pass through relative_keys for both
            grads_ = [_sum_heads(g, t) for g, t in zip(outs_grads, outs, strict=True)]
            push_grad(outs, grads_, None, None, sink)


def band_forward(
    scheme: Scheme,
    band: Band,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    has_bias: bool,
    has_value: bool,
    num_rel: int,
    far_rows: list[int],
) -> dict[str, Tensor]:
    """Attention restricted to the band, one fused-kernel call per group of query blocks.

    Returns ``lse (b, h, i)``, ``out (b, h, i, d)`` (normalised over the band), with a value term
    ``mass (b, h, i, R)`` (attention mass per relative row, normalised over the band) and, for
    ``far_rows``, ``cols (1|b, h, i, len(far_rows))``: the logit term at those rows.
    """
    b, h, n, _ = q.shape
    n_pad = band.num_blocks * band.block
    qp = _padded_queries(band, q)
    lse = q.new_empty(b, h, n_pad)
    out = q.new_empty(b, h, n_pad, q.shape[-1])
    mass = q.new_zeros(b, h, n_pad, num_rel) if has_value else None
    term = RelativeTerm(scheme, band, q, has_bias=has_bias, far_rows=far_rows, grads=False)
    keys, cols = term.keys, term.cols
    const = None if term.lin is None else _ConstMasks(band, term.lin, b)
    for c0, c1 in band.groups(b, h):
        r0, r1 = c0 * band.block, c1 * band.block
        g, qg = c1 - c0, _queries(band, qp, c0, c1)
        a, e = band.trim(c0, c1)
        kg, vg = _windows(band, k, c0, c1, (a, e)), _windows(band, v, c0, c1, (a, e))
        blocked, neg = (x[..., a:e] for x in band.mask(c0, c1, q, b))
        mask = _tile_mask(band, c0, c1, (a, e), neg, qg, keys, const)
        out_g, lse_g = _as_groups(out[:, :, r0:r1], g), _as_groups(lse[:, :, r0:r1], g)
        if mass is None:
            o, l_ = _flash(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scale)
            out_g.copy_(o.unflatten(0, (b, g)))
            lse_g.copy_(l_.unflatten(0, (b, g)))
            continue
        # A value term needs the probabilities themselves (the mass per relative row), which the
        # fused kernel does not return: the blocks' softmax in plain ops.
        s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale).add_(mask)
        m = s.amax(-1, keepdim=True)  # finite: every real query's own key is in the band
        # exp(-inf) and exp of very negative numbers take a slow path on CPU (3-10×): flush at
        # -87 (exp = 1.6e-38), then zero the blocked pairs exactly.
        p = s.sub_(m).clamp_min_(-87.0).exp_().masked_fill_(blocked, 0.0)
        norm = p.sum(-1, keepdim=True)
        p.div_(norm)
        out_g.copy_(torch.matmul(p, vg).unflatten(0, (b, g)))
        lse_g.copy_(m.add_(norm.log_()).squeeze(-1).unflatten(0, (b, g)))
        lin, t_lo, t_hi = _distances(band, p, (a, e))  # (b·g, h, B, t_hi - t_lo)
        band.add_rows(_as_groups(mass[:, :, r0:r1], g), lin.unflatten(0, (b, g)), t_lo, t_hi)
    result = {"lse": lse[:, :, :n], "out": out[:, :, :n]}
    if mass is not None:
        result["mass"] = mass[:, :, :n]
    if cols is not None:
        result["cols"] = cols[:, :, :n]
    return result


def probs_and_dscores(
    s: Tensor, mask: Tensor, lse: Tensor, blocked: Tensor, dp: Tensor, delta: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """A recomputed tile's probabilities and score gradient, in place of ``s`` and ``dp``:
    ``P = exp(S·scale + mask - lse)`` (exactly 0 where ``blocked``), ``dS = P ⊙ (dP - D)``.

    Shapes: s, dp ``(n, h, B, J)``; mask ``(n, h|1, B, J)``; blocked ``(n, 1, B, J)``; lse,
    delta ``(n, h, B, 1)``. (``benchmarks/compile_band.py`` measures this chain under
    ``torch.compile``; see ``docs/performance.md``.)
    """
    # exp of very negative numbers takes a slow path on CPU: flush, then zero the blocked.
    p = s.mul_(scale).add_(mask).sub_(lse).clamp_min_(-87.0).exp_().masked_fill_(blocked, 0.0)
    return p, dp.sub_(delta).mul_(p)


def band_backward(
    scheme: Scheme,
    band: Band,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    lse: Tensor,
    delta: Tensor,
    *,
    scale: float,
    has_bias: bool,
    num_rel: int,
    dmass: Tensor | None,
    far_rows: list[int],
    far_grads: Tensor | None,
    needs_q: bool,
    sink: GradSink,
    grads: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Gradients of the band, recomputed per group of query blocks from the final ``lse``.

    Adds into ``grads = (dq, dk, dv)`` and the scheme's parameter gradients into ``sink``.
    ``delta (b, h, i)`` is ``rowsum(dO ⊙ O)``; ``dmass (b, h, i, R)`` the gradient of the value
    mass; ``far_grads (b, h, i, len(far_rows))`` gradients of the logit term at ``far_rows``.
    """
    dq, dk, dv = grads
    b, h, n, _ = q.shape
    n_pad = band.num_blocks * band.block
    qp, dop = _padded_queries(band, q), _padded_queries(band, do)
    # Padding rows: lse = +inf makes their recomputed probabilities 0, so they add nothing.
    lse_p = torch.nn.functional.pad(lse, (0, n_pad - n), value=math.inf)
    delta_p = torch.nn.functional.pad(delta, (0, n_pad - n))
    dmass_p = None
    if dmass is not None:
        dmass_p = band.to_distance(torch.nn.functional.pad(dmass, (0, 0, 0, n_pad - n)))
    dqp = dq if n_pad == n else torch.zeros_like(qp)  # whole blocks: add into dq directly
    # A query-independent term (T5, ``(1, h, 1, R)``): every block has the same geometry, so its
    # gradient sums the groups' dS tiles over batch and blocks first and unskews once at the end.
    # A q·Eᵀ term: dq gets dS_rel·E, and E's gradient dS_relᵀ·q is summed, pushed once.
    term = RelativeTerm(scheme, band, q, has_bias=has_bias, far_rows=far_rows, grads=True)
    keys, dkeys, ds_total = term.keys, term.dkeys, None
    const = None if term.lin is None else _ConstMasks(band, term.lin, b)
    for c0, c1 in band.groups(b, h):
        r0, r1 = c0 * band.block, c1 * band.block
        g, qg, dog = c1 - c0, _queries(band, qp, c0, c1), _queries(band, dop, c0, c1)
        a, e = band.trim(c0, c1)
        kg, vg = _windows(band, k, c0, c1, (a, e)), _windows(band, v, c0, c1, (a, e))
        blocked, neg = (x[..., a:e] for x in band.mask(c0, c1, q, b))
        mask = _tile_mask(band, c0, c1, (a, e), neg, qg, keys, const)
        dp = torch.matmul(dog, vg.transpose(-1, -2))
        if dmass_p is not None:
            dlin = _queries(band, dmass_p, c0, c1).contiguous()  # (b·g, h, B, D)
            dp.add_(skew_view(dlin, a, e - a))
        p, ds = probs_and_dscores(
            torch.matmul(qg, kg.transpose(-1, -2)),
            mask,
            _queries(band, lse_p.unsqueeze(-1), c0, c1),
            blocked,
            dp,
            _queries(band, delta_p.unsqueeze(-1), c0, c1),
            scale,
        )
        _fold_windows(band, dv, torch.matmul(p.transpose(-1, -2), dog), c0, c1, (a, e))
        if keys is not None and (needs_q or dkeys is not None):
            drel, t_lo, t_hi = _distances(band, ds, (a, e))  # (b·g, h, B, t_hi - t_lo)
            if needs_q:
                dq_rel = torch.matmul(drel, keys[..., t_lo:t_hi, :])
                _as_groups(dqp[:, :, r0:r1], g).add_(dq_rel.unflatten(0, (b, g)))
            if dkeys is not None:
                dkeys[:, t_lo:t_hi] += torch.einsum("nhbt,nhbd->htd", drel, qg)
        elif term.drel_lin is not None:
            part = torch.nn.functional.pad(ds.sum(0), (a, band.keys - e))
            ds_total = part if ds_total is None else ds_total.add_(part)
        dq_g = torch.matmul(ds, kg).mul_(scale)
        _as_groups(dqp[:, :, r0:r1], g).add_(dq_g.unflatten(0, (b, g)))
        dkg = torch.matmul(ds.transpose(-1, -2), qg).mul_(scale)
        _fold_windows(band, dk, dkg, c0, c1, (a, e))
    if dqp is not dq:
        dq += dqp[:, :, :n]
    if ds_total is not None:  # (h, B, J) → (1, h, 1, D)
        term.drel_lin += unskew(ds_total, 0, band.width).sum(1, keepdim=True).unsqueeze(0)
    finish_relative_grads(term, band, q, dq, num_rel, far_rows, far_grads, needs_q, sink)


def _sum_heads(grad: Tensor, like: Tensor) -> Tensor:
    """A per-head gradient ``(h, .., ..)`` summed to a shared table's ``(1, .., ..)``."""
    return grad.sum(0, keepdim=True) if like.shape[0] == 1 and grad.shape[0] != 1 else grad
