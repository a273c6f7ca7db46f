"""KERPLE: kernelized relative positional biases (Chi et al., 2022, "KERPLE: Kernelized Relative
Positional Embedding for Length Extrapolation", §4).

A conditionally positive definite kernel of the distance, shifted, becomes a logit bias:

* logarithmic: ``-r1·log(1 + r2·|Δ|)``;
* power: ``-r1·|Δ|^r2`` with ``0 < r2 <= 2``;

with ``r1, r2 > 0`` learned per head. Both are 0 at distance 0 and decrease with ``|Δ|``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.kerple import KERPLE_VARIANTS

__all__ = ["KERPLE_VARIANTS", "kerple_bias"]


def kerple_bias(distance: Tensor, r1: Tensor, r2: Tensor, *, variant: str = "log") -> Tensor:
    """The KERPLE bias of every distance for every head.

    Args:
        distance: ``(D,)`` integer signed distances ``p_j - p_i``.
        r1, r2: ``(h,)`` positive parameters (the caller keeps them in range).
        variant: ``"log"`` or ``"power"``.

    Returns:
        ``(h, D)`` in ``r1``'s dtype.
    """
    if variant not in KERPLE_VARIANTS:
        raise ValueError(f"variant must be one of {KERPLE_VARIANTS}, got {variant!r}")
    d = distance.abs().to(r1.dtype).unsqueeze(0)  # (1, D)
    r1, r2 = r1.unsqueeze(-1), r2.unsqueeze(-1)  # (h, 1)
    if variant == "log":
        return -r1 * torch.log1p(r2 * d)
    return -r1 * d.pow(r2)
