"""A narrow band of a relative scheme's self-attention, computed in distance coordinates.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``d`` head dim, ``R`` rows of a relative
table; ``D`` distances in the band, ``B`` queries in one block, ``J = B + D - 1`` keys of its
window, ``N`` the blocks of a chunk of (batch, head) rows (one batched GEMM).

:mod:`.band` runs each block's softmax on its whole ``(B, J)`` window tile. For a
narrow band — Shaw's ``2k + 1`` distances, T5's exact buckets — most of that tile lies outside the
band (with ``B = 64`` and ``D = 16``, 80 % of it), and the per-group copies of queries, windows
and outputs cost more than the band's own products. This engine keeps the tile only for the
GEMMs and does everything else on the ``D`` entries each query has, ``(b, h, i, D)``:

1. The queries of every block of a chunk of rows are a view ``(N, B, d)`` of (a padded copy of)
   ``q``. The chunk's keys and values are copied into a flat buffer where each (batch, head) row
   takes ``n_pad`` rows; window ``(r, c)`` starts at buffer row ``r·n_pad + c·B``, so every window
   of the chunk is one strided view ``(N, J, d)``. A window's keys before position 0 or past
   ``n`` are the neighbouring row's keys or zero margins — finite, and always masked.
2. ``tile = q·kᵀ`` per block, ``(N, B, J)``; the logits in distance coordinates are its diagonals
   ``tile[i, i + t]``, a view with row stride ``J + 1`` (the skew of Huang et al., 2018, read
   backwards without a copy).
3. The softmax runs on ``(b, h, i, D)``: ``logits·scale`` plus the relative term (``q·Eᵀ`` over
   the ``D`` distances, or T5's row broadcast), ``-inf`` for keys outside ``[0, n)`` in the few
   edge rows. Its probabilities are directly the value term's mass per distance.
4. The probabilities go back into the zeroed tile through the same diagonal view, and
   ``tile·v_window`` gives the output.

The backward pass mirrors it: ``dS`` in distance coordinates is the relative term's gradient
(``dq += dS·E``, ``dE += dSᵀ·q``); ``dq``, ``dk``, ``dv`` come from GEMMs with ``dS`` and ``P``
back in tile form, the windows' gradients folded into the flat buffer in ``B``-key chunks (windows
overlap; chunks at one offset do not).

Memory: ``O(rows·n·J)`` per chunk, with rows chosen to keep that under :data:`CHUNK_ELEMENTS`,
plus the chunk's padded copies of ``q``, ``k``, ``v`` (and ``dO`` and the gradients backward),
all in per-thread scratch buffers kept between calls (:class:`.memo.Scratch`). Nothing of size
``(i, j)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..memo import Scratch
from .geometry import BAND_MASKS, Band, diagonal_view
from .job import BandBackward, Job
from .kernels import flush_exp_
from .relative import RelativeTerm, finish_relative_grads

__all__ = [
    "CHUNK_ELEMENTS",
    "NARROW_BLOCK",
    "NARROW_RATIO",
    "NARROW_WIDTH",
    "backward",
    "forward",
    "is_narrow",
]

#: Bands of at most this many distances take this engine, both passes; the tile engine wins on
#: wider ones (the crossover is measured in ``docs/performance.md``).
NARROW_WIDTH = 256
#: ... and the sequence at least this many times longer than the band: in a shorter one, the
#: first blocks' windows reach far before position 0, work the tile engine trims.
NARROW_RATIO = 4
#: Queries per block: a block's GEMM computes ``B + D - 1`` keys for ``D`` useful ones.
NARROW_BLOCK = 32
#: Elements of one chunk's ``(N, B, J)`` tile (4 MiB in float32).
CHUNK_ELEMENTS = 1 << 20
#: Bytes of temporaries each thread keeps between calls.
SCRATCH_BYTES = 64 << 20


#: Per-thread buffers for the engine's temporaries (a library cannot assume
#: :func:`relpos.runtime.retain_freed_memory`).
_SCRATCH = Scratch(SCRATCH_BYTES)


def is_narrow(width: int, n: int) -> bool:
    """Whether a band of ``width`` distances over ``n`` tokens runs here rather than in the tile
    engine (:data:`NARROW_WIDTH`, :data:`NARROW_RATIO`)."""
    return width <= NARROW_WIDTH and NARROW_RATIO * width <= n


# ------------------------------------------------------------------------------------ layout
def _rows(x: Tensor, n_pad: int, name: str) -> Tensor:
    """``(b, h, n, d)`` → contiguous ``(b, h, n_pad, d)``, zero rows past ``n`` (``x`` itself when
    it already is; else a copy in scratch buffer ``name``)."""
    b, h, n, d = x.shape
    if n == n_pad and x.is_contiguous():
        return x
    out = _SCRATCH.take(name, (b, h, n_pad, d), x)
    out[:, :, :n].copy_(x)
    out[:, :, n:].zero_()
    return out


def _flat(band: Band, x: Tensor, name: str) -> Tensor:
    """``(bc, hc, n, d)`` → the flat key buffer ``(left + bc·hc·n_pad + right, d)`` (see the module
    docstring) in scratch buffer ``name``: row ``r``'s keys at buffer rows ``left + r·n_pad …``,
    zeros after its ``n``-th and in the margins."""
    b, h, n, d = x.shape
    n_pad, left = band.num_blocks * band.block, band.left
    right = band.keys - band.block - left
    buf = _SCRATCH.take(name, (left + b * h * n_pad + right, d), x)
    buf[:left].zero_()
    buf[left + b * h * n_pad :].zero_()
    body = buf[left : left + b * h * n_pad].view(b, h, n_pad, d)
    body[:, :, :n].copy_(x)
    body[:, :, n:].zero_()
    return buf


def _windows(band: Band, flat: Tensor) -> Tensor:
    """The ``(N, J, d)`` windows of every row of a flat buffer, one strided view: window
    ``(r, c)`` starts at buffer row ``r·n_pad + c·B``."""
    n_pad, d = band.num_blocks * band.block, flat.shape[-1]
    rows = (flat.shape[0] - band.keys + band.block) // n_pad
    shape = (rows * band.num_blocks, band.keys, d)
    return flat.as_strided(shape, (band.block * d, d, 1), flat.storage_offset())


def _fold(band: Band, flat: Tensor, dwin: Tensor, alpha: float = 1.0) -> None:
    """The adjoint of :func:`_windows`: ``flat += dwin`` window by window. Windows overlap; their
    ``B``-key chunks at one offset do not, so each offset is one strided add."""
    d, bl = flat.shape[-1], band.block
    for o in range(0, band.keys, bl):
        w = min(bl, band.keys - o)
        view = flat.as_strided((dwin.shape[0], w, d), (bl * d, d, 1), flat.storage_offset() + o * d)
        view.add_(dwin[:, o : o + w], alpha=alpha)


def _unflat(band: Band, flat: Tensor, like: Tensor) -> Tensor:
    """The ``like``-shaped ``(bc, hc, n, d)`` keys part of a flat buffer (a view)."""
    b, h, n, d = like.shape
    n_pad = band.num_blocks * band.block
    return flat[band.left : band.left + b * h * n_pad].view(b, h, n_pad, d)[:, :, :n]


def _chunks(band: Band, b: int, h: int) -> list[tuple[int, int, int, int]]:
    """``[(b0, b1, h0, h1)]``: whole batch rows when a row of ``h`` heads fits the budget, else
    head ranges of one batch row — either way a contiguous range of the flat buffers' rows."""
    per_row = band.num_blocks * band.block * band.keys
    rows = max(1, CHUNK_ELEMENTS // per_row)
    if rows >= h:
        step = rows // h
        return [(b0, min(b0 + step, b), 0, h) for b0 in range(0, b, step)]
    return [(b0, b0 + 1, h0, min(h0 + rows, h)) for b0 in range(b) for h0 in range(0, h, rows)]


def _edge_rows(band: Band) -> tuple[int, int]:
    """``(head, tail)``: only query rows ``[0, head)`` and ``[tail, n)`` have band keys outside
    ``[0, n)`` (before position 0, past the last token)."""
    head = min(band.left, band.n)
    return head, max(head, band.n - (band.hi - 1))


def _edge_masks(band: Band, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(head blocked (head, D), tail blocked (n - tail, D))``: the pairs of those rows whose key
    lies outside ``[0, n)``. Kept in the band masks' cache (:data:`.band.BAND_MASKS`): they
    depend on geometry only."""

    def build() -> tuple[Tensor, Tensor]:
        head, tail = _edge_rows(band)
        rows = torch.arange(band.n, device=device).view(-1, 1)
        keys = rows + torch.arange(band.width, device=device) + band.lo + 1
        blocked = (keys < 0) | (keys >= band.n)
        return blocked[:head].clone(), blocked[tail:].clone()

    return BAND_MASKS.get_or_build(("distance edges", band.n, band.lo, band.hi, str(device)), build)


def _mask_edges(band: Band, x: Tensor, value: float) -> None:
    """Fill the pairs of ``x (.., n_pad, D)`` whose key is outside ``[0, n)`` with ``value``."""
    (head, tail), (head_blocked, tail_blocked) = _edge_rows(band), _edge_masks(band, x.device)
    if head:
        x[..., :head, :].masked_fill_(head_blocked, value)
    if tail < band.n:
        x[..., tail : band.n, :].masked_fill_(tail_blocked, value)


def _logits(
    band: Band, tile: Tensor, shape: tuple[int, int], scale: float, term: Tensor | None
) -> Tensor:
    """``(bc, hc, n_pad, D)``: the tile's diagonals times ``scale`` plus the relative ``term``
    (``(bc, hc, n_pad, D)``, overwritten, or ``(1|bc, hc, 1, D)`` broadcast), edges ``-inf``."""
    bc, hc = shape
    nb, bl, dd = band.num_blocks, band.block, band.width
    diag = diagonal_view(tile, dd).view(bc, hc, nb, bl, dd)
    if term is not None and term.shape[-2] != 1:  # q·Eᵀ (in scratch "s"): in place
        s = term.view(bc, hc, nb, bl, dd).add_(diag, alpha=scale)
    else:
        s = _SCRATCH.take("s", (bc, hc, nb, bl, dd), tile)
        if term is None:
            torch.mul(diag, scale, out=s)
        else:  # T5: one row per head, every query
            torch.add(term.unsqueeze(2), diag, alpha=scale, out=s)
    s = s.view(bc, hc, nb * bl, dd)
    _mask_edges(band, s, -math.inf)
    return s


def _tile_from(tile: Tensor, lin: Tensor, band: Band) -> Tensor:
    """Write ``lin (bc, hc, n_pad, D)`` into ``tile (N, B, J)`` along its diagonals, zero
    elsewhere; returns ``tile``."""
    tile.zero_()
    nb, bl, dd = band.num_blocks, band.block, band.width
    diagonal_view(tile, dd).copy_(lin.reshape(-1, nb, bl, dd).flatten(0, 1))
    return tile


def _exp(s: Tensor, band: Band) -> Tensor:
    """``exp(s)`` in place for ``s <= 0``: flushed at -87 (CPU ``exp`` is slow on very negative
    inputs), then exactly 0 at the masked edge pairs."""
    p = flush_exp_(s)
    _mask_edges(band, p, 0.0)
    return p


def _tile(band: Band, rows: Tensor, flat: Tensor, name: str) -> Tensor:
    """``(N, B, J)``: every block of ``rows (bc, hc, n_pad, d)`` times its key window of the flat
    buffer, ``rows·windowᵀ``, in scratch buffer ``name``."""
    blocks = rows.view(-1, band.block, rows.shape[-1])
    out = _SCRATCH.take(name, (blocks.shape[0], band.block, band.keys), rows)
    return torch.bmm(blocks, _windows(band, flat).transpose(1, 2), out=out)


def _term(setup: RelativeTerm, qc: Tensor, b0: int, b1: int, h0: int, h1: int) -> Tensor | None:
    """The chunk's relative term in distance coordinates; ``q·Eᵀ`` in scratch buffer ``"s"``."""
    if setup.keys is None:
        return setup.term(qc, b0, b1, h0, h1)
    out = _SCRATCH.take("s", (*qc.shape[:-1], setup.keys.shape[-2]), qc)
    return setup.term(qc, b0, b1, h0, h1, out=out)


def _unfold(band: Band, dwin: Tensor, like: Tensor, name: str, alpha: float = 1.0) -> Tensor:
    """The ``like``-shaped ``(bc, hc, n, d)`` gradient of the keys from their windows' gradients
    ``dwin (N, J, d)`` (:func:`_fold` into a zeroed flat buffer ``name``; a view of it)."""
    b, h, _, d = like.shape
    n_pad = band.num_blocks * band.block
    flat = _SCRATCH.take(name, (band.keys - band.block + b * h * n_pad, d), like).zero_()
    _fold(band, flat, dwin, alpha)
    return _unflat(band, flat, like)


# ------------------------------------------------------------------------------------ forward
def forward(job: Job, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
    """The band's attention in distance coordinates (:meth:`.job.BandEngine.forward`)."""
    band, scale = job.band, job.scale
    b, h, n, d = q.shape
    n_pad, bl = band.num_blocks * band.block, band.block
    setup = RelativeTerm(job, q, grads=False)
    lse = q.new_empty(b, h, n_pad)
    out = q.new_empty(b, h, n_pad, d)
    mass = q.new_zeros(b, h, n_pad, job.num_rel) if job.rel_value else None
    for b0, b1, h0, h1 in _chunks(band, b, h):
        rows = (slice(b0, b1), slice(h0, h1))  # contiguous in every (b, h, ..) tensor
        qc = _rows(q[rows], n_pad, "q")
        tile = _tile(band, qc, _flat(band, k[rows], "k"), "tile")
        s = _logits(band, tile, (b1 - b0, h1 - h0), scale, _term(setup, qc, b0, b1, h0, h1))
        m = s.amax(-1, keepdim=True)  # finite: a real query's own key is in the band
        p = _exp(s.sub_(m), band)
        norm = p.sum(-1, keepdim=True)
        p.div_(norm)
        lse[rows] = m.add_(norm.log_()).squeeze(-1)
        ptile = _tile_from(tile, p, band)
        vw = _windows(band, _flat(band, v[rows], "v"))
        torch.bmm(ptile, vw, out=out[rows].view(-1, bl, d))
        if mass is not None:
            band.add_rows(mass[rows], p, 0, band.width)
    result = {"lse": lse[:, :, :n], "out": out[:, :, :n]}
    if mass is not None:
        result["mass"] = mass[:, :, :n]
    if setup.cols is not None:
        result["cols"] = setup.cols
    return result


# ------------------------------------------------------------------------------------ backward
def backward(job: Job, q: Tensor, k: Tensor, v: Tensor, grad: BandBackward) -> None:
    """The band's gradients, recomputed in distance coordinates from the final log-sum-exp
    (:meth:`.job.BandEngine.backward`)."""
    band, scale, needs_q = job.band, job.scale, grad.needs_q
    do, lse, delta, dmass = grad.do, grad.lse, grad.delta, grad.dmass
    dq, dk, dv = grad.grads
    b, h, n, d = q.shape
    n_pad, bl, dd = band.num_blocks * band.block, band.block, band.width
    setup = RelativeTerm(job, q, grads=True)
    lse_p = F.pad(lse, (0, n_pad - n), value=math.inf).unsqueeze(-1)
    delta_p = F.pad(delta, (0, n_pad - n)).unsqueeze(-1)
    dmass_lin = None if dmass is None else band.to_distance(dmass)  # (b, h, n, D)
    dq_direct = n_pad == n and dq.is_contiguous()  # whole blocks: add into dq in place
    for b0, b1, h0, h1 in _chunks(band, b, h):
        rows = (slice(b0, b1), slice(h0, h1))  # contiguous in every (b, h, ..) tensor
        qc, doc = _rows(q[rows], n_pad, "q"), _rows(do[rows], n_pad, "do")
        qb, dob = qc.view(-1, bl, d), doc.view(-1, bl, d)
        kf, vf = _flat(band, k[rows], "k"), _flat(band, v[rows], "v")
        kw = _windows(band, kf)
        tile = _tile(band, qc, kf, "tile")
        s = _logits(band, tile, (b1 - b0, h1 - h0), scale, _term(setup, qc, b0, b1, h0, h1))
        # Padding rows (lse = +inf) get exp(-87), not 0; their dO and D are 0, so they add nothing.
        p = _exp(s.sub_(lse_p[rows]), band)
        dp_tile = _tile(band, doc, vf, "dp_tile")
        blocks = (b1 - b0, h1 - h0, band.num_blocks, bl)
        dp = diagonal_view(dp_tile, dd).view(*blocks, dd)
        ds = _SCRATCH.take("ds", (*blocks, dd), q)
        torch.sub(dp, delta_p[rows].view(*blocks, 1), out=ds)
        ds = ds.flatten(2, 3)  # (bc, hc, n_pad, D)
        if dmass_lin is not None:
            ds[:, :, :n] += dmass_lin[rows]
        ds.mul_(p)  # dS = P ⊙ (dP - D)
        dwin = _SCRATCH.take("dwin", (qb.shape[0], band.keys, d), q)
        torch.bmm(_tile_from(tile, p, band).transpose(1, 2), dob, out=dwin)
        dv[rows] += _unfold(band, dwin, v[rows], "dv")
        ds_tile = _tile_from(dp_tile, ds, band)
        if dq_direct:
            dqc = dq[rows]
        else:
            dqc = _SCRATCH.take("dq", (b1 - b0, h1 - h0, n_pad, d), q).zero_()
        dqc.view(-1, bl, d).baddbmm_(ds_tile, kw, alpha=scale)
        setup.add_grads(ds, qc, dqc, h0, h1, needs_q)
        if not dq_direct:
            dq[rows] += dqc[:, :, :n]
        torch.bmm(ds_tile.transpose(1, 2), qb, out=dwin)
        dk[rows] += _unfold(band, dwin, k[rows], "dk", alpha=scale)
    finish_relative_grads(setup, job, q, grad)
