"""ALiBi: attention with linear biases (Press et al., 2022, "Train Short, Test Long", §3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .dtypes import compute_dtype

__all__ = ["alibi_bias", "alibi_slopes"]


def _power_of_two_slopes(n: int) -> list[float]:
    # Geometric sequence starting at 2^(-8/n) with the same ratio (the paper's choice).
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int, given: tuple[float, ...] | None = None) -> Tensor:
    """Per-head slopes, float32, shape ``(h,)``: ``given`` (one per head), or the paper's.

    For a power of two ``n``: ``2^(-8/n), 2^(-16/n), …``. Otherwise (the paper's recipe): the slopes
    of the nearest lower power of two ``p``, then every other slope of ``2p`` for the remaining
    heads.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if given is not None:
        if len(given) != num_heads:
            raise ValueError(f"slopes has {len(given)} entries; the layer has {num_heads} heads")
        return torch.tensor(given, dtype=torch.float32)
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(p)
    if p < num_heads:
        slopes += _power_of_two_slopes(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: Tensor, distance: Tensor, *, causal: bool) -> Tensor:
    """Linear bias ``-slope · |k_pos - q_pos|``.

    Causal: ``slope · (k_pos - q_pos)`` (non-positive for the keys a query may see). Bidirectional:
    the symmetric ``-slope · |k_pos - q_pos|``.

    Shapes:
        slopes: ``(h,)``; distance: ``(b, i, j)``; returns ``(b, h, i, j)`` in at least float32.
    """
    dtype = compute_dtype(slopes.dtype)
    d = distance.to(dtype).unsqueeze(1)
    d = d if causal else -d.abs()
    return slopes.to(dtype).view(1, -1, 1, 1) * d
