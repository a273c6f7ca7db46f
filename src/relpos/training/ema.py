"""An exponential moving average of a model's weights, for evaluation."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["WeightAverage", "ema_decay_at"]


def ema_decay_at(update: int, decay: float) -> float:
    """The decay of the ``update``-th average (1-based): ``min(decay, (1 + t) / (10 + t))``.

    The ramp (TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``) keeps the first
    updates from being dominated by the initial, untrained weights.
    """
    return min(decay, (1.0 + update) / (10.0 + update))


class WeightAverage:
    """``avg ← d·avg + (1 − d)·w`` after every optimiser step, ``d`` = :func:`ema_decay_at`.

    Holds a copy of the model (no gradients, eval mode) whose floating parameters and buffers are
    the averages; integer buffers are copied. Evaluate ``average.model``; checkpoint
    :meth:`state_dict`.

    Args:
        model: the model being trained (its current weights start the average).
        decay: the largest decay, in ``(0, 1)``; e.g. 0.999 averages over ~1000 steps.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold ``model``'s current weights into the average."""
        self.updates += 1
        d = ema_decay_at(self.updates, self.decay)
        current = model.state_dict()
        for name, avg in self.model.state_dict().items():
            w = current[name]
            if avg.is_floating_point():
                avg.lerp_(w.to(avg.dtype), 1.0 - d)
            else:
                avg.copy_(w)

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "model": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        self.model.load_state_dict(state["model"])
