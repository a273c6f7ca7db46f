"""xPos: rotary embedding with an exponential decay (Sun et al., 2022, "A Length-Extrapolatable
Transformer", §3.2).

Rotary pair ``m`` of a query at position ``n`` is scaled by ``ζ_m^(n/γ)`` and of a key at position
``m'`` by ``ζ_m^(-m'/γ)``, so their product carries ``ζ_m^((n-m')/γ)``: a decay with the distance
that depends on the distance only. ``ζ_m = (2m/r + 0.4) / 1.4`` lies in ``[0.29, 1)``: fast
rotations decay most. ``γ`` is the scale base (512 in the paper).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["check_xpos_position", "xpos_decay", "xpos_max_position", "xpos_scale"]

_GAMMA = 0.4  # ζ's offset in the paper


def xpos_decay(rotary_dim: int) -> Tensor:
    """``ζ_m = (2m/r + 0.4)/1.4`` per rotated pair, float32 ``(r/2,)``."""
    m = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return ((m + _GAMMA) / (1 + _GAMMA)).to(torch.float32)


def xpos_scale(pos: Tensor, decay: Tensor, scale_base: float, *, inverse: bool = False) -> Tensor:
    """``ζ_m^(p/γ)`` (queries) or ``ζ_m^(-p/γ)`` (keys, ``inverse=True``), float32 ``(..., n, r/2)``
    for positions ``pos (..., n)``."""
    exponent = pos.to(torch.float32).unsqueeze(-1) / scale_base
    log = decay.to(device=pos.device).log()
    return (exponent * (-log if inverse else log)).exp()


def xpos_max_position(dtype: torch.dtype, scale_base: float) -> int:
    """The largest position whose xPos scales stay within ``dtype``'s range with room to spare:
    ``ζ_0^(±p/γ)`` between ``1/√max`` and ``√max`` (so scaled queries and keys neither overflow nor
    lose precision to underflow); ``ζ_0 = 0.4/1.4`` whatever the width."""
    room = math.log(torch.finfo(dtype).max) / 2
    return int(room * scale_base / -math.log(_GAMMA / (1 + _GAMMA)))


def check_xpos_position(largest: int, dtype: torch.dtype | str, scale_base: float) -> None:
    """Raise a ``ValueError`` if a position of magnitude ``largest`` is beyond
    :func:`xpos_max_position` for ``dtype`` (a torch dtype or its name, as Keras gives it): its
    xPos scales would overflow."""
    limit = xpos_max_position(
        getattr(torch, dtype) if isinstance(dtype, str) else dtype, scale_base
    )
    if largest > limit:
        raise ValueError(
            f"xPos scales overflow {dtype} beyond position {limit} (xpos_scale_base={scale_base}); "
            f"got position {largest}: use float32 or bfloat16, or a larger xpos_scale_base"
        )
