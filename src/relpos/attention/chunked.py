"""The ``chunked`` backend: query blocks × key blocks with a streaming softmax; O(block·L) memory.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table; ``bi``/``bj`` the sizes of one query/key block (a *tile*).

**General path** (any :class:`~relpos.Positions`: padding, packing, KV cache; any scheme).
Attention is computed one tile at a time with the online softmax of Milakov & Gimelshein (2018)
and FlashAttention (Dao et al., 2022; Dao, 2023): each tile's logits ``q·kᵀ/√d + bias`` fold into a
running row maximum, normaliser and output, so nothing of size ``(i, j)`` is ever held. Tiles the
mask rules out entirely (future keys, other documents, padding) are skipped from ``O(i + j)`` block
summaries; tiles it allows entirely skip the masking ops. The backward pass is a custom
:class:`torch.autograd.Function` that recomputes each tile from the saved row log-sum-exp
(FlashAttention-2): ``dS = P ⊙ (dP - rowsum(dO ⊙ O))``.

Scheme terms enter a tile in one of two ways:

* *relative form* (T5, Shaw, Music Transformer: schemes with ``relative_logits``/``relative_index``
  and, for a value term, ``relative_value``): the logit term is ``rel[b, h, i, r]`` of shape
  ``(b, h, bi, R)`` per query block, gathered per tile by the relative index; its gradient is
  scattered back into ``(b, h, bi, R)`` and pushed through ``relative_logits`` once per query block.
  Shaw's value term accumulates the attention mass per relative row ``(b, h, bi, R)`` with the same
  rescaling as ``p·v`` and is multiplied by the table once per block;
* otherwise the scheme's own ``score_bias``/``value_term`` on the tile's sliced positions, with
  gradients by ``torch.autograd.grad`` per tile (every scheme, every hook).

**Region path** (CPU, self-attention over contiguous positions, the training case; no dropout).
The work is split into parts, each computed by PyTorch's fused CPU flash-attention kernel where
no per-pair gradient is needed, and merged by log-sum-exp — the trick of blockwise/ring attention
(Liu et al., 2023):

* relative schemes clip distances (Shaw's ``k``, T5's last bucket, the Music Transformer's ``M``),
  so beyond a band ``-W_L < j - i < W_R`` the logit term is a per-query constant
  ``rel[i, r_far]`` and the value term a constant vector. Keys ``j <= i - W_L`` are one fused call
  on shifted slices (``is_causal=True`` on ``q[W_L:]``, ``k[:L-W_L]``), keys ``j >= i + W_R`` one on
  flipped slices. The band runs in distance coordinates when it is narrow
  (:func:`~relpos.attention.narrow.is_narrow`; :mod:`relpos.attention.narrow`: Shaw, T5), else
  on tiles (:mod:`relpos.attention.band`: the fused kernel with the skewed relative
  term as a float mask forward, recomputed tiles backward). The band needs the logit term
  as ``q·Eᵀ`` (``relative_keys``: Shaw, Music Transformer) or independent of ``q`` (T5); other
  relative schemes take the general path. The constants' gradients
  follow from the parts' outputs: ``Σ_far dS_ij = w_far,i (dO_i·(O_far,i + a_far) - D_i)``;
* ALiBi (fixed slopes, no gradient) splits each query block's keys into left, diagonal and right
  parts whose bias is a per-key vector plus a per-query constant (``slope·(j - i) = slope·(j - i0)
  - slope·(i - i0)``), so the fused kernel takes a row-broadcast ``(1, h, 1, j)`` mask, and steep
  heads skip keys whose probability is exactly 0 (:mod:`relpos.attention.alibi_parts`);
* schemes with no bias and no value term call the fused kernel directly.

Dropout (training) runs on the general path: each tile's keep-mask is drawn in a fixed order and
the backward pass replays the random number generator.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional.dtypes import compute_dtype
from ..positions import PAD_SEGMENT, Positions
from ..schemes.base import Scheme
from .band import Band, band_backward, band_forward, query_independent, supports
from .grads import GradSink, push_grad
from .narrow import NARROW_BLOCK, is_narrow, narrow_backward, narrow_forward
from .sdpa import validate_attention_inputs

__all__ = [
    "DEFAULT_BLOCK",
    "TilePlan",
    "chunked_attention",
    "chunked_path",
    "plan_tiles",
]

#: Default (query, key) tile sizes of the general path (tuned on a 2-core CPU, fp32, h=8, d=64).
DEFAULT_BLOCK = (256, 512)
#: Query block of the region path's band.
_BAND_BLOCK = 128
_MIN_BAND_BLOCK = 64

#: Smallest far region (in distances) the region path hands to the fused kernel.
_MIN_FAR = 16


# ----------------------------------------------------------------------------------- tile plans
@dataclass(frozen=True)
class TilePlan:
    """The tiles to compute.

    Attributes:
        q_blocks: ``[(i0, i1), …]`` query block bounds.
        tiles: per query block, ``[(j0, j1, masked), …]`` key tiles that have at least one pair
            that may attend; ``masked`` is False when every pair of the tile may attend.
    """

    q_blocks: list[tuple[int, int]]
    tiles: list[list[tuple[int, int, bool]]]

    def max_tile(self) -> int:
        """The largest ``bi·bj`` of a computed tile (the ``O(block²)`` memory bound)."""
        return max(
            (
                (i1 - i0) * (j1 - j0)
                for (i0, i1), ts in zip(self.q_blocks, self.tiles, strict=True)
                for j0, j1, _ in ts
            ),
            default=0,
        )


def _bounds(lo: int, hi: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, hi)) for s in range(lo, hi, block)]


def _summaries(p: Positions, block: int) -> dict[str, Tensor]:
    """Per-row, per-block ``(b, nblocks)`` summaries of the real tokens' positions and segments."""
    b, n = p.pos.shape
    nb = -(-n // block)
    pad = nb * block - n
    valid = p.seg != PAD_SEGMENT
    big = torch.iinfo(torch.int64).max

    def pooled(x: Tensor, fill: int, lowest: bool) -> Tensor:
        x = F.pad(x, (0, pad), value=fill).view(b, nb, block)
        return x.amin(-1) if lowest else x.amax(-1)

    seg_lo = pooled(torch.where(valid, p.seg, big), big, True)
    all_valid = F.pad(valid, (0, pad), value=True).view(b, nb, block).all(-1)
    seg_hi = pooled(torch.where(valid, p.seg, -1), -1, False)
    return {
        "seg_lo": seg_lo,
        "seg_hi": seg_hi,
        "pos_lo": pooled(torch.where(valid, p.pos, big), big, True),
        "pos_hi": pooled(torch.where(valid, p.pos, -big), -big, False),
        "uniform": all_valid & (seg_lo == seg_hi),  # every token real, one segment
    }


def plan_tiles(
    q_positions: Positions, k_positions: Positions, *, causal: bool, q_block: int, k_block: int
) -> TilePlan:
    """Classify every ``(query block, key block)`` tile from ``O(i + j)`` block summaries.

    A tile is skipped when, in every row, its blocks share no segment of real tokens or (causal)
    every key is after every query; it is unmasked when, in every row, both blocks are real tokens
    of one and the same segment and (causal) no key is after any query; otherwise masked.
    """
    qs = {k: t.unsqueeze(-1) for k, t in _summaries(q_positions, q_block).items()}  # (b, nq, 1)
    ks = {k: t.unsqueeze(-2) for k, t in _summaries(k_positions, k_block).items()}  # (b, 1, nk)
    skip = (qs["seg_hi"] < 0) | (ks["seg_hi"] < 0)
    skip = skip | (qs["seg_hi"] < ks["seg_lo"]) | (ks["seg_hi"] < qs["seg_lo"])
    free = qs["uniform"] & ks["uniform"] & (qs["seg_lo"] == ks["seg_lo"])
    if causal:
        skip = skip | (ks["pos_lo"] > qs["pos_hi"])
        free = free & (ks["pos_hi"] <= qs["pos_lo"])
    skip_l, free_l = skip.all(0).tolist(), free.all(0).tolist()
    q_blocks = _bounds(0, len(q_positions), q_block)
    k_blocks = _bounds(0, len(k_positions), k_block)
    tiles = [
        [(j0, j1, not free_l[a][c]) for c, (j0, j1) in enumerate(k_blocks) if not skip_l[a][c]]
        for a in range(len(q_blocks))
    ]
    return TilePlan(q_blocks, tiles)


# ----------------------------------------------------------------------------------- scheme terms
@dataclass
class _Job:
    """Everything the tile engine needs besides q, k, v."""

    scheme: Scheme
    q_positions: Positions
    k_positions: Positions
    causal: bool
    plan: TilePlan
    scale: float
    dropout_p: float = 0.0
    #: Region path: relative rows whose per-query logit term the forward pass reports.
    far_rows: list[int] = field(default_factory=list)
    #: Region path: ``(W_L, r_L, W_R, r_R)`` (see :func:`_far_widths`).
    far: tuple[int, int, int, int] | None = None
    params: list[Tensor] = field(default_factory=list)
    #: Region path: the band's geometry, and whether it runs in distance coordinates
    #: (:mod:`relpos.attention.narrow`) rather than on tiles (:mod:`relpos.attention.band`).
    band_geom: Band | None = None
    narrow: bool = False

    def __post_init__(self) -> None:
        hooks, s = self.scheme.hooks, self.scheme
        self.has_bias = "score_bias" in hooks
        self.has_value = "value_term" in hooks
        rel = hasattr(s, "relative_index") and hasattr(s, "num_relative")
        self.rel_bias = self.has_bias and rel and hasattr(s, "relative_logits")
        self.rel_value = self.has_value and rel and hasattr(s, "relative_value")
        self.num_rel = int(s.num_relative) if (self.rel_bias or self.rel_value) else 0

    def tile_mask(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """``(b|1, 1, bi, bj)`` bool: the pairs of a masked tile that may attend."""
        qp, kp = self.q_positions[i0:i1], self.k_positions[j0:j1]
        return qp.allowed(kp, causal=self.causal).unsqueeze(1)


def _gather_rel(rel: Tensor, index: Tensor) -> Tensor:
    """``out[.., i, j] = rel[.., i, index[.., i, j]]`` → ``(B, h, bi, bj)``, ``B = max`` batch."""
    bb = max(rel.shape[0], index.shape[0])
    h, bi = rel.shape[1], index.shape[-2]
    idx = index.unsqueeze(1).expand(bb, h, bi, index.shape[-1])
    return torch.gather(rel.expand(bb, h, bi, rel.shape[-1]), -1, idx)


def _scatter_rel(out: Tensor, index: Tensor, src: Tensor) -> None:
    """``out[.., i, index[.., i, j]] += src[.., i, j]`` with ``out (b, h, bi, R)``."""
    idx = index.unsqueeze(1).expand(src.shape)
    out.scatter_add_(-1, idx, src)


def _sum_to(x: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``x`` over the dimensions where ``shape`` broadcasts (size 1)."""
    dims = [t for t, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1]
    return x.sum(dims, keepdim=True) if dims else x


def _exp(x: Tensor) -> Tensor:
    """``exp(x)`` for ``x <= 0``, in place, flushing ``x < -87`` to ``exp(-87) ≈ 1.6e-38``.

    CPU ``exp`` takes a slow path (about 10× slower) for large negative inputs and denormal
    results; every caller multiplies masked entries by 0 afterwards and a row's largest entry
    is 1, so the flush changes no result.
    """
    return x.clamp_min_(-87.0).exp_()


def _keep_mask(p: Tensor, dropout_p: float) -> Tensor:
    return (torch.rand(p.shape, device=p.device) >= dropout_p).to(p.dtype) / (1.0 - dropout_p)


# ----------------------------------------------------------------------------------- tile engine
def _tile_terms(
    job: _Job, i0: int, i1: int, j0: int, j1: int, masked: bool, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """``(blocked (b|1, 1, bi, bj) bool | None, relative index (b|1, bi, bj) | None)``."""
    blocked = ~job.tile_mask(i0, i1, j0, j1, device) if masked else None
    index = None
    if job.rel_bias or job.rel_value:
        qp, kp = job.q_positions[i0:i1], job.k_positions[j0:j1]
        index = job.scheme.relative_index(qp, kp)
    return blocked, index


def _scores(
    job: _Job,
    qb: Tensor,
    kb: Tensor,
    bounds: tuple[int, int, int, int],
    rel: Tensor | None,
    masked: bool,
    bias_leaf: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Scaled, biased, masked logits of one tile, ``(b, h, bi, bj)``.

    Returns ``(s, blocked, index, bias)``; ``bias`` is the scheme's ``score_bias`` with a graph
    (for its gradient) when ``bias_leaf`` is given and the scheme has no relative form.
    """
    i0, i1, j0, j1 = bounds
    blocked, index = _tile_terms(job, i0, i1, j0, j1, masked, qb.device)
    s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(job.scale)
    bias = None
    if rel is not None:
        s.add_(_gather_rel(rel, index))
    elif job.has_bias and not job.rel_bias:
        qp, kp = job.q_positions[i0:i1], job.k_positions[j0:j1]
        if bias_leaf is not None:
            with torch.enable_grad():
                bias = job.scheme.score_bias(bias_leaf, qp, kp)
        else:
            bias = job.scheme.score_bias(qb, qp, kp)
        if bias is not None:
            s.add_(bias.detach().to(s.dtype))
    if blocked is not None:
        s.masked_fill_(blocked, -math.inf)
    return s, blocked, index, bias


def _tiles_forward(job: _Job, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
    """Streaming softmax over the plan's tiles.

    Returns unnormalised row statistics over all queries: ``m (b, h, i)`` running maximum,
    ``norm (b, h, i)`` Σ exp(s - m), ``acc (b, h, i, d)`` Σ exp(s - m)·v, and, for a relative value
    term, ``mass (b, h, i, R)``.
    """
    b, h, n, _ = q.shape
    m = q.new_full((b, h, n), torch.finfo(q.dtype).min)
    norm = q.new_zeros(b, h, n)
    acc = q.new_zeros(b, h, n, v.shape[-1])
    mass = q.new_zeros(b, h, n, job.num_rel) if job.rel_value else None
    s_ = job.scheme
    rel_const = None
    if job.rel_bias and query_independent(s_, q):
        rel_const = s_.relative_logits(q[:, :, :1])  # compute once
    for (i0, i1), tiles in zip(job.plan.q_blocks, job.plan.tiles, strict=True):
        qb = q[:, :, i0:i1]
        qp = job.q_positions[i0:i1]
        rel = (
            rel_const
            if rel_const is not None
            else (s_.relative_logits(qb) if job.rel_bias else None)
        )
        mb, nb, ab = m[:, :, i0:i1], norm[:, :, i0:i1], acc[:, :, i0:i1]
        massb = mass[:, :, i0:i1] if mass is not None else None
        first = True  # the block's first tile: assign instead of rescale-and-add
        for j0, j1, masked in tiles:
            s, blocked, index, _ = _scores(job, qb, k[:, :, j0:j1], (i0, i1, j0, j1), rel, masked)
            if blocked is not None and bool(blocked.all()):
                continue
            m_new = torch.maximum(mb, s.amax(-1))  # finite: mb starts at finfo.min
            p = _exp(s.sub_(m_new.unsqueeze(-1)))
            if blocked is not None:
                p.masked_fill_(blocked, 0.0)
            alpha = None if first else torch.exp(mb - m_new).unsqueeze(-1)
            if first:
                nb.copy_(p.sum(-1))
            else:
                nb.mul_(alpha.squeeze(-1)).add_(p.sum(-1))
            if job.dropout_p > 0:
                p = p * _keep_mask(p, job.dropout_p)
            pv = torch.matmul(p, v[:, :, j0:j1])
            ab.copy_(pv) if first else ab.mul_(alpha).add_(pv)
            if job.rel_value:
                if not first:
                    massb.mul_(alpha)
                _scatter_rel(massb, index, p)
            elif job.has_value:
                term = s_.value_term(p, qp, job.k_positions[j0:j1])
                if term is not None:
                    ab.add_(term.to(ab.dtype))
            mb.copy_(m_new)
            first = False
    out = {"m": m, "norm": norm, "acc": acc}
    if mass is not None:
        out["mass"] = mass
    return out


def _tiles_backward(
    job: _Job,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    lse: Tensor,
    delta: Tensor,
    dmass: Tensor | None,
    needs_q: bool,
    sink: GradSink,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute every tile from the final ``lse`` and return ``dq, dk, dv``; the scheme's
    parameter gradients go into ``sink``.

    ``delta (b, h, i)`` is ``rowsum(dO ⊙ O)``; ``dmass (b, h, i, R)`` the gradient of the relative
    value mass.
    """
    b, h, _, _ = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    s_, params = job.scheme, job.params
    need_bias_grad = job.has_bias and (needs_q or any(p.requires_grad for p in params))
    # A query-independent relative term (T5) is computed once; its gradient is the sum over
    # tiles of dS scattered by relative index.
    rel_const = drel_const = None
    if job.rel_bias and query_independent(s_, q):
        with torch.enable_grad():
            probe = s_.relative_logits(q[:, :, :1])
        rel_const = probe
        if probe.requires_grad:
            drel_const = q.new_zeros(probe.shape[0], h, 1, job.num_rel)
    for (i0, i1), tiles in zip(job.plan.q_blocks, job.plan.tiles, strict=True):
        qb, dob = q[:, :, i0:i1], do[:, :, i0:i1]
        qp = job.q_positions[i0:i1]
        lse_b, delta_b = lse[:, :, i0:i1].unsqueeze(-1), delta[:, :, i0:i1].unsqueeze(-1)
        dqb = dq[:, :, i0:i1]
        rel = drel = qb_leaf = None
        if rel_const is not None:
            rel = rel_const.detach()
        elif job.rel_bias:
            with torch.enable_grad():
                qb_leaf = qb.detach().requires_grad_(needs_q)
                rel = s_.relative_logits(qb_leaf)
            if rel.requires_grad:
                drel = q.new_zeros(b, h, i1 - i0, job.num_rel)
        bias_leaf = None
        if need_bias_grad and not job.rel_bias:
            qb_leaf = bias_leaf = qb.detach().requires_grad_(needs_q)
        dmass_b = dmass[:, :, i0:i1] if dmass is not None else None
        for j0, j1, masked in tiles:
            kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]
            bounds = (i0, i1, j0, j1)
            s, blocked, index, bias = _scores(
                job, qb, kb, bounds, None if rel is None else rel.detach(), masked, bias_leaf
            )
            if blocked is not None and bool(blocked.all()):
                continue
            p = _exp(s.sub_(lse_b))
            if blocked is not None:
                p.masked_fill_(blocked, 0.0)
            keep = _keep_mask(p, job.dropout_p) if job.dropout_p > 0 else None
            pd = p if keep is None else p * keep  # the probabilities that weigh v
            dp = torch.matmul(dob, vb.transpose(-1, -2))
            if job.rel_value:
                dp.add_(_gather_rel(dmass_b, index))
            elif job.has_value:
                with torch.enable_grad():
                    p_leaf = pd.detach().requires_grad_(True)
                    term = s_.value_term(p_leaf, qp, job.k_positions[j0:j1])
                if term is not None:
                    grads = torch.autograd.grad(term, [p_leaf, *params], dob, allow_unused=True)
                    dp.add_(grads[0])
                    sink.add(grads[1:])
            if keep is not None:
                dp.mul_(keep)
            ds = dp.sub_(delta_b).mul_(p)  # dS = P ⊙ (dP - D)
            dv[:, :, j0:j1] += torch.matmul(pd.transpose(-1, -2), dob)
            if drel is not None:
                _scatter_rel(drel, index, ds)
            elif drel_const is not None:
                part = q.new_zeros(*ds.shape[:-1], job.num_rel)
                _scatter_rel(part, index, ds)
                drel_const += _sum_to(part, drel_const.shape)
            elif bias is not None and bias.requires_grad:
                push_grad(bias, _sum_to(ds, bias.shape), qb_leaf if needs_q else None, dqb, sink)
            ds.mul_(job.scale)
            dqb += torch.matmul(ds, kb)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb)
        if drel is not None:
            push_grad(rel, _sum_to(drel, rel.shape), qb_leaf if needs_q else None, dqb, sink)
    if drel_const is not None:
        push_grad(rel_const, drel_const, None, dq, sink)
    return dq, dk, dv


def _relative_value(job: _Job, mass: Tensor) -> Tensor:
    return job.scheme.relative_value(mass).to(mass.dtype)


def _value_grads(job: _Job, mass: Tensor, do: Tensor, sink: GradSink) -> Tensor:
    """Gradient of the relative value term w.r.t. the normalised mass (and the table, into sink)."""
    with torch.enable_grad():
        leaf = mass.detach().requires_grad_(True)
        term = job.scheme.relative_value(leaf)
    grads = torch.autograd.grad(term, [leaf, *job.params], do, allow_unused=True)
    sink.add(grads[1:])
    return torch.zeros_like(mass) if grads[0] is None else grads[0]


def _normalise(stats: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(lse (b, h, i), out (b, h, i, d), mass (b, h, i, R) | None)`` from running statistics.

    Rows with no key get ``lse = +inf`` (so recomputed probabilities are 0) and zeros.
    """
    norm = stats["norm"]
    has = norm > 0
    safe = torch.where(has, norm, 1.0)
    out = torch.where(has.unsqueeze(-1), stats["acc"] / safe.unsqueeze(-1), 0.0)
    lse = torch.where(has, stats["m"] + torch.log(safe), math.inf)
    mass = stats.get("mass")
    if mass is not None:
        mass = torch.where(has.unsqueeze(-1), mass / safe.unsqueeze(-1), 0.0)
    return lse, out, mass


class _TiledAttention(torch.autograd.Function):
    """The general path (see the module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, job: _Job, *params: Tensor) -> Tensor:
        del params  # reached through job.scheme; listed so that autograd tracks them
        dtype = compute_dtype(q.dtype)
        qf, kf, vf = (t.to(dtype) for t in (q, k, v))
        rng_state = _rng_state(q.device) if job.dropout_p > 0 else None
        lse, out, mass = _normalise(_tiles_forward(job, qf, kf, vf))
        if mass is not None:
            out = out + _relative_value(job, mass)
        ctx.job, ctx.rng_state = job, rng_state
        ctx.save_for_backward(qf, kf, vf, out, lse, *(() if mass is None else (mass,)))
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        job: _Job = ctx.job
        qf, kf, vf, out, lse, *rest = ctx.saved_tensors
        do = grad_out.to(qf.dtype)
        delta = (do * out).sum(-1)  # rowsum(dO ⊙ O), O including the value term
        sink = GradSink(job.params)
        dmass = _value_grads(job, rest[0], do, sink) if rest else None
        with _ReplayRng(qf.device, ctx.rng_state):
            dq, dk, dv = _tiles_backward(
                job, qf, kf, vf, do, lse, delta, dmass, ctx.needs_input_grad[0], sink
            )
        t = grad_out.dtype
        return dq.to(t), dk.to(t), dv.to(t), None, *sink.result()


# ----------------------------------------------------------------------------------- region path
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


#: ``_far_widths`` per scheme and (n, causal, device): a function of the scheme's configuration
#: only, and a millisecond of index arithmetic per call otherwise (3 % of T5's forward at L=2048).
_FAR_WIDTHS: weakref.WeakKeyDictionary[Scheme, dict[tuple, tuple[int, int, int, int]]] = (
    weakref.WeakKeyDictionary()
)


def _far_widths(job: _Job, n: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(W_L, r_L, W_R, r_R)``: relative index constant ``r_L`` for all ``j - i <= -W_L`` (and
    ``r_R`` for ``j - i >= W_R``) over the distances an ``n``-token sequence has. ``W = n`` means
    no far region."""
    per_scheme = _FAR_WIDTHS.setdefault(job.scheme, {})
    key = (n, job.causal, str(device))
    if key not in per_scheme:
        per_scheme[key] = _compute_far_widths(job, n, device)
    return per_scheme[key]


def _compute_far_widths(job: _Job, n: int, device: torch.device) -> tuple[int, int, int, int]:
    s_ = job.scheme
    pos = Positions.from_length(n, device=device)
    last, first = pos[n - 1 : n], pos[0:1]
    left = s_.relative_index(last, pos).reshape(-1).tolist()  # distances -(n-1)..0
    right = s_.relative_index(first, pos).reshape(-1).tolist()  # distances 0..n-1
    w_l = n
    while w_l > 1 and left[n - w_l] == left[0]:  # is distance -(w_l - 1) far too?
        w_l -= 1
    w_r = n
    while w_r > 1 and right[w_r - 1] == right[n - 1]:  # is distance w_r - 1 far too?
        w_r -= 1
    # A far region of a few pairs is not worth a kernel call: leave it to the band.
    w_l = n if w_l > n - _MIN_FAR else w_l
    w_r = n if (job.causal or w_r > n - _MIN_FAR) else w_r
    return w_l, int(left[0]), w_r, int(right[n - 1])


def _value_rows(job: _Job, rows: list[int], h: int, like: Tensor) -> Tensor:
    """``(len(rows), 1|b, h, 1, d)``: the value-table vector of each relative row."""
    onehot = like.new_zeros(len(rows), h, 1, job.num_rel)
    for t, r in enumerate(rows):
        onehot[t, :, 0, r] = 1.0
    return job.scheme.relative_value(onehot).to(like.dtype).unsqueeze(1)


class _RegionAttention(torch.autograd.Function):
    """Band tiles + far parts by the fused CPU kernel (relative schemes, contiguous positions)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, job: _Job, *params: Tensor) -> Tensor:
        del params
        dtype = compute_dtype(q.dtype)
        qf, kf, vf = (t.to(dtype) for t in (q, k, v))
        stats = (narrow_forward if job.narrow else band_forward)(
            job.scheme,
            job.band_geom,
            qf,
            kf,
            vf,
            scale=job.scale,
            has_bias=job.rel_bias,
            has_value=job.rel_value,
            num_rel=job.num_rel,
            far_rows=job.far_rows,
        )
        lse, out, mass = stats["lse"], stats["out"], stats.get("mass")
        cols = stats.get("cols")  # (1|b, h, n, 2): logit term of the far rows r_L, r_R
        parts = _far_parts(job, qf, kf, vf, cols)  # [(side, rows, lse_p, out_p)]
        for _, rows, lse_p, out_p in parts:
            # Merge in place by log-sum-exp (lse_p already includes the row constant).
            # The part's share of the merged softmax is exp(lse_p - l_new) = sigmoid(lse_p - l_old):
            # out moves towards out_p by that share (one pass).
            l_old = lse[:, :, rows]
            out[:, :, rows].lerp_(out_p, torch.sigmoid(lse_p - l_old).unsqueeze(-1))
            if mass is not None:
                mass[:, :, rows] *= torch.sigmoid(l_old - lse_p).unsqueeze(-1)
            lse[:, :, rows] = torch.logaddexp(l_old, lse_p)
        if mass is not None:
            for side, rows, lse_p, _ in parts:
                mass[:, :, rows, job.far[1 + 2 * side]] += torch.exp(lse_p - lse[:, :, rows])
            out = out + _relative_value(job, mass)
        ctx.job, ctx.sides = job, [side for side, *_ in parts]
        ctx.save_for_backward(
            qf,
            kf,
            vf,
            out,
            lse,
            *(() if mass is None else (mass,)),
            *(() if cols is None else (cols,)),
            *(t for _, _, lse_p, out_p in parts for t in (lse_p, out_p)),
        )
        ctx.has_mass, ctx.has_cols = mass is not None, cols is not None
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        job: _Job = ctx.job
        qf, kf, vf, out, lse, *rest = ctx.saved_tensors
        mass = rest.pop(0) if ctx.has_mass else None
        cols = rest.pop(0) if ctx.has_cols else None
        b, h, n, _ = qf.shape
        w_l, r_l, w_r, r_r = job.far
        do = grad_out.to(qf.dtype)
        delta = (do * out).sum(-1)
        sink = GradSink(job.params)
        dmass = _value_grads(job, mass, do, sink) if mass is not None else None
        values = _value_rows(job, [r_l, r_r], h, qf) if job.rel_value else None
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        far_grads = qf.new_zeros(b, h, n, 2) if job.rel_bias else None
        for t, side in enumerate(ctx.sides):
            lse_p, out_p = rest[2 * t], rest[2 * t + 1]
            width = w_l if side == 0 else w_r
            rows = slice(width, n) if side == 0 else slice(0, n - width)
            keys = slice(0, n - width) if side == 0 else slice(width, n)
            a_p = values[side] if values is not None else None  # (1, h, 1, d)
            o_adj = out[:, :, rows] if a_p is None else out[:, :, rows] - a_p
            lse_k = lse[:, :, rows]
            if cols is not None:
                lse_k = lse_k - cols[:, :, rows, side]  # the kernel's own, constant-free lse
            args = [do[:, :, rows], qf[:, :, rows], kf[:, :, keys], vf[:, :, keys], o_adj, lse_k]
            if side == 1:  # keys after the queries: flip both to make it causal
                args = [x.flip(-2) if x.ndim == 4 else x.flip(-1) for x in args]
            args[-1] = args[-1].contiguous()  # lse; the kernel takes strided q, k, v, dO, O
            gq, gk, gv = _flash_bwd(*args, 0.0, True, scale=job.scale)
            if side == 1:
                gq, gk, gv = gq.flip(-2), gk.flip(-2), gv.flip(-2)
            dq[:, :, rows] += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
            if far_grads is not None:
                # Σ over the part's keys of dS = w_p·(dO·(O_p + a_p) - D).
                full = out_p if a_p is None else out_p + a_p
                w = torch.exp(lse_p - lse[:, :, rows])
                far_grads[:, :, rows, side] = w * (
                    (do[:, :, rows] * full).sum(-1) - delta[:, :, rows]
                )
        (narrow_backward if job.narrow else band_backward)(
            job.scheme,
            job.band_geom,
            qf,
            kf,
            vf,
            do,
            lse,
            delta,
            scale=job.scale,
            has_bias=job.rel_bias,
            num_rel=job.num_rel,
            dmass=dmass,
            far_rows=job.far_rows,
            far_grads=far_grads,
            needs_q=ctx.needs_input_grad[0],
            sink=sink,
            grads=(dq, dk, dv),
        )
        t = grad_out.dtype
        return dq.to(t), dk.to(t), dv.to(t), None, *sink.result()


def _far_parts(
    job: _Job, q: Tensor, k: Tensor, v: Tensor, cols: Tensor | None
) -> list[tuple[int, slice, Tensor, Tensor]]:
    """The far parts by the fused kernel: ``[(side, query rows, lse (b, h, r), out (b, h, r, d))]``.

    Side 0: keys ``j <= i - W_L``, i.e. causal attention of ``q[W_L:]`` over ``k[:n-W_L]``.
    Side 1: keys ``j >= i + W_R``, the same after flipping ``q[:n-W_R]`` and ``k[W_R:]``.
    ``lse`` includes the part's per-query logit constant ``rel[i, r_far]``.
    """
    n = q.shape[-2]
    w_l, _, w_r, _ = job.far
    parts = []
    if w_l < n:
        rows = slice(w_l, n)
        o, lse = _flash(
            q[:, :, rows], k[:, :, : n - w_l], v[:, :, : n - w_l], 0.0, True, scale=job.scale
        )
        parts.append((0, rows, lse, o))
    if w_r < n:
        rows = slice(0, n - w_r)
        o, lse = _flash(
            q[:, :, rows].flip(-2),
            k[:, :, w_r:].flip(-2),
            v[:, :, w_r:].flip(-2),
            0.0,
            True,
            scale=job.scale,
        )
        parts.append((1, rows, lse.flip(-1), o.flip(-2)))
    if cols is not None:
        parts = [(side, rows, lse + cols[:, :, rows, side], o) for side, rows, lse, o in parts]
    return parts


# ----------------------------------------------------------------------------------- dropout RNG
def _rng_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _ReplayRng:
    """Run with the RNG state the forward pass started from; restore the current one after."""

    def __init__(self, device: torch.device, state: Tensor | None) -> None:
        self.device, self.state, self.saved = device, state, None

    def __enter__(self) -> None:
        if self.state is not None:
            self.saved = _rng_state(self.device)
            _set_rng_state(self.device, self.state)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            _set_rng_state(self.device, self.saved)


# ----------------------------------------------------------------------------------- entry point
def chunked_path(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
) -> str:
    """Which path :func:`chunked_attention` takes: ``"fused"`` (no bias: the stock kernel),
    ``"alibi"``, ``"region"`` or ``"tiles"`` (the general path)."""
    plain = q_positions is k_positions and q_positions.contiguous
    if not plain or (dropout_p > 0 and training) or q.device.type != "cpu":
        return "tiles"
    hooks = scheme.hooks
    if not hooks & {"score_bias", "value_term"}:
        return "fused"
    from ..schemes.alibi import ALiBi

    if isinstance(scheme, ALiBi) and "value_term" not in hooks:
        return "alibi"
    rel = all(hasattr(scheme, a) for a in ("relative_index", "num_relative"))
    bias_ok = "score_bias" not in hooks or (
        hasattr(scheme, "relative_logits") and supports(scheme, q)
    )
    value_ok = "value_term" not in hooks or hasattr(scheme, "relative_value")
    if rel and bias_ok and value_ok:
        return "region"
    return "tiles"


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Scheme,
    q_positions: Positions,
    k_positions: Positions,
    *,
    causal: bool,
    dropout_p: float = 0.0,
    training: bool = False,
    q_block: int | None = None,
    k_block: int | None = None,
    path: str | None = None,
) -> Tensor:
    """Memory-lean attention for every scheme: ``O(bi·bj)`` per tile instead of ``O(i·j)``.

    Same contract and results as :func:`~relpos.attention.eager.eager_attention` (float32 math,
    padding queries get 0 forward and backward, gradients reach ``q``, ``k``, ``v`` and the
    scheme's parameters).

    Args:
        q_block, k_block: tile sizes of the general path (default :data:`DEFAULT_BLOCK`).
        path: force ``"tiles"`` (the general path) or leave None to pick with
            :func:`chunked_path`.

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)`` (already rotated); returns ``(b, h, i, d)`` in
        ``q``'s dtype.
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    q_block = DEFAULT_BLOCK[0] if q_block is None else q_block
    k_block = DEFAULT_BLOCK[1] if k_block is None else k_block
    for name, value in (("q_block", q_block), ("k_block", k_block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if path not in (None, "tiles"):
        raise ValueError(f"path must be None or 'tiles', got {path!r}")
    chosen = path or chunked_path(
        scheme, q, q_positions, k_positions, dropout_p=dropout_p, training=training
    )
    scale = 1.0 / math.sqrt(q.shape[-1])
    params = [p for p in scheme.parameters() if p.requires_grad]
    n = q.shape[-2]
    if chosen == "fused":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if chosen == "alibi":
        from .alibi_parts import AlibiAttention  # it imports this module's kernel aliases

        job = _Job(scheme, q_positions, k_positions, causal, TilePlan([], []), scale)
        return AlibiAttention.apply(q, k, v, job)
    if chosen == "region":
        job = _Job(scheme, q_positions, k_positions, causal, TilePlan([], []), scale, params=params)
        w_l, r_l, w_r, r_r = _far_widths(job, n, q.device)
        band = (-w_l, 1 if causal else w_r)
        # A block of B queries computes B + D - 1 keys for D band distances: a narrow band (Shaw,
        # T5) runs in distance coordinates with small blocks; a wide one (Music Transformer at
        # M = L/2) on tiles, faster in large blocks.
        job.narrow = is_narrow(band[1] - band[0] - 1, n)
        if job.narrow:
            bq = NARROW_BLOCK
        else:
            bq = _MIN_BAND_BLOCK if band[1] - band[0] < 512 else _BAND_BLOCK
        job.band_geom = Band.build(scheme, n, band[0], band[1], bq, q.device)
        job.far_rows = [r_l, r_r] if job.rel_bias else []
        job.far = (w_l, r_l, w_r, r_r)
        return _RegionAttention.apply(q, k, v, job, *params)
    job = _Job(
        scheme,
        q_positions,
        k_positions,
        causal,
        plan_tiles(q_positions, k_positions, causal=causal, q_block=q_block, k_block=k_block),
        scale,
        dropout_p=dropout_p if training else 0.0,
        params=params,
    )
    return _TiledAttention.apply(q, k, v, job, *params)
