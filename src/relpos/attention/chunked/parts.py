"""Key parts of a query block for the fused kernel, merged by log-sum-exp (``chunked``'s ALiBi
and forget-gate paths).

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim; ``bi`` queries
in one block.

A query block's keys split into parts whose logit term is a per-key row (a ``(b|1, h, 1, keys)``
mask) plus a per-query constant (added to the part's log-sum-exp), and a diagonal part with the
exact bias; each part is one call of the stock fused kernel (per run of heads that attend the
same keys), and the parts merge by log-sum-exp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import block_bounds, flash, flash_backward

__all__ = [
    "Part",
    "Span",
    "attend_blocks",
    "attend_part",
    "attend_parts",
    "backward_part",
    "head_spans",
    "merge_part",
]


@dataclass
class Span:
    """Heads ``[h0, h1)`` of a part attend keys ``[j0, j1)`` (``j0 == j1``: none)."""

    h0: int
    h1: int
    j0: int
    j1: int


@dataclass
class Part:
    """One key range of a query block: ``mask`` and ``const`` cover keys from ``start`` on."""

    spans: list[Span]
    start: int
    mask: Tensor  # (1, h, 1|bi, keys)
    const: Tensor | None  # (1, h, bi) per-query constant; None: the diagonal part
    causal: bool

    def call_mask(self, s: Span) -> Tensor:
        return self.mask[:, s.h0 : s.h1, :, s.j0 - self.start : s.j1 - self.start]


def head_spans(lo: list[int], hi: list[int]) -> list[Span]:
    """Runs of consecutive heads with the same key range ``[lo[h], hi[h])``."""
    spans: list[Span] = []
    for h, (j0, j1) in enumerate(zip(lo, hi, strict=True)):
        if spans and (spans[-1].j0, spans[-1].j1) == (j0, j1):
            spans[-1].h1 = h + 1
        else:
            spans.append(Span(h, h + 1, j0, j1))
    return spans


def attend_part(part: Part, q: Tensor, k: Tensor, v: Tensor, rows: slice, scale: float):
    """``(out (b, h, bi, d), lse (b, h, bi))`` of one part (``lse = -inf``: heads without keys)."""
    if len(part.spans) == 1 and part.spans[0].j1 > part.spans[0].j0:
        s = part.spans[0]  # every head the same keys: one call, no copy
        return flash(
            q[:, :, rows], k[:, :, s.j0 : s.j1], v[:, :, s.j0 : s.j1], 0.0, part.causal,
            attn_mask=part.call_mask(s), scale=scale,
        )  # fmt: skip
    b, h, _, d = q.shape
    bi = rows.stop - rows.start
    o, lse = q.new_zeros(b, h, bi, d), q.new_full((b, h, bi), -math.inf)
    for s in part.spans:
        if s.j1 > s.j0:
            hs, js = slice(s.h0, s.h1), slice(s.j0, s.j1)
            o[:, hs], lse[:, hs] = flash(
                q[:, hs, rows], k[:, hs, js], v[:, hs, js], 0.0, part.causal,
                attn_mask=part.call_mask(s), scale=scale,
            )  # fmt: skip
    return o, lse


def merge_part(
    o: Tensor, lse: Tensor, part: Part, q: Tensor, k: Tensor, v: Tensor, rows: slice, scale: float
) -> tuple[Tensor, Tensor]:
    """Fold ``part`` (with its per-query constant) into the running ``(o, lse)`` of a block: a
    part ``(o_p, l_p)`` weighs ``w = exp(l_p - logaddexp(lse, l_p))`` and ``o += w·(o_p - o)``."""
    o_p, l_p = attend_part(part, q, k, v, rows, scale)
    l_p = l_p + part.const
    total = torch.logaddexp(lse, l_p)
    return torch.lerp(o, o_p, torch.exp(l_p - total).unsqueeze(-1)), total


def attend_parts(
    parts: list[Part], q: Tensor, k: Tensor, v: Tensor, rows: slice, scale: float
) -> tuple[Tensor, Tensor]:
    """``(o, lse)`` of a query block over all its parts: the first (the diagonal, whose lse is
    finite) attended, each other one merged in by log-sum-exp (:func:`merge_part`)."""
    first, *rest = parts
    o, lse = attend_part(first, q, k, v, rows, scale)
    for part in rest:
        o, lse = merge_part(o, lse, part, q, k, v, rows, scale)
    return o, lse


def attend_blocks(
    parts_of: Callable[[int, int, int], list[Part]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of every query block of ``block`` rows: block ``c``, rows ``[i0, i1)``,
    attends its parts ``parts_of(c, i0, i1)`` (:func:`attend_parts`).

    Shapes: q ``(b, h, i, d)``; returns ``(b, h, i, d)`` and ``(b, h, i)``.
    """
    b, h, n, _ = q.shape
    out, lse = torch.empty_like(q), q.new_empty(b, h, n)
    for c, (i0, i1) in enumerate(block_bounds(0, n, block)):
        rows = slice(i0, i1)
        out[:, :, rows], lse[:, :, rows] = attend_parts(parts_of(c, i0, i1), q, k, v, rows, scale)
    return out, lse


def backward_part(
    part: Part,
    do: Tensor,
    q: Tensor,
    o: Tensor,
    lse: Tensor,
    k: Tensor,
    v: Tensor,
    rows: slice,
    scale: float,
    grads: tuple[Tensor, Tensor, Tensor],
) -> Iterator[tuple[Span, Tensor]]:
    """The fused backward pass of one part of the query block ``rows``: adds each span's
    gradients into ``grads = (dq, dk, dv)`` (their ``d`` columns) and yields the span with its
    full key gradient, whose extra columns (past ``d``) carry what a caller appended to ``q``.

    Shapes: do, q, o ``(b, h, bi, d+)`` (the block's rows); lse ``(b, h, i)`` (every row); k, v
    ``(b, h, j, d+)``; dq ``(b, h, i, d)``, dk, dv ``(b, h, j, d)``.
    """
    dq, dk, dv = grads
    d = dq.shape[-1]
    lse_p = lse[:, :, rows] if part.const is None else lse[:, :, rows] - part.const
    lse_p = lse_p.contiguous()
    for s in part.spans:
        if s.j1 == s.j0:  # every key of this part is out of reach for these heads
            continue
        hs, js = slice(s.h0, s.h1), slice(s.j0, s.j1)
        gq, gk, gv = flash_backward(
            do[:, hs], q[:, hs], k[:, hs, js], v[:, hs, js], o[:, hs], lse_p[:, hs], 0.0,
            part.causal, attn_mask=part.call_mask(s), scale=scale,
        )  # fmt: skip
        dq[:, hs, rows] += gq[..., :d]
        dk[:, hs, js] += gk[..., :d]
        dv[:, hs, js] += gv[..., :d]
        yield s, gk
