"""ALiBi over contiguous positions on CPU: the ``chunked`` backend's fused-kernel parts.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim; ``bi`` queries
in one block.

ALiBi adds ``-slope_h·|j - i|`` (Press et al., 2022). Over plain positions ``0..L-1`` a query
block ``[i0, i1)`` splits its keys into three parts, each one call of the stock fused kernel:

* **left** ``j < i0``: ``slope·(j - i) = slope·(j - i0) - slope·(i - i0)``, a per-key row
  ``(1, h, 1, j)`` mask plus a per-query constant added to the part's log-sum-exp;
* **diagonal** ``[i0, i1)``: the exact ``(1, h, bi, bi)`` bias;
* **right** ``j >= i1`` (bidirectional): the mirror image of the left part.

The parts merge by log-sum-exp. Every value added near the query stays small, so float32 rounding
stays at the level of ``slope·block``; nothing ``(i, j)`` is built beyond the diagonal block.

**Trained slopes** (learned ALiBi, a linear :class:`~relpos.schemes.DistanceBiasScheme`): the
slope's gradient is ``Σ_ij dS_ij·e_ij`` with ``e_ij = j - i`` (causal) or ``-|j - i|``. Over a
left part ``e_ij = u_j - c_i`` with ``u_j = j - i0`` and ``c_i = i - i0`` (a right part: its
negative), so it needs only the column sums ``Σ_i dS_ij`` and ``Σ_i dS_ij·c_i``. The backward
kernel returns them as two extra columns of ``dK``: queries get the columns ``(1, c_i)``, keys
zeros (the logits do not change), values and output gradients zeros. The bidirectional diagonal
block, where ``-|j - i|`` is not linear, is recomputed explicitly (``bi × bi``).

**Keys too far to matter are skipped** (:func:`alibi_reach`). A steep head's bias drives far
keys' probabilities below the smallest positive float: with ``scale·|q_i·k_j| <= scale·‖q‖·‖k‖``
and the query's own key (bias 0) in its row, key ``j`` has
``log P_ij <= 2·scale·max‖q‖·max‖k‖ - slope·|i - j|``, and past
``|i - j| > (2·scale·max‖q‖·max‖k‖ + T) / slope`` with ``T = -log(smallest subnormal)`` (103.3 in
float32) its probability is exactly 0 in the compute dtype, forward and backward. For the default
slopes ``2^-1..2^-8`` and unit-variance ``q, k`` with ``d = 64`` the three steepest of eight heads
become windows of about 260, 520 and 1060 keys. The bound comes from the data, per query block
and head, so trained weights with large norms simply skip less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...functional.dtypes import compute_dtype, outside_autocast
from .grads import GradSink, push_grad
from .job import Job
from .kernels import block_bounds
from .parts import Part, Span, attend_blocks, backward_part, head_spans

__all__ = ["ALIBI_BLOCK", "AlibiAttention", "alibi_reach"]

#: Query block of ALiBi's parts.
ALIBI_BLOCK = 256


def alibi_reach(slopes: Tensor, q: Tensor, k: Tensor, scale: float, block: int) -> list[list[int]]:
    """Per query block and head, the key distance past which ALiBi's probabilities are exactly 0.

    Args:
        slopes: ``(h,)`` ALiBi slopes.
        q, k: ``(b, h, i, d)`` and ``(b, h, j, d)`` in the compute dtype.
        scale: the logit scale.
        block: queries per block.

    Returns:
        ``reach[c][h]``: every key farther than that from every query of block ``c`` has
        probability 0 for head ``h`` (``-1``: no bound — a slope that is not positive, or norms
        that are not finite).
    """
    floor = -math.log(torch.finfo(q.dtype).smallest_normal * torch.finfo(q.dtype).eps)
    n = q.shape[-2]
    nb = -(-n // block)
    q_norm = torch.linalg.vector_norm(q, dim=-1).amax(0)  # (h, i)
    q_norm = torch.nn.functional.pad(q_norm, (0, nb * block - n)).view(-1, nb, block).amax(-1)
    k_norm = torch.linalg.vector_norm(k, dim=-1).amax(0).amax(-1, keepdim=True)  # (h, 1)
    slope = slopes.to(q.device, torch.float64).view(-1, 1)
    # The log-probability bound: 2·scale·|q|·|k| above the row's own key, minus the bias.
    reach = (2.0 * scale * q_norm.double() * k_norm.double() + floor + 1.0) / slope
    ok = torch.isfinite(reach) & (slope > 0) & (reach < 2**62)
    reach = torch.where(ok, reach.floor(), torch.full_like(reach, -1.0))
    return reach.to(torch.int64).t().tolist()  # one sync per call


@dataclass
class _Geometry:
    """What every query block of ``n`` plain positions shares, computed once per call.

    ``left[..., n - i0:]`` is the left part's mask ``slope·(j - i0)`` for ``j < i0``;
    ``right[..., :n - i1]`` the right part's ``-slope·(j - i1 + 1)`` for ``j >= i1``; ``diag``
    the exact bias of a full block (its top-left corner that of a shorter last block); the
    per-query constants ``-slope·(i - i0)`` and ``-slope·(i1 - 1 - i)`` likewise.
    """

    left: Tensor  # (1, h, 1, n)
    right: Tensor  # (1, h, 1, n)
    diag: Tensor  # (1, h, B, B)
    const_left: Tensor  # (1, h, B)
    const_right: Tensor  # (1, h, B)

    @classmethod
    def build(cls, slopes: Tensor, causal: bool, n: int, block: int) -> _Geometry:
        """From ``(h,)`` slopes in the compute dtype (no graph)."""
        slopes = slopes.view(1, -1, 1)  # (1, h, 1)
        ar = torch.arange(max(n, block) + 1, device=slopes.device, dtype=slopes.dtype)
        bl = min(block, n)
        return cls(
            left=(slopes * (ar[:n] - n)).unsqueeze(2),
            right=(-slopes * ar[1 : n + 1]).unsqueeze(2),
            diag=slopes.unsqueeze(-1) * _diag_distance(bl, causal, slopes),
            const_left=-slopes * ar[:bl],
            const_right=-slopes * ar[:bl].flip(0),
        )


def _diag_distance(bi: int, causal: bool, like: Tensor) -> Tensor:
    """``e (bi, bi)`` of a diagonal block: ``j - i`` (causal) or ``-|j - i|``."""
    ar = torch.arange(bi, device=like.device, dtype=like.dtype)
    e = ar.view(1, -1) - ar.view(-1, 1)
    return e if causal else -e.abs()


def _slopes(job: Job) -> Tensor:
    """The scheme's ``(h,)`` slopes in use (with their graph for trained slopes)."""
    return job.scheme.linear_slopes()


