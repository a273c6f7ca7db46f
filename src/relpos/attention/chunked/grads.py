"""Gradients of a scheme's parameters inside a custom backward pass (``chunked`` and its band).

The tiled backward passes compute ``dS`` themselves and push each block's share of it through the
scheme's differentiable term (``relative_logits`` or ``score_bias``) with ``torch.autograd.grad``;
:class:`GradSink` sums those shares per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["GradSink", "push_grad"]


class GradSink:
    """Accumulates gradients of the scheme's parameters."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.grads: list[Tensor | None] = [None] * len(params)

    def add(self, grads: tuple[Tensor | None, ...]) -> None:
        for t, g in enumerate(grads):
            if g is not None:
                self.grads[t] = g if self.grads[t] is None else self.grads[t] + g

    def result(self) -> list[Tensor | None]:
        """The sums, each in its parameter's dtype (None where a parameter got none)."""
        return [
            None if g is None else g.to(p.dtype)
            for g, p in zip(self.grads, self.params, strict=True)
        ]


def push_grad(
    out: Tensor | Sequence[Tensor],
    grad: Tensor | Sequence[Tensor],
    q_leaf: Tensor | None,
    dq: Tensor | None,
    sink: GradSink,
) -> None:
    """Back-propagate ``grad`` from ``out`` (one tensor, or several with one gradient each) into
    ``q_leaf`` (added in place to ``dq``, a view of the query gradient) and into the parameters
    (into ``sink``)."""
    inputs = ([q_leaf] if q_leaf is not None else []) + sink.params
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    if q_leaf is not None:
        if grads[0] is not None:
            dq += grads[0]
        grads = grads[1:]
    sink.add(grads)
