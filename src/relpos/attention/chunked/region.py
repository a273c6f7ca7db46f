"""The ``chunked`` backend's region path: a clipped relative scheme over contiguous positions.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table.

Relative schemes clip distances (Shaw's ``k``, T5's last bucket, the Music Transformer's ``M``), so
beyond a band ``-W_L < j - i < W_R`` the logit term is a per-query constant ``rel[i, r_far]`` and
the value term a constant vector. Keys ``j <= i - W_L`` are one call of PyTorch's fused CPU kernel
on shifted slices (``is_causal=True`` on ``q[W_L:]``, ``k[:L-W_L]``), keys ``j >= i + W_R`` one on
flipped slices; the band runs in a :class:`~.job.BandEngine` (:mod:`.narrow` when it is narrow,
:mod:`.band` otherwise). The parts merge by log-sum-exp, as in blockwise/ring attention (Liu et
al., 2023). The backward pass calls the kernel's backward with the *merged* output and
log-sum-exp, which yields each part's share; the constants' gradients follow from the parts'
outputs: ``Σ_far dS_ij = w_far,i (dO_i·(O_far,i + a_far) - D_i)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...functional.dtypes import compute_dtype, outside_autocast
from ...positions import Positions
from ...schemes.base import RelativeScheme
from ..memo import BoundedCache
from . import band as tile_engine
from . import narrow as distance_engine
from .geometry import Band
from .grads import GradSink
from .job import BandBackward, FarField, Job
from .kernels import flash, flash_backward

__all__ = ["region_attention", "region_supports"]

#: Query block of the tile engine's band (a band under 512 distances: the smaller one).
_BAND_BLOCK = 128
_MIN_BAND_BLOCK = 64
#: Smallest far region (in distances) handed to the fused kernel.
_MIN_FAR = 16

#: Far fields by (scheme class, config, causal, n, device): a function of those only.
_FAR_FIELDS = BoundedCache(1024, cost=lambda _: 1)


def region_supports(scheme: RelativeScheme) -> bool:
    """Whether the band can compute ``scheme``'s terms: a logit term that is ``q·Eᵀ``
    (``relative_keys``) or the same for every query, and any relative value term."""
    if "score_bias" not in scheme.hooks:
        return True
    return scheme.query_independent or scheme.has_relative_keys


def far_field(scheme: RelativeScheme, n: int, device: torch.device) -> FarField:
    """The far field of an ``n``-token sequence (cached per scheme configuration)."""
    key = (type(scheme), scheme.config, scheme.causal, n, str(device))
    return _FAR_FIELDS.get_or_build(key, lambda: _compute_far_field(scheme, n, device))


def _compute_far_field(scheme: RelativeScheme, n: int, device: torch.device) -> FarField:
    pos = Positions.from_length(n, device=device)
    last, first = pos[n - 1 : n], pos[0:1]
    left = scheme.relative_index(last, pos).reshape(-1).tolist()  # distances -(n-1)..0
    right = scheme.relative_index(first, pos).reshape(-1).tolist()  # distances 0..n-1
    w_l = n
    while w_l > 1 and left[n - w_l] == left[0]:  # is distance -(w_l - 1) far too?
        w_l -= 1
    w_r = n
    while w_r > 1 and right[w_r - 1] == right[n - 1]:  # is distance w_r - 1 far too?
        w_r -= 1
    # A far region of a few pairs is not worth a kernel call: leave it to the band.
    w_l = n if w_l > n - _MIN_FAR else w_l
    w_r = n if (scheme.causal or w_r > n - _MIN_FAR) else w_r
    return FarField(w_l, int(left[0]), w_r, int(right[n - 1]))


def region_attention(q: Tensor, k: Tensor, v: Tensor, job: Job) -> Tensor:
    """Self-attention over contiguous positions by band + far parts (the module docstring)."""
    n = q.shape[-2]
    far = far_field(job.scheme, n, q.device)
    lo, hi = -far.left, 1 if job.causal else far.right
    # A block of B queries computes B + D - 1 keys for D band distances: a narrow band (Shaw,
    # T5) runs in distance coordinates with small blocks; a wide one (Music Transformer at
    # M = L/2) on tiles, faster in large blocks.
    if distance_engine.is_narrow(hi - lo - 1, n):
        job.engine, block = distance_engine, distance_engine.NARROW_BLOCK
    else:
        job.engine = tile_engine
        block = _MIN_BAND_BLOCK if hi - lo < 512 else _BAND_BLOCK
    job.band = Band.build(job.scheme, n, lo, hi, block, q.device)
    if job.engine is distance_engine:
        # Whole padding blocks after each (batch, head) row of the flat buffers, as many as a
        # window reaches past its block: no real query's window reads the next row's keys (a
        # zero probability times a NaN there would carry it across batch rows).
        band = job.band
        reach = max(band.left, band.keys - band.block - band.left)
        band.gap = -(-reach // band.block) * band.block
    job.far = far
    job.far_rows = [far.left_row, far.right_row] if job.rel_bias else []
    return RegionAttention.apply(q, k, v, job, *job.params)


def _value_rows(job: Job, rows: list[int], h: int, like: Tensor) -> Tensor:
    """``(len(rows), 1|b, h, 1, d)``: the value-table vector of each relative row."""
    onehot = like.new_zeros(len(rows), h, 1, job.num_rel)
    for t, r in enumerate(rows):
        onehot[t, :, 0, r] = 1.0
    return job.scheme.relative_value(onehot).to(like.dtype).unsqueeze(1)


class RegionAttention(torch.autograd.Function):
    """Band tiles + far parts by the fused CPU kernel (relative schemes, contiguous positions)."""

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, job: Job, *params: Tensor) -> Tensor:
        del params
        dtype = compute_dtype(q.dtype)
        qf, kf, vf = (t.to(dtype) for t in (q, k, v))
        stats = job.engine.forward(job, qf, kf, vf)
        lse, out, mass = stats["lse"], stats["out"], stats.get("mass")
        cols = stats.get("cols")  # (1|b, h, n, 2): logit term of the far rows r_L, r_R
        parts = far_parts(job, qf, kf, vf, cols)  # [(side, rows, lse_p, out_p)]
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
            far_row = (job.far.left_row, job.far.right_row)
            for side, rows, lse_p, _ in parts:
                mass[:, :, rows, far_row[side]] += torch.exp(lse_p - lse[:, :, rows])
            out = out + job.value_term(mass)
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
    @outside_autocast
    def backward(ctx, grad_out: Tensor):
        job: Job = ctx.job
        qf, kf, vf, out, lse, *rest = ctx.saved_tensors
        mass = rest.pop(0) if ctx.has_mass else None
        cols = rest.pop(0) if ctx.has_cols else None
        b, h, n, _ = qf.shape
        far = job.far
        w_l, w_r = far.left, far.right
        do = grad_out.to(qf.dtype)
        delta = (do * out).sum(-1)
        sink = GradSink(job.params)
        dmass = job.value_grads(mass, do, sink) if mass is not None else None
        values = _value_rows(job, [far.left_row, far.right_row], h, qf) if job.rel_value else None
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
            gq, gk, gv = flash_backward(*args, 0.0, True, scale=job.scale)
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
        grad = BandBackward(
            do, lse, delta, dmass, far_grads, ctx.needs_input_grad[0], sink, (dq, dk, dv)
        )
        job.engine.backward(job, qf, kf, vf, grad)
        t = grad_out.dtype
        return dq.to(t), dk.to(t), dv.to(t), None, *sink.result()


def far_parts(
    job: Job, q: Tensor, k: Tensor, v: Tensor, cols: Tensor | None
) -> list[tuple[int, slice, Tensor, Tensor]]:
    """The far parts by the fused kernel: ``[(side, query rows, lse (b, h, r), out (b, h, r, d))]``.

    Side 0: keys ``j <= i - W_L``, i.e. causal attention of ``q[W_L:]`` over ``k[:n-W_L]``.
    Side 1: keys ``j >= i + W_R``, the same after flipping ``q[:n-W_R]`` and ``k[W_R:]``.
    ``lse`` includes the part's per-query logit constant ``rel[i, r_far]``.
    """
    n = q.shape[-2]
    w_l, w_r = job.far.left, job.far.right
    parts = []
    if w_l < n:
        rows = slice(w_l, n)
        o, lse = flash(
            q[:, :, rows], k[:, :, : n - w_l], v[:, :, : n - w_l], 0.0, True, scale=job.scale
        )
        parts.append((0, rows, lse, o))
    if w_r < n:
        rows = slice(0, n - w_r)
        o, lse = flash(
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