def _parts(
    geom: _Geometry, causal: bool, heads: int, i0: int, i1: int, n: int, reach: list[int]
) -> list[Part]:
    """The diagonal, left and (bidirectional) right parts of query block ``[i0, i1)``, the
    diagonal first (the one part with a key for every head, so its log-sum-exp is finite).

    Left keys ``j < i0``: ``slope·(j - i) = slope·(j - i0) - slope·(i - i0)``; right keys
    ``j >= i1``: ``-slope·(j - i) = -slope·(j - i1 + 1) - slope·(i1 - 1 - i)``; the diagonal block
    takes the exact bias. Head ``h`` drops left keys ``j < i0 - reach[h]`` and right keys
    ``j >= i1 + reach[h]`` (:func:`alibi_reach`).
    """
    bi = i1 - i0
    far = [r if r >= 0 else n for r in reach]
    diag = geom.diag[..., :bi, :bi]
    parts = [Part([Span(0, heads, i0, i1)], i0, diag, None, causal)]
    if i0 > 0:
        spans = head_spans([max(0, i0 - r) for r in far], [i0] * heads)
        const = geom.const_left[..., :bi]
        parts.append(Part(spans, 0, geom.left[..., n - i0 :], const, False))
    if not causal and i1 < n:
        spans = head_spans([i1] * heads, [min(n, i1 + r) for r in far])
        const = geom.const_right[..., geom.const_right.shape[-1] - bi :]
        parts.append(Part(spans, i1, geom.right[..., : n - i1], const, False))
    return parts


