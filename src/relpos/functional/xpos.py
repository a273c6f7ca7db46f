"""xPos: rotary embedding with an exponential decay (Sun et al., 2022, "A Length-Extrapolatable
Transformer", §3.2).

Rotary pair ``m`` of a query at position ``n`` is scaled by ``ζ_m^(n/γ)`` and of a key at position
``m'`` by ``ζ_m^(-m'/γ)``, so their product carries ``ζ_m^((n-m')/γ)``: a decay with the distance
that depends on the distance only. ``ζ_m = (2m/r + 0.4) / 1.4`` lies in ``[0.29, 1)``: fast
rotations decay most. ``γ`` is the scale base (512 in the paper).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.rope import check_xpos_position, xpos_max_position
from ..spec.rope import xpos_decay as spec_xpos_decay

__all__ = ["check_xpos_position", "xpos_decay", "xpos_max_position", "xpos_scale"]


def xpos_decay(rotary_dim: int) -> Tensor:
    """``ζ_m = (2m/r + 0.4)/1.4`` per rotated pair, float32 ``(r/2,)``
    (:func:`relpos.spec.rope.xpos_decay`, as a tensor)."""
    return torch.from_numpy(spec_xpos_decay(rotary_dim))


def xpos_scale(pos: Tensor, decay: Tensor, scale_base: float, *, inverse: bool = False) -> Tensor:
    """``ζ_m^(p/γ)`` (queries) or ``ζ_m^(-p/γ)`` (keys, ``inverse=True``), float32 ``(..., n, r/2)``
    for positions ``pos (..., n)``."""
    exponent = pos.to(torch.float32).unsqueeze(-1) / scale_base
    log = decay.to(device=pos.device).log()
    return (exponent * (-log if inverse else log)).exp()
