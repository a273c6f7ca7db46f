"""FIRE: functional interpolation for relative positions (Li et al., 2023/2024, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", ICLR 2024, §3).

For causal attention, the logit of query ``i`` (position ``p_i``) and key ``j`` gets, per head,

    b(i, j) = f_θ( ψ(p_i - p_j) / ψ(max(L, p_i)) ),   ψ(x) = log(c·x + 1),

with ``f_θ`` an MLP from one input to one output per head (hidden width 32, ReLU), ``c > 0`` and
the threshold ``L`` learned. The normaliser makes the input a *fraction* of the query's context
(progressive interpolation), ``L`` keeps short contexts from being stretched. As in the paper's
reference code, ``ψ`` reads ``|c|``, ``L = |L|``, and ``1e-6`` is added to the denominator.

The bias depends on the query's position as well as the distance, so it is ``O(i·j)`` values. No
``(pairs, hidden)`` tensor is needed: with one scalar input and one ReLU layer, ``f_θ`` is exactly
*piecewise linear* in ``x``, with a kink where each hidden unit switches (``x = -b1_k / w1_k``).
Between consecutive kinks the active units are fixed, so each head's output is
``slope[h, s]·x + intercept[h, s]`` on segment ``s``: :func:`fire_bias` finds each pair's segment
(``searchsorted`` over the sorted kinks) and reads two ``(h, hidden + 1)`` tables, ``O(pairs·h)``
work. The backward pass sums the output gradient per segment (``Σ g`` and ``Σ g·x``) and turns
those sums into every weight's gradient with ``(h, hidden + 1) × (hidden + 1, hidden)`` products;
the input's gradient is ``Σ_h g·slope``. Which units are active on a segment comes from the kinks'
ranks, not from evaluating the units, so no rounding near a kink flips a unit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .skew import gather_table

__all__ = ["FIRE_EPS", "fire_bias", "fire_inputs", "fire_mlp", "fire_segments"]

#: Added to the normaliser ``ψ(max(L, p_i))`` (the paper's code).
FIRE_EPS = 1e-6


def fire_inputs(q_pos: Tensor, k_pos: Tensor, c: Tensor, threshold: Tensor) -> Tensor:
    """The MLP's input of every pair, ``ψ(δ) / (ψ(max(L, p_i)) + ε)`` with ``δ = p_i - p_j``.

    Pairs with ``p_j > p_i`` (a causal query never sees them) get ``δ = 0``: a finite value for
    the masked entries, no extrapolation to negative distances.

    Args:
        q_pos: ``(b|1, i)`` integer query positions; k_pos: ``(b|1, j)`` key positions.
        c: scalar, the log transform's scale (``|c|`` is used); threshold: scalar ``L`` (``|L|``).

    Returns:
        ``(b|1, i, j)`` in ``c``'s dtype (at least float32).
    """
    dtype = torch.promote_types(c.dtype, torch.float32)
    c = c.to(dtype).abs()
    pi, pj = q_pos.to(dtype), k_pos.to(dtype)
    delta = (pi.unsqueeze(-1) - pj.unsqueeze(-2)).clamp_min(0.0)
    norm = torch.log1p(c * torch.maximum(pi, threshold.to(dtype).abs())) + FIRE_EPS
    return torch.log1p(c * delta) / norm.unsqueeze(-1)


def fire_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``f_θ`` evaluated directly, ``relu(x·w1ᵀ + b1)·w2ᵀ + b2`` (the reference the piecewise form
    is tested against).

    Shapes: x ``(n,)``; w1 ``(w, 1)``, b1 ``(w,)``, w2 ``(h, w)``, b2 ``(h,)``; returns ``(n, h)``.
    """
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x.unsqueeze(-1), w1.t())), w2.t())


