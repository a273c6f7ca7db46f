"""ALiBi: attention with linear biases (Press et al., 2022, "Train Short, Test Long", §3)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.alibi import alibi_slopes as spec_alibi_slopes
from .dtypes import compute_dtype

__all__ = ["alibi_bias", "alibi_slopes"]


def alibi_slopes(num_heads: int, given: tuple[float, ...] | None = None) -> Tensor:
    """Per-head slopes, float32 ``(h,)``: ``given`` (one per head), or the paper's geometric
    sequence (:func:`relpos.spec.alibi.alibi_slopes`, as a tensor)."""
    return torch.from_numpy(spec_alibi_slopes(num_heads, given))


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
