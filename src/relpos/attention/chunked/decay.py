"""The forget gate over contiguous positions on CPU: the ``chunked`` backend's fused-kernel parts.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim; ``bi`` queries
in one block.

A :class:`~relpos.schemes.DecayBiasScheme` adds ``c_i - c_j`` (the tokens' cumulative log decay,
``Positions.log_decay``; the Forgetting Transformer, Lin et al., 2025). For a query block
``[i0, i1)`` of one sequence per row the term splits, with the block's reference ``r = c_{i0}``:

* **left** ``j < i0``: ``(r - c_j) + (c_i - r)``, a per-key row ``(b, h, 1, j)`` and a per-query
  constant added to the part's log-sum-exp;
* **diagonal** ``[i0, i1)``: the exact ``(b, h, bi, bi)`` term, causal.

Both differences are taken in float64 and rounded once, so the values near the query, the ones
that carry probability, keep float32 precision however far ``c`` has drifted from 0; each part is
one call of the stock fused kernel (:mod:`.parts`).

**The gradient of ``c``.** A row's ``Σ_j dS_ij`` is 0 (softmax), so a query's own ``c_i`` gets
none; key ``j`` gets ``-Σ_i dS_ij``. The backward kernel returns that column sum as an extra
column of ``dK``: queries get a column of ones, keys, values and output gradients a zero column
(the logits do not change).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...functional.dtypes import compute_dtype, outside_autocast
from .job import Job
from .kernels import block_bounds
from .parts import Part, Span, attend_blocks, backward_part

__all__ = ["DECAY_BLOCK", "DecayAttention"]

#: Query block of the forget gate's parts.
DECAY_BLOCK = 256


def _parts(c: Tensor, heads: int, i0: int, i1: int, dtype: torch.dtype) -> list[Part]:
    """The diagonal part and (after the first block) the left part of ``[i0, i1)``, from
    ``c (b, h, n)`` float64."""
    block = c[:, :, i0:i1]
    diag = (block.unsqueeze(-1) - block.unsqueeze(-2)).to(dtype)  # (b, h, bi, bi)
    parts = [Part([Span(0, heads, i0, i1)], i0, diag, None, True)]
    if i0 > 0:
        ref = c[:, :, i0 : i0 + 1]
        row = (ref - c[:, :, :i0]).to(dtype).unsqueeze(2)  # (b, h, 1, i0)
        parts.append(Part([Span(0, heads, 0, i0)], 0, row, (block - ref).to(dtype), False))
    return parts


class DecayAttention(torch.autograd.Function):
    """Forget-gate attention ``(b, h, i, d)`` over plain positions from fused-kernel parts; the
    backward pass runs the fused backward kernel on the same parts and returns the gradient of
    the log-decay leaves (``decays``: the originals the job's positions were detached from, one
    tensor when queries and keys share their positions)."""

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, job: Job, *decays: Tensor) -> Tensor:
        # ``decays`` are reached through the job's positions; listed so that autograd tracks them
        ctx.decay_dtypes = [t.dtype for t in decays]
        dtype = compute_dtype(q.dtype)
        qf, kf, vf = (t.to(dtype) for t in (q, k, v))
        h = qf.shape[1]
        c = job.scheme.decays(job.q_positions, job.k_positions)[0].detach().double()  # (b, h, n)
        out, lse = attend_blocks(
            lambda _, i0, i1: _parts(c, h, i0, i1, dtype), qf, kf, vf, DECAY_BLOCK, job.scale
        )
        ctx.job, ctx.c = job, c
        ctx.save_for_backward(qf, kf, vf, out, lse)
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @outside_autocast
    def backward(ctx, grad_out: Tensor):
        job: Job = ctx.job
        qf, kf, vf, out, lse = ctx.saved_tensors
        b, h, n, d = qf.shape
        do = grad_out.to(qf.dtype)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        learn = any(ctx.needs_input_grad[4:])
        if learn:  # one extra column: ones on queries, zeros on keys, values and output
            qf = torch.cat((qf, qf.new_ones(b, h, n, 1)), -1)
            kf, vf, out, do = (F.pad(t, (0, 1)) for t in (kf, vf, out, do))
            colsum = qf.new_zeros(b, h, n)  # Σ_i dS_ij per key
        for i0, i1 in block_bounds(0, n, DECAY_BLOCK):
            rows = slice(i0, i1)
            dob, ob, qb = do[:, :, rows].contiguous(), out[:, :, rows].contiguous(), qf[:, :, rows]
            for part in _parts(ctx.c, h, i0, i1, qf.dtype):
                spans = backward_part(part, dob, qb, ob, lse, kf, vf, rows, job.scale, (dq, dk, dv))
                for span, gk in spans:  # one span: every head the same keys
                    if learn:
                        colsum[:, :, span.j0 : span.j1] += gk[..., d] / job.scale
        t = grad_out.dtype
        grads = (dq.to(t), dk.to(t), dv.to(t), None)
        if not learn:
            return *grads, *(None for _ in ctx.needs_input_grad[4:])
        dc = (-colsum).transpose(1, 2)  # (b, n, h)
        needs = ctx.needs_input_grad[4:]
        return *grads, *(
            dc.to(t) if g else None for g, t in zip(needs, ctx.decay_dtypes, strict=True)
        )
