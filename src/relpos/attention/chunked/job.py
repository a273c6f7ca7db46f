"""One call of the ``chunked`` backend (:class:`Job`), and the contract of a band engine.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``d`` head dim, ``R`` rows of a relative
table.

A band engine computes attention restricted to the band ``lo < j - i < hi`` of ``job.band`` for a
relative scheme over contiguous positions (:class:`BandEngine`; the region path merges it with
the far parts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from ...positions import Positions
from ...schemes.base import DistanceBiasScheme, PairBiasScheme, RelativeScheme, Scheme
from .grads import GradSink
from .plan import TilePlan

if TYPE_CHECKING:
    from .geometry import Band

__all__ = ["BandBackward", "BandEngine", "FarField", "Job"]


@dataclass(frozen=True)
class FarField:
    """Where a clipped relative term is constant (the region path's far parts).

    The relative row is ``left_row`` for every ``j - i <= -left`` and ``right_row`` for every
    ``j - i >= right``; a width equal to the sequence length means no far part on that side.
    """

    left: int
    left_row: int
    right: int
    right_row: int


@dataclass
class Job:
    """Everything an engine needs besides ``q, k, v``.

    Attributes:
        plan: the general path's tiles (empty on the fast paths).
        params: the scheme's parameters that need gradients.
        far, far_rows, band, engine: the region path's far field, the relative rows whose
            per-query logit term the band reports, the band's geometry and the engine that runs
            it (:mod:`.narrow` in distance coordinates, or :mod:`.band` on tiles).
    """

    scheme: Scheme
    q_positions: Positions
    k_positions: Positions
    causal: bool
    scale: float
    plan: TilePlan = field(default_factory=lambda: TilePlan([], []))
    dropout_p: float = 0.0
    params: list[Tensor] = field(default_factory=list)
    far: FarField | None = None
    far_rows: list[int] = field(default_factory=list)
    band: Band | None = None
    engine: BandEngine | None = None

    def __post_init__(self) -> None:
        s = self.scheme
        relative = isinstance(s, RelativeScheme)
        self.has_bias = "score_bias" in s.hooks
        self.has_value = "value_term" in s.hooks
        #: the logit / value term comes in relative rows (gathered per tile, never (i, j))
        self.rel_bias = self.has_bias and relative
        self.rel_value = self.has_value and relative
        #: a key term in relative rows, ``relative_key_logits(k)`` (the only key_bias chunked runs)
        self.rel_key = "key_bias" in s.hooks and relative
        self.num_rel = s.num_relative if (self.rel_bias or self.rel_value or self.rel_key) else 0
        #: a function of the distance: one table over this call's distances, gathered per tile
        self.distance = self.has_bias and isinstance(s, DistanceBiasScheme)
        self.distance_lo = 0
        self.query_independent = (self.rel_bias and s.query_independent) or self.distance
        #: a query-dependent logit term of the form q·Eᵀ (+ c): keys read once per call
        self.keyed = self.rel_bias and not self.query_independent and s.has_relative_keys
        #: a per-pair kernel that reduces its own gradient (``pair_bias``; it may decline a call)
        self.pairwise = self.has_bias and isinstance(s, PairBiasScheme)

    def constant_logits(self, q: Tensor) -> Tensor:
        """The query-independent logit term ``(1|b, h, 1, R)``: T5's ``relative_logits``, or a
        distance scheme's table over this call's distances (``R`` of them from
        ``distance_lo``), with a graph to the parameters when grad mode is on."""
        if self.distance:
            self.distance_lo, table = self.scheme.distance_table(self.q_positions, self.k_positions)
            self.num_rel = table.shape[-1]
            return table.unsqueeze(0).unsqueeze(2)
        return self.scheme.relative_logits(q[:, :, :1])

    def tile_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """``(b|1, bi, bj)`` relative row of every pair of a tile (after :meth:`constant_logits`
        for a distance scheme)."""
        if self.distance:  # clamped: a pair with padding may lie outside the table (masked)
            index = q_positions.distance(k_positions) - self.distance_lo
            return index.clamp_(0, self.num_rel - 1)
        return self.scheme.relative_index(q_positions, k_positions)

    def tile_mask(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        """``(b|1, 1, bi, bj)`` bool: the pairs of a masked tile that may attend."""
        qp, kp = self.q_positions[i0:i1], self.k_positions[j0:j1]
        return qp.allowed(kp, causal=self.causal).unsqueeze(1)

    def value_term(self, mass: Tensor) -> Tensor:
        """The relative value term from the normalised mass per row, in ``mass``'s dtype."""
        return self.scheme.relative_value(mass).to(mass.dtype)

    def value_grads(self, mass: Tensor, do: Tensor, sink: GradSink) -> Tensor:
        """Gradient of the value term w.r.t. the mass; the table's gradient goes into ``sink``."""
        with torch.enable_grad():
            leaf = mass.detach().requires_grad_(True)
            term = self.scheme.relative_value(leaf)
        grads = torch.autograd.grad(term, [leaf, *self.params], do, allow_unused=True)
        sink.add(grads[1:])
        return torch.zeros_like(mass) if grads[0] is None else grads[0]


@dataclass
class BandBackward:
    """The inputs of a band's backward pass beyond ``q, k, v``.

    Attributes:
        do: ``(b, h, i, d)`` the output's gradient.
        lse: ``(b, h, i)`` the merged log-sum-exp of every part.
        delta: ``(b, h, i)`` ``rowsum(dO ⊙ O)``.
        dmass: ``(b, h, i, R)`` the gradient of the value term's mass, or None.
        far_grads: ``(b, h, i, len(job.far_rows))`` the far parts' share of the logit term's
            gradient at ``job.far_rows``, or None.
        needs_q: whether ``q`` needs a gradient through the relative term.
        sink: receives the scheme's parameter gradients.
        grads: ``(dq, dk, dv)``, added into in place.
    """

    do: Tensor
    lse: Tensor
    delta: Tensor
    dmass: Tensor | None
    far_grads: Tensor | None
    needs_q: bool
    sink: GradSink
    grads: tuple[Tensor, Tensor, Tensor]


class BandEngine(Protocol):
    """A band engine: a module with these two functions (:mod:`.narrow`, :mod:`.band`)."""

    def forward(self, job: Job, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
        """The band's attention, normalised over the band.

        Returns ``lse (b, h, i)`` and ``out (b, h, i, d)``; with a value term ``mass (b, h, i,
        R)`` (attention mass per relative row); with ``job.far_rows``, ``cols (1|b, h, i,
        len(far_rows))``: the logit term at those rows.
        """
        ...

    def backward(self, job: Job, q: Tensor, k: Tensor, v: Tensor, grad: BandBackward) -> None:
        """Add the band's gradients into ``grad.grads`` and ``grad.sink``, recomputed from the
        final ``grad.lse``."""
        ...
