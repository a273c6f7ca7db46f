"""A band's relative logit term and its gradients, shared by both band engines.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``d`` head dim, ``R`` rows of a relative
table, ``D`` distances in the band.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...schemes.base import RelativeScheme
from .geometry import Band
from .grads import push_grad
from .job import BandBackward, Job

__all__ = ["KeyedTerm", "RelativeTerm", "finish_relative_grads", "keys_grad"]


def _distance_keys(scheme: RelativeScheme, band: Band, dtype: torch.dtype, far_rows: list[int]):
    """``((keys (h|1, D, d), keys of far_rows (h|1, len, d) | None), (row bias (h|1, D, 1),
    of far_rows (h|1, len, 1) | None) | None)``: the relative keys and their constant per row
    in distance coordinates; only the rows the band and the far parts read."""
    near = scheme.relative_keys_at(band.rows if band.rows is not None else band.lut, dtype)
    far = scheme.relative_keys_at(far_rows, dtype) if far_rows else None
    near_bias = scheme.relative_row_bias(near)
    if near_bias is None:
        return (near, far), None
    far_bias = None if far is None else scheme.relative_row_bias(far).unsqueeze(-1)
    return (near, far), (near_bias.unsqueeze(-1), far_bias)


def keys_grad(drel: Tensor, q: Tensor) -> Tensor:
    """``Σ_batch drelᵀ·q``: the gradient ``(h, r, d)`` of relative keys from a term's gradient
    ``drel (n, h, i, r)`` for queries ``q (n, h, i, d)``. A batched product reads both transposed
    in place; an einsum over ``n`` and ``i`` copies ``drel`` first."""
    return torch.matmul(drel.transpose(-1, -2), q).sum(0)


class RelativeTerm:
    """A band's logit term and its gradients, shared by the band engines (this module's and
    :mod:`.narrow`'s).

    Either query-independent (T5: ``rel (1|b, h, 1, R)``, in distance coordinates ``lin (1|b, h,
    1, D)``) or ``q·Eᵀ`` (``keys (h|1, D, d)`` in distance coordinates) plus, where the scheme has
    one, a constant per row (``row_bias (h|1, D)``: Transformer-XL), or absent. With ``grads``,
    the term keeps its graph to the scheme's parameters and accumulates their gradient in
    distance coordinates (``drel_lin``, or ``dkeys`` and ``drow_bias``) for
    :func:`finish_relative_grads`.

    Attributes:
        cols: the term at ``far_rows`` for every query, ``(1|b, h, i, len(far_rows))`` (forward).
    """

    def __init__(self, job: Job, q: Tensor, *, grads: bool) -> None:
        _, h, n, d = q.shape
        scheme, band, has_bias, far_rows = job.scheme, job.band, job.rel_bias, job.far_rows
        self.const_rel = self.lin = self.keys = self.keys_g = self.cols = None
        self.row_bias = self.row_bias_g = self.drel_lin = self.dkeys = self.drow_bias = None
        if job.query_independent:  # T5
            with torch.set_grad_enabled(grads):
                # (1|b, h, 1, R), in q's dtype as eager adds it (the table may be another)
                self.const_rel = scheme.relative_logits(q[:, :, :1]).to(q.dtype)
            self.lin = band.to_distance(self.const_rel.detach())
            if grads and self.const_rel.requires_grad:
                self.drel_lin = q.new_zeros(1, h, 1, band.width)
            if not grads and far_rows:
                self.cols = self.const_rel[..., far_rows].expand(-1, -1, n, -1)
        elif has_bias:  # q·Eᵀ (+ c)
            with torch.set_grad_enabled(grads):
                self.keys_g, self.row_bias_g = _distance_keys(scheme, band, q.dtype, far_rows)
            self.keys = self.keys_g[0].detach()
            if grads and self.keys_g[0].requires_grad:
                self.dkeys = q.new_zeros(h, band.width, d)
            if self.row_bias_g is not None:
                self.row_bias = self.row_bias_g[0].detach().squeeze(-1)  # (h|1, D)
                if grads and self.row_bias_g[0].requires_grad:
                    self.drow_bias = q.new_zeros(h, band.width)
            if not grads and self.keys_g[1] is not None:
                self.cols = torch.matmul(q, self.keys_g[1].transpose(-1, -2))
                if self.row_bias_g is not None:
                    self.cols += self.row_bias_g[1].squeeze(-1).unsqueeze(-2)

    def _keys(self, h0: int, h1: int) -> Tensor:
        return self.keys if self.keys.shape[0] == 1 else self.keys[h0:h1]

    def row_bias_of(self, h0: int, h1: int) -> Tensor | None:
        """The constant per row of heads ``[h0, h1)``, ``(hc|1, 1, D)`` (it broadcasts over
        queries), or None."""
        if self.row_bias is None:
            return None
        rows = self.row_bias if self.row_bias.shape[0] == 1 else self.row_bias[h0:h1]
        return rows.unsqueeze(-2)

    def add_row_bias_grads(self, ds: Tensor, h0: int, h1: int, t0: int = 0) -> None:
        """Accumulate the row constant's gradient from ``ds (n, hc, i, t)``, distance columns
        ``[t0, t0 + t)``: its sum over the batch and queries."""
        if self.drow_bias is not None:
            self.drow_bias[h0:h1, t0 : t0 + ds.shape[-1]] += ds.sum((0, 2))

    def term(
        self, qc: Tensor, b0: int, b1: int, h0: int, h1: int, *, out: Tensor | None = None
    ) -> Tensor | None:
        """The term of rows ``[b0, b1) × [h0, h1)`` in distance coordinates: ``q·Eᵀ`` as a
        ``(bc, hc, i, D)`` tensor (new, or written into ``out``), T5's ``(1|bc, hc, 1, D)`` view,
        or None."""
        if self.keys is not None:
            term = torch.matmul(qc, self._keys(h0, h1).transpose(-1, -2), out=out)
            bias = self.row_bias_of(h0, h1)
            return term if bias is None else term.add_(bias)
        if self.lin is not None:
            lin = self.lin if self.lin.shape[0] == 1 else self.lin[b0:b1]
            return lin[:, h0:h1]
        return None

    def add_grads(
        self, ds: Tensor, qc: Tensor, dqc: Tensor, h0: int, h1: int, needs_q: bool
    ) -> None:
        """Accumulate the term's gradient from ``ds (bc, hc, i, D)``, the score gradient in
        distance coordinates of queries ``qc``; ``dq·E`` into ``dqc`` for a ``q·Eᵀ`` term."""
        if self.keys is not None:
            if needs_q:
                dqc += torch.matmul(ds, self._keys(h0, h1))
            if self.dkeys is not None:
                self.dkeys[h0:h1] += keys_grad(ds, qc)
            self.add_row_bias_grads(ds, h0, h1)
        elif self.drel_lin is not None:
            self.drel_lin[0, h0:h1, 0] += ds.sum((0, 2))


def finish_relative_grads(term: RelativeTerm, job: Job, q: Tensor, grad: BandBackward) -> None:
    """Push the accumulated gradient of the term (band distances plus ``grad.far_grads``, the far
    rows' share) through the scheme once: into ``dq`` for ``q·Eᵀ``'s far rows and into
    ``grad.sink`` for the parameters."""
    band, far_rows, far_grads, needs_q = job.band, job.far_rows, grad.far_grads, grad.needs_q
    dq, sink = grad.grads[0], grad.sink
    if term.drel_lin is not None:  # (1, h, 1, D) → (1, h, 1, R)
        drel = band.to_rows(term.drel_lin, job.num_rel)
        if far_grads is not None:
            drel[..., far_rows] += far_grads.sum((0, 2), keepdim=True)
        push_grad(term.const_rel, drel, None, None, sink)
    if term.keys_g is not None:
        near, far = term.keys_g
        outs, outs_grads = [], []
        if term.dkeys is not None:
            outs.append(near)
            outs_grads.append(term.dkeys)
        if far is not None and far_grads is not None:
            if needs_q:
                dq += torch.matmul(far_grads, far.detach())
            if term.dkeys is not None:
                outs.append(far)
                outs_grads.append(keys_grad(far_grads, q))
        if term.drow_bias is not None:
            bias_near, bias_far = term.row_bias_g
            outs.append(bias_near)
            outs_grads.append(term.drow_bias.unsqueeze(-1))
            if bias_far is not None and far_grads is not None:
                outs.append(bias_far)
                outs_grads.append(far_grads.sum((0, 2)).unsqueeze(-1))
        if outs:  # one pass through relative_keys (and relative_row_bias) for all
            grads_ = [_sum_heads(g, t) for g, t in zip(outs_grads, outs, strict=True)]
            push_grad(outs, grads_, None, None, sink)


class KeyedTerm:
    """A ``q·Eᵀ`` logit term (plus ``relative_row_bias``) for the general tiles: the keys are
    computed once per call, the term per query block; backward, the gradients of the keys and
    the row constant are summed over the blocks and pushed through the scheme once (instead of
    ``relative_logits``' graph once per block).

    Shapes: keys ``(h|1, R, d)``, row bias ``(h|1, R)``; a block's term ``(b, h, bi, R)``.
    """

    def __init__(self, scheme: RelativeScheme, dtype: torch.dtype, *, grads: bool) -> None:
        with torch.set_grad_enabled(grads):
            self.keys_g = scheme.relative_keys(dtype)
            self.bias_g = scheme.relative_row_bias(self.keys_g)
        self.keys = self.keys_g.detach()
        self.bias = None if self.bias_g is None else self.bias_g.detach().unsqueeze(-2)
        self.dkeys = self.dbias = None
        if grads and self.keys_g.requires_grad:
            self.dkeys = torch.zeros_like(self.keys)
        if grads and self.bias_g is not None and self.bias_g.requires_grad:
            self.dbias = torch.zeros_like(self.bias_g.detach())

    def logits(self, qb: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """The term of the queries ``qb (b, h, bi, d)`` at rows ``[lo, hi)``:
        ``(b, h, bi, hi - lo)``."""
        rel = torch.matmul(qb, self.keys[:, lo:hi].transpose(-1, -2))
        return rel if self.bias is None else rel.add_(self.bias[..., lo:hi])

    def needs_grads(self, needs_q: bool) -> bool:
        return needs_q or self.dkeys is not None or self.dbias is not None

    def add_grads(self, drel: Tensor, qb: Tensor, dqb: Tensor, needs_q: bool, lo: int = 0) -> None:
        """Accumulate from ``drel (b, h, bi, r)``, the term's gradient at rows ``[lo, lo + r)``
        for queries ``qb``: ``drel·E`` into ``dqb``, ``drelᵀ·q`` into the keys', its sum into the
        row constant's."""
        hi = lo + drel.shape[-1]
        if needs_q:
            dqb += torch.matmul(drel, self.keys[:, lo:hi])
        if self.dkeys is not None:
            self.dkeys[:, lo:hi] += _sum_heads(keys_grad(drel, qb), self.dkeys)
        if self.dbias is not None:
            self.dbias[:, lo:hi] += _sum_heads(drel.sum((0, 2)), self.dbias)

    def push(self, sink) -> None:
        """Push the summed gradients through ``relative_keys`` and ``relative_row_bias``."""
        pairs = [(self.keys_g, self.dkeys), (self.bias_g, self.dbias)]
        kept = [(t, g) for t, g in pairs if g is not None]
        if kept:
            push_grad([t for t, _ in kept], [g for _, g in kept], None, None, sink)


def _sum_heads(grad: Tensor, like: Tensor) -> Tensor:
    """A per-head gradient ``(h, .., ..)`` summed to a shared table's ``(1, .., ..)``."""
    return grad.sum(0, keepdim=True) if like.shape[0] == 1 and grad.shape[0] != 1 else grad
