"""Sinusoidal position encodings (Vaswani et al., 2017, "Attention Is All You Need", §3.5)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.absolute import sinusoid_frequencies as spec_frequencies

__all__ = ["sinusoid_frequencies", "sinusoidal_table"]


def sinusoid_frequencies(dim: int, base: float = 10000.0, device=None) -> Tensor:
    """Angular frequencies ``base^(-2i/dim)``, float32, shape ``(dim/2,)``
    (:func:`relpos.spec.absolute.sinusoid_frequencies`, as a tensor)."""
    return torch.from_numpy(spec_frequencies(dim, base)).to(device)


def sinusoidal_table(
    pos: Tensor, dim: int, *, base: float = 10000.0, interleaved: bool = True
) -> Tensor:
    """Sinusoidal encodings of integer positions.

    ``PE[p, 2i] = sin(p·ω_i)``, ``PE[p, 2i+1] = cos(p·ω_i)`` with ``ω_i = base^(-2i/dim)``
    (``interleaved=True``, the paper's layout), or ``[sin(p·ω), cos(p·ω)]`` as two concatenated
    halves (``interleaved=False``, the layout of tensor2tensor and many later codebases).

    Args:
        pos: integer positions, any shape ``(...)``.
        dim: encoding width, even.

    Returns:
        float32 tensor of shape ``(..., dim)``. Angles are computed in float32.
    """
    freqs = sinusoid_frequencies(dim, base, device=pos.device)
    angles = pos.to(torch.float32).unsqueeze(-1) * freqs  # (..., dim/2)
    sin, cos = angles.sin(), angles.cos()
    if interleaved:
        return torch.stack([sin, cos], dim=-1).flatten(-2)
    return torch.cat([sin, cos], dim=-1)
