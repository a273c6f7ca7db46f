"""The geometry of a band of self-attention: blocks, windows, masks and the strided skew views.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``R`` rows of a relative table;
``B`` queries in one block, ``J`` its keys, ``D`` distances in the band.

Over contiguous positions a relative scheme's term depends on the query only through the
distance ``δ = j - i``. :class:`Band` cuts the band ``lo < δ < hi`` of ``n`` queries into
blocks of ``B``: block ``c`` holds queries ``[cB, cB + B)`` and the *window* of ``J = B + D - 1``
keys its band reaches. Distance column ``t`` is ``δ = t + lo + 1``; window column ``j`` of block
row ``i`` is ``t = j - i``. The views below move between the two coordinates without copies (the
skew of Huang et al., 2018, as a strided view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...positions import Positions
from ...schemes.base import RelativeScheme
from ..memo import BoundedCache

__all__ = [
    "BAND_MASKS",
    "GROUP_ELEMENTS",
    "Band",
    "diagonal_view",
    "diagonals",
    "skew_view",
    "unskew",
]

#: Elements of one group's ``(b, g, h, B, J)`` tiles (16 MiB in float32).
GROUP_ELEMENTS = 1 << 20

#: Bytes of band masks kept between calls (:data:`BAND_MASKS`).
MASK_CACHE_BYTES = 64 << 20


#: Band masks depend on geometry only (``n``, the band, the block, the group, batch, dtype,
#: device), so every call of one shape (every layer, every step) shares them.
BAND_MASKS = BoundedCache(MASK_CACHE_BYTES)


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
    #: the tile engine's logit buffers for this call, by shape
    logit_buffers: dict[tuple, Any] = field(default_factory=dict)
    #: padding positions after each row's ``n`` (whole blocks) in the distance engine's flat
    #: buffers, so that no real query's key window reaches the next (batch, head) row's keys
    gap: int = 0

    @classmethod
    def build(cls, scheme: RelativeScheme, n: int, lo: int, hi: int, block: int, device) -> Band:
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
        return -(-(self.n + self.gap) // self.block)

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
        return BAND_MASKS.get_or_build(key, lambda: self._build_mask(c0, c1, like, batch))

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
