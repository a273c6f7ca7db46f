"""A score bias that a kernel computes tile by tile and differentiates itself.

Shape legend: ``b`` batch, ``h`` heads, ``bi``/``bj`` the queries/keys of one tile.

The ``chunked`` tile engine adds a bias to each ``(b, h, bi, bj)`` tile of logits and, backward,
needs the bias's gradient with respect to the scheme's parameters. A bias evaluated per pair (FIRE:
it depends on the query's position as well as the distance) would otherwise cost a graph and an
``autograd.grad`` per tile. A :class:`PairBias` is built once per call from a few small tensors
(:attr:`~PairBias.inputs`, with a graph to the parameters when grad mode is on). Its kernel adds a
tile's bias into the logits in place, and adds the tile's share of each input's gradient into
buffers; the engine pushes those sums through the graph once per call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

__all__ = ["PairBias"]


class PairBias(ABC):
    """One call's bias over pairs of queries and keys (module docstring).

    ``rows = (i0, i1)`` and ``cols = (j0, j1)`` pick a tile: queries ``i0 … i1 - 1`` and keys
    ``j0 … j1 - 1`` of the positions the bias was built for.
    """

    #: The small tensors the bias is computed from (the gradients of :meth:`grads` match them).
    inputs: tuple[Tensor, ...]

    @abstractmethod
    def add_(self, s: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Add the tile's bias to the logits ``s (b, h, bi, bj)`` in place."""

    @abstractmethod
    def backward(self, grad: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Add the tile's share of every input's gradient, given ``grad (b, h, bi, bj)``, the
        gradient of the tile's bias."""

    @abstractmethod
    def grads(self) -> tuple[Tensor, ...]:
        """The gradients summed by :meth:`backward` since the last call, one per input in its
        dtype (zeros where no tile added any: the bias took part in the call), and start again
        from zero."""
