"""The band of a relative scheme's self-attention, for the ``chunked`` backend's region path.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table; ``B`` queries in one block, ``J`` its keys, ``D`` distances in the band.

Over contiguous positions, a relative scheme's logit term depends on the query only through the
distance ``δ = j - i``, and beyond a band ``lo < δ < hi`` it is a per-query constant (clipping). The
far parts go to the fused kernel elsewhere (:mod:`.region`); this module computes
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
most :data:`.narrow.NARROW_WIDTH` distances runs in
:mod:`.narrow` instead, with the same contract; :class:`RelativeTerm` and
:func:`finish_relative_grads` are the parts both engines share.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .geometry import Band, diagonal_view, diagonals, skew_view, unskew
from .job import BandBackward, Job
from .kernels import flash, flush_exp_
from .relative import RelativeTerm, finish_relative_grads, keys_grad

__all__ = ["backward", "forward", "probs_and_dscores"]


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


class _ConstMasks:
    """The float masks of a query-independent logit term (T5), for one call's groups.

    Every block sees the same term, and every block of a group inside the sequence also sees the
    same band mask: such groups share one ``(1, h, B, J)`` mask, built once per call, which the
    fused kernel and the backward pass's add broadcast over the group's blocks. A term that
    differs per batch row (``(b, h, 1, R)``) cannot broadcast over the ``b·g`` kernel batch
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
    ``-inf`` — interior groups write the same columns, so in steady state nothing is filled.
    Its row stride stays the full width, which :func:`skew_view` allows.
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
    band: Band,
    c0: int,
    c1: int,
    qg: Tensor,
    keys: Tensor,
    cols: tuple[int, int],
    row_bias: Tensor | None = None,
) -> Tensor:
    """A ``q·Eᵀ`` logit term (Shaw, Music Transformer; plus ``row_bias (h|1, D)``, a constant
    per distance: Transformer-XL) for one group, in :func:`diagonals` layout:
    ``(b·g, h, B, e - a + B - 1)``, ``-inf`` in the columns outside the band.

    Only the distances the tile reaches are multiplied (the first blocks of a wide band reach
    fewer), straight into the buffer; its skewed view (offset ``B - 1``) is then the tile's float
    mask with the band already applied — no copy, no ``0/-inf`` add.
    """
    t0, t_lo, t_hi = _distance_range(band, cols)
    key = (qg.shape[:-1], qg.dtype, qg.device)
    scratch = band.logit_buffers.get(key)
    if scratch is None:
        scratch = band.logit_buffers[key] = _LogitScratch(
            qg.new_empty((*qg.shape[:-1], band.keys + band.block - 1))
        )
    buf = scratch.take(t_lo - t0, t_hi - t0, cols[1] - cols[0] + band.block - 1)
    dst, keys_t = buf[..., t_lo - t0 : t_hi - t0], keys[..., t_lo:t_hi, :].transpose(-1, -2)
    if qg.shape[0] == 1:  # few large products (a wide band): straight into the strided buffer
        torch.matmul(qg, keys_t, out=dst)
    else:  # many small ones: a strided `out=` would run them one by one
        dst.copy_(torch.matmul(qg, keys_t))
    if row_bias is not None:
        dst.add_(row_bias[:, None, t_lo:t_hi])
    return buf


def _tile_mask(
    band: Band,
    c0: int,
    c1: int,
    cols: tuple[int, int],
    neg: Tensor,
    qg: Tensor,
    term: RelativeTerm,
    const: _ConstMasks | None,
) -> Tensor:
    """The group's float mask ``(b·g | 1, h|1, B, e - a)``: logit term plus ``-inf`` where
    blocked."""
    a, e = cols
    b = qg.shape[0] // (c1 - c0)
    if term.keys is not None:
        logits = _keyed_logits(band, c0, c1, qg, term.keys, cols, term.row_bias)
        mask = skew_view(logits, band.block - 1, e - a)
        return mask if band.exact(c0, c1) else mask + neg
    if const is not None:
        return const.mask(c0, c1, cols, neg, b)
    return neg