def fire_segments(w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
    """The kinks of ``relu(x·w1ᵀ + b1)`` and which units are active between them.

    Returns ``(kinks (m,), active (w, m + 1))``: the sorted ``-b1_k / w1_k`` of the ``m`` units
    with ``w1_k != 0``; segment ``s`` is ``kinks[s-1] <= x < kinks[s]`` (``searchsorted`` with
    ``right=True``), and ``active[k, s]`` (float 0/1) says whether unit ``k`` is positive there: a
    unit with ``w1_k > 0`` on the segments after its kink, ``w1_k < 0`` up to it, ``w1_k = 0``
    everywhere when ``b1_k > 0``. One device sync (the number of kinks).
    """
    w = w1.reshape(-1)
    sloped = w != 0
    kinks, order = torch.sort(-b1[sloped] / w[sloped])
    m = kinks.numel()
    rank = torch.zeros_like(w, dtype=torch.long)
    rank[sloped] = torch.empty_like(order).scatter_(0, order, torch.arange(m, device=w.device))
    seg = torch.arange(m + 1, device=w.device).unsqueeze(0)  # (1, m + 1)
    rank = rank.unsqueeze(1)
    active = torch.where(
        (w > 0).unsqueeze(1),
        seg > rank,
        torch.where((w < 0).unsqueeze(1), seg <= rank, (b1 > 0).unsqueeze(1).expand(-1, m + 1)),
    )
    return kinks, active.to(b1.dtype)


class _PiecewiseMLP(torch.autograd.Function):
    """``f_θ`` over every element of ``x`` in its piecewise-linear form (module docstring):
    ``(b, i, j)`` inputs to ``(b, h, i, j)`` outputs."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):  # type: ignore[override]
        kinks, active = fire_segments(w1, b1)
        slope = w2 @ (active * w1.reshape(-1, 1))  # (h, m + 1)
        intercept = w2 @ (active * b1.unsqueeze(1)) + b2.unsqueeze(1)
        flat = x.reshape(-1)
        seg = torch.searchsorted(kinks, flat, right=True)  # (n,)
        out = slope.index_select(1, seg).mul_(flat).add_(intercept.index_select(1, seg))
        ctx.save_for_backward(x, seg, active, slope, w1, b1, w2)
        return out.view(slope.shape[0], *x.shape).transpose(0, 1)  # (h, b, i, j) -> (b, h, i, j)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, seg, active, slope, w1, b1, w2 = ctx.saved_tensors
        h, m1 = slope.shape
        g = grad.transpose(0, 1).reshape(h, -1)  # (h, n)
        flat = x.reshape(-1)
        sums = g.new_zeros(2, h, m1)  # per segment: Σ g and Σ g·x
        sums[0].index_add_(1, seg, g)
        sums[1].index_add_(1, seg, g * flat)
        a0, a1 = sums @ active.t()  # (h, w) each: Σ over the segments where a unit is active
        gw2 = a1 * w1.reshape(1, -1) + a0 * b1
        gw1 = (w2 * a1).sum(0).unsqueeze(1)
        gb1 = (w2 * a0).sum(0)
        gb2 = sums[0].sum(1)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (g * slope.index_select(1, seg)).sum(0).view_as(x)
        return gx, gw1, gb1, gw2, gb2


def fire_bias(
    q_pos: Tensor,
    k_pos: Tensor,
    c: Tensor,
    threshold: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
) -> Tensor:
    """The FIRE bias of every pair for every head (causal attention).

    Args:
        q_pos: ``(b|1, i)`` integer query positions; k_pos: ``(b|1, j)`` key positions.
        c, threshold: scalars ``c`` and ``L`` (:func:`fire_inputs`).
        w1, b1, w2, b2: the MLP ``Linear(1, w)``, ReLU, ``Linear(w, h)``.

    Returns:
        ``(b|1, h, i, j)`` in ``c``'s dtype (at least float32); memory ``O(pairs·h)``, the output's.

    When every query sits at or below the threshold (``p_i <= L``: all of them share the
    normaliser ``ψ(L)``), the bias is a function of the distance alone: the MLP runs once per
    distance ``0 … max δ`` and the table is gathered (the same numbers; one device sync decides).
    """
    weights = (w1, b1, w2, b2)
    dtype = torch.promote_types(c.dtype, torch.float32)
    if q_pos.numel() and k_pos.numel() and bool(q_pos.max() <= threshold.detach().abs()):
        delta = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).clamp_min(0)  # (b, i, j)
        d = torch.arange(int(delta.max()) + 1, device=q_pos.device).unsqueeze(0)  # (1, D)
        peak = torch.full_like(d[:, :1], int(q_pos.max()))  # a query whose normaliser is ψ(L)
        x = fire_inputs(peak, peak - d, c, threshold)  # (1, 1, D): ψ(d) / ψ(L)
        table = _PiecewiseMLP.apply(x, *(t.to(dtype) for t in weights))  # (1, h, 1, D)
        return gather_table(table, delta)
    x = fire_inputs(q_pos, k_pos, c, threshold)  # (b, i, j)
    return _PiecewiseMLP.apply(x, *(t.to(dtype) for t in weights))
