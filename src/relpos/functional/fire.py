"""FIRE: functional interpolation for relative positions (Li et al., 2023/2024, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", ICLR 2024, §3).

For causal attention, the logit of query ``i`` (position ``p_i``) and key ``j`` gets, per head,

    b(i, j) = f_θ( ψ(p_i - p_j) / ψ(max(L, p_i)) ),   ψ(x) = log(c·x + 1),

with ``f_θ`` an MLP from one input to one output per head (hidden width 32, ReLU), ``c > 0`` and
the threshold ``L`` learned. The normaliser makes the input a *fraction* of the query's context
(progressive interpolation), ``L`` keeps short contexts from being stretched. As in the paper's
reference code, ``ψ`` reads ``|c|``, ``L = |L|``, and ``1e-6`` is added to the denominator.

The bias depends on the query's position as well as the distance, so it is ``O(i·j)`` values; the
MLP runs on at most ``block`` pairs at a time, forward and backward (which recomputes each block's
hidden layer instead of storing it), so no ``(i, j, hidden)`` tensor ever exists.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FIRE_EPS", "fire_bias", "fire_hidden", "fire_inputs", "fire_mlp"]

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


def fire_hidden(x: Tensor, w1: Tensor, b1: Tensor) -> Tensor:
    """The MLP's hidden pre-activations of a flat block of inputs, ``x·w1ᵀ + b1``: ``(n, w)``.

    The only place an ``(n, w)`` tensor is made: the forward and the backward call it once per
    block of at most ``block`` inputs."""
    return torch.addmm(b1, x.unsqueeze(-1), w1.t())


def fire_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``f_θ`` on a flat block of inputs: ``relu(x·w1ᵀ + b1)·w2ᵀ + b2``.

    Shapes: x ``(n,)``; w1 ``(w, 1)``, b1 ``(w,)``, w2 ``(h, w)``, b2 ``(h,)``; returns ``(n, h)``.
    """
    return torch.addmm(b2, torch.relu(fire_hidden(x, w1, b1)), w2.t())


class _BlockedMLP(torch.autograd.Function):
    """``f_θ`` over every element of ``x``, ``block`` elements at a time; the backward recomputes
    each block's hidden layer (memory ``O(block·w)``, never ``O(x.numel()·w)``)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, block):  # type: ignore[override]
        flat = x.reshape(-1)
        out = flat.new_empty(flat.numel(), w2.shape[0])
        for s in range(0, flat.numel(), block):
            out[s : s + block] = fire_mlp(flat[s : s + block], w1, b1, w2, b2)
        ctx.save_for_backward(x, w1, b1, w2, b2)
        ctx.block = block
        return out.view(*x.shape, w2.shape[0])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w1, b1, w2, b2 = ctx.saved_tensors
        flat, g = x.reshape(-1), grad.reshape(-1, w2.shape[0])
        gx = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        gw1, gb1 = torch.zeros_like(w1), torch.zeros_like(b1)
        gw2, gb2 = torch.zeros_like(w2), torch.zeros_like(b2)
        for s in range(0, flat.numel(), ctx.block):
            xs, gs = flat[s : s + ctx.block], g[s : s + ctx.block]
            pre = fire_hidden(xs, w1, b1)  # recomputed, (n, w)
            hidden = torch.relu(pre)
            gw2 += gs.t() @ hidden
            gb2 += gs.sum(0)
            gpre = (gs @ w2) * (pre > 0)  # (n, w)
            gw1 += (gpre.t() @ xs).unsqueeze(-1)
            gb1 += gpre.sum(0)
            if gx is not None:
                gx[s : s + ctx.block] = gpre @ w1.squeeze(-1)
        gx = None if gx is None else gx.view_as(x)
        return gx, gw1, gb1, gw2, gb2, None


def fire_bias(
    q_pos: Tensor,
    k_pos: Tensor,
    c: Tensor,
    threshold: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    *,
    block: int = 1 << 16,
) -> Tensor:
    """The FIRE bias of every pair for every head (causal attention).

    Args:
        q_pos: ``(b|1, i)`` integer query positions; k_pos: ``(b|1, j)`` key positions.
        c, threshold: scalars ``c`` and ``L`` (:func:`fire_inputs`).
        w1, b1, w2, b2: the MLP ``Linear(1, w)``, ReLU, ``Linear(w, h)``, in the compute dtype.
        block: the most pairs one MLP call sees (forward and backward).

    Returns:
        ``(b|1, h, i, j)`` in ``c``'s dtype (at least float32).
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    x = fire_inputs(q_pos, k_pos, c, threshold)  # (b, i, j)
    dtype = x.dtype
    out = _BlockedMLP.apply(x, *(t.to(dtype) for t in (w1, b1, w2, b2)), block)  # (b, i, j, h)
    return out.permute(0, 3, 1, 2)