def forward(job: Job, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
    """The band's attention, one fused-kernel call per group of query blocks
    (:meth:`.job.BandEngine.forward`)."""
    band, scale = job.band, job.scale
    b, h, n, _ = q.shape
    n_pad = band.num_blocks * band.block
    qp = _padded_queries(band, q)
    lse = q.new_empty(b, h, n_pad)
    out = q.new_empty(b, h, n_pad, q.shape[-1])
    mass = q.new_zeros(b, h, n_pad, job.num_rel) if job.rel_value else None
    term = RelativeTerm(job, q, grads=False)
    cols = term.cols
    const = None if term.lin is None else _ConstMasks(band, term.lin, b)
    for c0, c1 in band.groups(b, h):
        r0, r1 = c0 * band.block, c1 * band.block
        g, qg = c1 - c0, _queries(band, qp, c0, c1)
        a, e = band.trim(c0, c1)
        kg, vg = _windows(band, k, c0, c1, (a, e)), _windows(band, v, c0, c1, (a, e))
        blocked, neg = (x[..., a:e] for x in band.mask(c0, c1, q, b))
        mask = _tile_mask(band, c0, c1, (a, e), neg, qg, term, const)
        out_g, lse_g = _as_groups(out[:, :, r0:r1], g), _as_groups(lse[:, :, r0:r1], g)
        if mass is None:
            o, l_ = flash(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scale)
            out_g.copy_(o.unflatten(0, (b, g)))
            lse_g.copy_(l_.unflatten(0, (b, g)))
            continue
        # A value term needs the probabilities themselves (the mass per relative row), which the
        # fused kernel does not return: the blocks' softmax in plain ops.
        s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale).add_(mask)
        m = s.amax(-1, keepdim=True)  # finite: every real query's own key is in the band
        p = flush_exp_(s.sub_(m)).masked_fill_(blocked, 0.0)
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
    delta ``(n, h, B, 1)``.
    """
    p = flush_exp_(s.mul_(scale).add_(mask).sub_(lse)).masked_fill_(blocked, 0.0)
    return p, dp.sub_(delta).mul_(p)


def backward(job: Job, q: Tensor, k: Tensor, v: Tensor, grad: BandBackward) -> None:
    """The band's gradients, recomputed per group of query blocks from the final log-sum-exp
    (:meth:`.job.BandEngine.backward`)."""
    band, scale, needs_q = job.band, job.scale, grad.needs_q
    do, lse, delta, dmass = grad.do, grad.lse, grad.delta, grad.dmass
    dq, dk, dv = grad.grads
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
    term = RelativeTerm(job, q, grads=True)
    keys, dkeys, ds_total = term.keys, term.dkeys, None
    const = None if term.lin is None else _ConstMasks(band, term.lin, b)
    for c0, c1 in band.groups(b, h):
        r0, r1 = c0 * band.block, c1 * band.block
        g, qg, dog = c1 - c0, _queries(band, qp, c0, c1), _queries(band, dop, c0, c1)
        a, e = band.trim(c0, c1)
        kg, vg = _windows(band, k, c0, c1, (a, e)), _windows(band, v, c0, c1, (a, e))
        blocked, neg = (x[..., a:e] for x in band.mask(c0, c1, q, b))
        mask = _tile_mask(band, c0, c1, (a, e), neg, qg, term, const)
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
        if keys is not None and (needs_q or dkeys is not None or term.drow_bias is not None):
            drel, t_lo, t_hi = _distances(band, ds, (a, e))  # (b·g, h, B, t_hi - t_lo)
            term.add_row_bias_grads(drel, 0, h, t_lo)
            if needs_q:
                dq_rel = torch.matmul(drel, keys[..., t_lo:t_hi, :])
                _as_groups(dqp[:, :, r0:r1], g).add_(dq_rel.unflatten(0, (b, g)))
            if dkeys is not None:
                dkeys[:, t_lo:t_hi] += keys_grad(drel, qg)
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
    finish_relative_grads(term, job, q, grad)
