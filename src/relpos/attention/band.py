"""The band of a relative scheme's self-attention, for the ``chunked`` backend's region path.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table; ``B`` queries in one block, ``J`` its keys, ``D`` distances in the band.

Over contiguous positions, a relative scheme's logit term depends on the query only through the
distance ``δ = j - i``, and beyond a band ``lo < δ < hi`` it is a per-query constant (clipping). The
far parts go to the fused kernel elsewhere (:mod:`relpos.attention.chunked`); this module computes
the band in query blocks of ``B``: block ``c`` holds queries ``[cB, cB + B)`` and the
``J = B + D - 1`` keys its band reaches, ``[cB + lo + 1, cB + B + hi - 1)`` (keys outside
``[0, n)`` are zero padding, masked). Every block then has the same geometry, so a *group* of
blocks is one batch: one fused kernel call, one GEMM, one elementwise op each, however many blocks
(no per-block Python loop).

* the logit term in *distance coordinates*: ``rel_lin[b, h, i, t]`` for ``δ = t + lo + 1``
  (``t < D = hi - lo - 1``), the scheme's ``relative_logits`` at the rows ``lut[t] =
  relative_index(δ)``;
* the ``(B, J)`` tile of it is a strided **view** (the skew of Huang et al., 2018, without a copy):
  element ``(i, j)`` of the tile is ``rel_lin[i, j - i + j0 - i0 - lo - 1]``, at storage offset
  ``(j0 - i0 - lo - 1) + i·(row - 1) + j`` — a view with row stride ``row - 1``;
* forward: the tile view plus ``-inf`` outside the band is the float mask of one call to the fused
  CPU flash kernel per group, which returns the blocks' outputs and log-sum-exp (with a value term,
  the softmax in plain ops, since the attention mass per relative row needs the probabilities);
* backward: the tile is recomputed (``baddbmm`` with the same mask, ``exp(s - lse)``) and
  ``dS = P ⊙ (dP - D)`` is written through the transposed skew into distance coordinates, then
  summed into the table rows with ``index_add`` — the per-pair gradient no fused kernel returns.

Nothing of size ``(i, j)`` or ``(i, j, d)`` exists: a group holds ``O(g·B·J)`` elements, with ``g``
chosen to keep that under :data:`GROUP_ELEMENTS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..positions import Positions
from ..schemes.base import Scheme
from .grads import GradSink, push_grad

__all__ = ["GROUP_ELEMENTS", "Band", "band_backward", "band_forward", "skew_view", "unskew"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

#: Elements of one group's ``(b, g, h, B, J)`` tiles (16 MiB in float32).
GROUP_ELEMENTS = 1 << 20


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


def unskew(tile: Tensor, offset: int, width: int) -> Tensor:
    """The adjoint of :func:`skew_view`: ``out[.., i, offset + j - i] += tile[.., i, j]``.

    Shapes: tile ``(.., B, J)``; returns ``(.., B, width)`` (columns outside ``[0, width)`` drop).
    """
    *lead, rows, keys = tile.shape
    # A scratch row of B + J - 1 columns holds every diagonal once: column c = B - 1 + j - i.
    # Its view with row stride (B + J - 2) >= J never writes one address twice.
    cols = rows + keys - 1
    scratch = tile.new_zeros(*lead, rows, cols)
    view = scratch.as_strided((*lead, rows, keys), (*scratch.stride()[:-2], cols - 1, 1), rows - 1)
    view.copy_(tile)
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
    _masks: dict[tuple, tuple[Tensor, Tensor]] = field(default_factory=dict)

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

    def pad(self, x: Tensor) -> Tensor:
        """``(b, h, n, d)`` → ``(b, h, left + nb·B + right, d)``: zero keys around the sequence,
        so that every block's keys are one window of the same length."""
        tail = self.num_blocks * self.block - self.n + self.hi - 1
        return torch.nn.functional.pad(x, (0, 0, self.left, tail))

    def mask(self, c0: int, c1: int, like: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """``(blocked bool, additive 0/-inf)``, both ``(batch·g, 1, B, J)`` for blocks
        ``[c0, c1)``: pairs outside the band or with a padding key. A padding query (past ``n``)
        blocks nothing, so that no row is empty; its output is dropped."""
        # Groups whose queries and keys all lie inside the sequence share one mask.
        inside = c0 * self.block - self.left >= 0 and c1 * self.block + self.hi - 1 <= self.n
        key = (None if inside else c0, c1 - c0, batch, like.dtype, like.device)
        hit = self._masks.get(key)
        if hit is None:
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
            hit = self._masks[key] = (blocked, neg)
        return hit

    def to_distance(self, rel: Tensor) -> Tensor:
        """``(.., R)`` relative rows → ``(.., D)`` distance coordinates (a view when possible)."""
        if self.rows is not None:
            return rel[..., self.rows]
        return rel.index_select(-1, self.lut)

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


def _unqueries(y: Tensor, b: int) -> Tensor:
    """The inverse layout: ``(b·g, h, B, ..)`` → ``(b, h, g·B, ..)``."""
    g = y.shape[0] // b
    y = y.reshape(b, g, *y.shape[1:]).transpose(1, 2)
    return y.reshape(b, y.shape[1], g * y.shape[3], *y.shape[4:])


def _windows(band: Band, xp: Tensor, c0: int, c1: int) -> Tensor:
    """Padded keys ``(b, h, P, d)`` → each block's window ``(b·g, h, J, d)`` (a copy)."""
    b, h, _, d = xp.shape
    s0, s1, s2, s3 = xp.stride()
    view = xp.as_strided(
        (b, c1 - c0, h, band.keys, d),
        (s0, band.block * s2, s1, s2, s3),
        xp.storage_offset() + c0 * band.block * s2,
    )
    return view.reshape(b * (c1 - c0), h, band.keys, d)


def _fold_windows(
    band: Band, dxp: Tensor, dwin: Tensor, c0: int, c1: int, cols: tuple[int, int]
) -> None:
    """The adjoint of :func:`_windows`: add ``(b·g, h, J, d)`` windows (columns ``cols`` of them)
    into ``(b, h, P, d)``.

    Windows overlap; their ``B``-key chunks at the same offset do not, so each chunk offset is one
    strided add."""
    b, h, _, d = dxp.shape
    g, bl = c1 - c0, band.block
    a, e = cols
    if (a, e) != (0, band.keys):  # a trimmed group of one block: one plain add
        start = c0 * bl + a
        dxp[:, :, start : start + e - a] += dwin.reshape(b, h, e - a, d)
        return
    dwin = dwin.reshape(b, g, h, band.keys, d)
    for c in range(0, band.keys, bl):
        w = min(bl, band.keys - c)
        target = dxp.as_strided(
            (b, g, h, w, d),
            (dxp.stride(0), bl * dxp.stride(2), dxp.stride(1), dxp.stride(2), dxp.stride(3)),
            dxp.storage_offset() + (c0 * bl + c) * dxp.stride(2),
        )
        target.add_(dwin[:, :, :, c : c + w])


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


def _const_lin(scheme: Scheme, band: Band, q: Tensor, rows: int) -> Tensor:
    """A query-independent logit term (T5) in distance coordinates, ``(1|b, h, rows, D)``."""
    lin = band.to_distance(scheme.relative_logits(q[:, :, :1]))
    return lin.expand(*lin.shape[:2], rows, lin.shape[-1]).contiguous()


def _group_rows(band: Band, b: int, h: int) -> int:
    """Query rows of the largest group."""
    return max(c1 - c0 for c0, c1 in band.groups(b, h)) * band.block


def _padded_queries(band: Band, q: Tensor) -> Tensor:
    """Query rows padded to whole blocks (``q`` itself when they already are)."""
    extra = band.num_blocks * band.block - band.n
    return q if extra == 0 else torch.nn.functional.pad(q, (0, 0, 0, extra))


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
    qp, kp, vp = _padded_queries(band, q), band.pad(k), band.pad(v)
    lse = q.new_empty(b, h, n_pad)
    out = q.new_empty(b, h, n_pad, q.shape[-1])
    mass = q.new_zeros(b, h, n_pad, num_rel) if has_value else None
    const = cols = None
    if has_bias and query_independent(scheme, q):
        const = _const_lin(scheme, band, q, _group_rows(band, b, h))
        if far_rows:
            cols = scheme.relative_logits(q[:, :, :1])[..., far_rows].expand(-1, -1, n, -1)
    elif has_bias and far_rows:
        cols = q.new_empty(b, h, n_pad, len(far_rows))  # filled group by group
    for c0, c1 in band.groups(b, h):
        r0, r1 = c0 * band.block, c1 * band.block
        qg = _queries(band, qp, c0, c1)
        a, e = band.trim(c0, c1)
        kg, vg = _windows(band, kp, c0, c1)[:, :, a:e], _windows(band, vp, c0, c1)[:, :, a:e]
        neg = band.mask(c0, c1, q, b)[1][..., a:e]
        mask = neg.contiguous()
        if has_bias:
            if const is not None:
                rel_lin = const[:, :, : r1 - r0]
            else:
                rel = scheme.relative_logits(qp[:, :, r0:r1])
                rel_lin = band.to_distance(rel)
                if cols is not None:
                    cols[:, :, r0:r1] = rel[..., far_rows]
            mask = _group_mask(band, rel_lin, neg, b, (a, e))
        if mass is None:
            o, l_ = _flash(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scale)
            out[:, :, r0:r1], lse[:, :, r0:r1] = _unqueries(o, b), _unqueries(l_, b)
            continue
        # A value term needs the probabilities themselves (the mass per relative row), which the
        # fused kernel does not return: the blocks' softmax in plain ops.
        s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale).add_(mask)
        m = s.amax(-1, keepdim=True)  # finite: every real query's own key is in the band
        p = s.sub_(m).exp_()  # -inf outside the band → exactly 0
        norm = p.sum(-1, keepdim=True)
        p.div_(norm)
        out[:, :, r0:r1] = _unqueries(torch.matmul(p, vg), b)
        lse[:, :, r0:r1] = _unqueries((m + norm.log()).squeeze(-1), b)
        lin = _unqueries(unskew(p, a, band.width), b)  # (b, h, g·B, D)
        mass[:, :, r0:r1] = band.to_rows(lin, num_rel)
    result = {"lse": lse[:, :, :n], "out": out[:, :, :n]}
    if mass is not None:
        result["mass"] = mass[:, :, :n]
    if cols is not None:
        result["cols"] = cols[:, :, :n]
    return result


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
    qp, kp, vp = _padded_queries(band, q), band.pad(k), band.pad(v)
    dop = _padded_queries(band, do)
    # Padding rows: lse = +inf makes their recomputed probabilities 0, so they add nothing.
    lse_p = torch.nn.functional.pad(lse, (0, n_pad - n), value=math.inf)
    delta_p = torch.nn.functional.pad(delta, (0, n_pad - n))
    dmass_p = None
    if dmass is not None:
        dmass_p = band.to_distance(torch.nn.functional.pad(dmass, (0, 0, 0, n_pad - n)))
    dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
    dqp = dq if n_pad == n else torch.zeros_like(qp)  # whole blocks: add into dq directly
    # A query-independent term (T5, ``(1, h, 1, R)``): every block has the same geometry, so its
    # gradient sums the groups' dS tiles over batch and blocks first and unskews once at the end.
    const = const_rel = ds_total = None
    if has_bias and query_independent(scheme, q):
        with torch.enable_grad():
            const_rel = scheme.relative_logits(q[:, :, :1])
        const = _const_lin(scheme, band, q.detach(), _group_rows(band, b, h))
    for c0, c1 in band.groups(b, h):
        r0, r1 = c0 * band.block, c1 * band.block
        qg, dog = _queries(band, qp, c0, c1), _queries(band, dop, c0, c1)
        a, e = band.trim(c0, c1)
        kg, vg = _windows(band, kp, c0, c1)[:, :, a:e], _windows(band, vp, c0, c1)[:, :, a:e]
        blocked, neg = (x[..., a:e] for x in band.mask(c0, c1, q, b))
        mask, rel, q_leaf = neg.contiguous(), None, None
        if has_bias:
            if const is not None:
                rel_lin = const[:, :, : r1 - r0]
            else:
                with torch.enable_grad():
                    q_leaf = qp[:, :, r0:r1].detach().requires_grad_(needs_q)
                    rel = scheme.relative_logits(q_leaf)
                rel_lin = band.to_distance(rel.detach())
            mask = _group_mask(band, rel_lin, neg, b, (a, e))
        s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale).add_(mask)
        lse_g = _queries(band, lse_p.unsqueeze(-1), c0, c1)
        # exp of very negative numbers takes a slow path on CPU: flush, then zero the blocked.
        p = s.sub_(lse_g).clamp_min_(-87.0).exp_().masked_fill_(blocked, 0.0)
        dp = torch.matmul(dog, vg.transpose(-1, -2))
        if dmass_p is not None:
            dlin = _queries(band, dmass_p, c0, c1).contiguous()  # (b·g, h, B, D)
            dp.add_(skew_view(dlin, a, e - a))
        _fold_windows(band, dvp, torch.matmul(p.transpose(-1, -2), dog), c0, c1, (a, e))
        ds = dp.sub_(_queries(band, delta_p.unsqueeze(-1), c0, c1)).mul_(p)  # P ⊙ (dP - D)
        if rel is not None and rel.requires_grad:
            drel = band.to_rows(_unqueries(unskew(ds, a, band.width), b), num_rel)
            if far_grads is not None:
                far = far_grads[:, :, r0 : min(r1, n)]
                drel[:, :, : far.shape[2], far_rows] += far
            push_grad(rel, drel, q_leaf if needs_q else None, dqp[:, :, r0:r1], sink)
        elif const_rel is not None and const_rel.requires_grad:
            part = torch.nn.functional.pad(ds.sum(0), (a, band.keys - e))
            ds_total = part if ds_total is None else ds_total.add_(part)
        dqp[:, :, r0:r1] += _unqueries(torch.matmul(ds, kg), b).mul_(scale)
        dkg = torch.matmul(ds.transpose(-1, -2), qg).mul_(scale)
        _fold_windows(band, dkp, dkg, c0, c1, (a, e))
    if ds_total is not None:  # (h, B, J) → (1, h, 1, D) → (1, h, 1, R)
        drel_lin = unskew(ds_total, 0, band.width).sum(1, keepdim=True).unsqueeze(0)
        drel = band.to_rows(drel_lin, num_rel)
        if far_grads is not None:
            drel[..., far_rows] += far_grads.sum((0, 2), keepdim=True)
        push_grad(const_rel, drel, None, None, sink)
    if dqp is not dq:
        dq += dqp[:, :, :n]
    dk += dkp[:, :, band.left : band.left + n]
    dv += dvp[:, :, band.left : band.left + n]