def _diag_slope_grad(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, e: Tensor, job: Job
) -> Tensor:
    """``(h,)`` ``Σ dS·e`` over one bidirectional diagonal block, recomputed explicitly."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(job.scale)
    p = s.add_(_slopes(job).detach().view(1, -1, 1, 1) * e).sub_(lse.unsqueeze(-1)).exp_()
    ds = torch.matmul(do, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    return (ds * e).sum((0, 2, 3))


class AlibiAttention(torch.autograd.Function):
    """ALiBi attention ``(b, h, i, d)`` over plain positions from fused-kernel parts merged by
    log-sum-exp; the backward pass runs the fused backward kernel on the same parts with the
    final log-sum-exp, and returns trained slopes' gradient (``params``: the scheme's parameters
    that need one; see the module docstring)."""

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, job: Job, *params: Tensor) -> Tensor:
        del params  # reached through job.scheme; listed so that autograd tracks them
        dtype = compute_dtype(q.dtype)
        qf, kf, vf = (t.to(dtype) for t in (q, k, v))
        h, n = qf.shape[1], qf.shape[2]
        slopes = _slopes(job).detach().to(qf.device, dtype)
        reach = alibi_reach(slopes, qf, kf, job.scale, ALIBI_BLOCK)
        geom = _Geometry.build(slopes, job.causal, n, ALIBI_BLOCK)
        out, lse = attend_blocks(
            lambda c, i0, i1: _parts(geom, job.causal, h, i0, i1, n, reach[c]),
            qf, kf, vf, ALIBI_BLOCK, job.scale,
        )  # fmt: skip
        ctx.job, ctx.reach, ctx.geom = job, reach, geom
        ctx.save_for_backward(qf, kf, vf, out, lse)
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @outside_autocast
    def backward(ctx, grad_out: Tensor):
        job: Job = ctx.job
        qf, kf, vf, out, lse = ctx.saved_tensors
        h, n, d = qf.shape[1], qf.shape[2], qf.shape[3]
        do = grad_out.to(qf.dtype)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        sink = GradSink(job.params)
        learn = any(p.requires_grad for p in job.params)
        if learn:  # two extra columns: zeros on keys, values, output and its gradient
            kf, vf, out, do = (F.pad(t, (0, 2)) for t in (kf, vf, out, do))
            dslope = qf.new_zeros(h)
            delta = (do * out).sum(-1)
        for c, (i0, i1) in enumerate(block_bounds(0, n, ALIBI_BLOCK)):
            dob, ob = do[:, :, i0:i1].contiguous(), out[:, :, i0:i1].contiguous()
            qb = qf[:, :, i0:i1]
            if learn:  # queries' extra columns (1, c_i = i - i0)
                ar = torch.arange(i1 - i0, device=qf.device, dtype=qf.dtype)
                extra = torch.stack((torch.ones_like(ar), ar), -1).expand(*qb.shape[:2], -1, 2)
                qb = torch.cat((qb, extra), -1)
            for part in _parts(ctx.geom, job.causal, h, i0, i1, n, ctx.reach[c]):
                spans = backward_part(
                    part, dob, qb, ob, lse, kf, vf, slice(i0, i1), job.scale, (dq, dk, dv)
                )
                for s, gk in spans:
                    if learn and (part.const is not None or job.causal):
                        # Σ dS·(u_j - c_i), u_j = j - i0; a right part's e is its negative.
                        u = torch.arange(s.j0 - i0, s.j1 - i0, device=qf.device, dtype=qf.dtype)
                        moments = gk[..., d:] / job.scale  # (b, h, j, 2): Σ_i dS, Σ_i dS·c_i
                        g = (moments[..., 0] * u - moments[..., 1]).sum((0, 2))
                        dslope[s.h0 : s.h1] += g if part.start < i1 else -g
            if learn and not job.causal:
                e = _diag_distance(i1 - i0, False, qf)
                dslope += _diag_slope_grad(
                    qf[:, :, i0:i1], kf[:, :, i0:i1, :d], vf[:, :, i0:i1, :d], do[:, :, i0:i1, :d],
                    lse[:, :, i0:i1], delta[:, :, i0:i1], e, job,
                )  # fmt: skip
        if learn:
            with torch.enable_grad():
                slopes = _slopes(job)
            push_grad(slopes, dslope.to(slopes.dtype), None, None, sink)
        t = grad_out.dtype
        return dq.to(t), dk.to(t), dv.to(t), None, *sink.result()
