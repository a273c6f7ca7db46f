"""Sandwich: a parameter-free bias from sinusoidal embeddings of the positions (Chi, Fan, Rudnicky
and Ramadge, 2023, "Dissecting Transformer Length Extrapolation via the Lens of Receptive Field
Analysis", §5).

The inner product of two sinusoidal embeddings of width ``d̄`` depends on the distance only:

    p_m·p_n = Σ_{k=1}^{d̄/2} cos((m - n) / base^{2k/d̄}).

Sandwich shifts it by ``-d̄/2`` (0 at distance 0, negative elsewhere: the bias decays roughly
logarithmically, then oscillates) and compresses it per head, dividing head ``h = 1..H`` by
``8h/H`` (ALiBi's head-wise ratios), as in the reference implementation (NVIDIA NeMo's
``SandwichRelativePositionEmbedding``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.sandwich import sandwich_head_scales as spec_head_scales

__all__ = ["sandwich_bias", "sandwich_head_scales"]


def sandwich_head_scales(num_heads: int) -> Tensor:
    """Each head's divisor ``8h/H`` for ``h = 1..H``, float64 ``(H,)``
    (:func:`relpos.spec.sandwich.sandwich_head_scales`, as a tensor)."""
    return torch.from_numpy(spec_head_scales(num_heads))


def sandwich_bias(
    distance: Tensor, scales: Tensor, *, dim: int = 128, base: float = 10000.0
) -> Tensor:
    """The Sandwich bias of every distance for every head.

    Args:
        distance: ``(D,)`` integer signed distances ``p_j - p_i`` (the bias is even in them).
        scales: ``(h,)`` per-head divisors (:func:`sandwich_head_scales`); the result takes their
            floating dtype (at least float32).
        dim: ``d̄``, the width of the sinusoidal embeddings (even).
        base: the sinusoid's base (10000, as Vaswani et al.).

    Returns:
        ``(h, D)``: ``(Σ_{k=1}^{d̄/2} cos(Δ·base^{-2k/d̄}) - d̄/2) / scale_h``.
    """
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even int >= 2, got {dim}")
    # The sum in float64 whatever the output dtype: d̄/2 cosines of large angles cancel closely.
    k = torch.arange(1, dim // 2 + 1, dtype=torch.float64, device=distance.device)
    inv_freq = base ** (-2.0 * k / dim)  # (d̄/2,)
    angles = distance.to(torch.float64).unsqueeze(-1) * inv_freq  # (D, d̄/2)
    inner = torch.cos(angles).sum(-1) - dim / 2  # (D,)
    dtype = torch.promote_types(scales.dtype, torch.float32)
    return (inner.unsqueeze(0) / scales.to(inner.device, torch.float64).unsqueeze(-1)).to(dtype)
