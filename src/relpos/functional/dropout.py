"""Dropout with a cheap mask on the CPU.

On the CPU, torch draws a dropout mask with ``bernoulli_`` on a float tensor, which for one
attention layer of the JSB recipe (8 × 4 heads × 512² probabilities) costs more than the layer's
matmuls. Reading the mask off uniform 16-bit integers (four per ``random_`` int64 word) is several
times cheaper (``benchmarks/dropout_mask.py``). The rate is then ``p`` rounded to a multiple of
1/65536, and the kept values are scaled by ``1 / (1 - rounded p)``, so the expectation is exact.
Elsewhere (CUDA) torch's own fused dropout is already cheap and is used as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Dropout", "drop_mask", "dropout"]

_CODES = 1 << 16  # values of one 16-bit lane


def drop_mask(
    shape: torch.Size | tuple[int, ...], p: float, device: torch.device
) -> tuple[Tensor, float]:
    """A mask of dropped elements and the scale for the kept ones.

    Args:
        shape: the mask's shape.
        p: the drop rate, in ``[0, 1)``; on the CPU it is rounded to a multiple of 1/65536.
        device: where to draw the mask (from that device's default generator).

    Returns:
        ``(drop, scale)``: ``drop`` is a bool tensor of ``shape``, True where an element is
        dropped, each independently with the (rounded) rate; ``scale = 1 / (1 - rate)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p}")
    if torch.device(device).type != "cpu":
        return torch.rand(shape, device=device) < p, 1.0 / (1.0 - p)
    dropped = min(round(p * _CODES), _CODES - 1)  # how many of the 65536 codes drop
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64)
    words.random_(torch.iinfo(torch.int64).min, None)  # every bit uniform
    lanes = words.view(torch.int16)[:n].view(shape)  # uniform on [-32768, 32767]
    return lanes < dropped - _CODES // 2, _CODES / (_CODES - dropped)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout`` with :func:`drop_mask`'s cheap mask on the CPU (same expectation)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    drop, scale = drop_mask(x.shape, p, x.device)
    return torch.where(drop, 0.0, x) * scale


class Dropout(nn.Dropout):
    """``nn.Dropout`` through :func:`dropout` (a cheaper mask on the CPU)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
