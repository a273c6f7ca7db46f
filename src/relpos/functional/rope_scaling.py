"""RoPE scalings for long contexts: the frequencies and attention factor of each ``rope_type``.

A scaling is the dict language-model checkpoints ship (``rope_scaling`` / ``rope_parameters`` in
a Hugging Face config), pasted as is; the table of ``rope_type`` s and their formulas is in
:mod:`relpos.spec.rope_scaling`.

``L`` is ``original_max_position_embeddings``. The keys, their checks and the static
frequencies live in :mod:`relpos.spec.rope_scaling` (numpy, shared with Keras). The first four
are static: every row and every cached key sees the same frequencies. ``dynamic`` and
``longrope`` depend on the length ``n`` of each token's own sequence
(:func:`sequence_rope_frequencies`): the rotary scheme then rotates keys after they enter the KV
cache, with the frequencies of the sequence's current length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..spec.rope_scaling import (
    LENGTH_DEPENDENT,
    ROPE_TYPES,
    check_rope_scaling,
    longrope_factors,
    ntk_power,
    rope_ladder,
)
from ..spec.rope_scaling import scaled_rope_frequencies as spec_scaled_frequencies

__all__ = [
    "LENGTH_DEPENDENT",
    "ROPE_TYPES",
    "check_rope_scaling",
    "ntk_power",
    "scaled_rope_frequencies",
    "sequence_rope_frequencies",
]


def scaled_rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[Tensor, float]:
    """The inverse frequencies ``(r/2,)`` float32 of a scaled RoPE and its attention factor
    (:func:`relpos.spec.rope_scaling.scaled_rope_frequencies`, the frequencies as a tensor)."""
    inv, attention = spec_scaled_frequencies(rotary_dim, theta, scaling)
    return torch.from_numpy(inv), attention


def sequence_rope_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: dict[str, Any],
    lengths: Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token inverse frequencies of a length-dependent scaling (``dynamic``, ``longrope``),
    from the length of each token's own sequence.

    Args:
        lengths: ``(b, n)`` int, the length of the sequence each token belongs to (its document in
            a packed row; everything seen so far when decoding).

    Returns:
        ``(b, n, r/2)`` in ``dtype`` (float32; float64 for a float64 model). Sequences up to
        ``original_max_position_embeddings`` get exactly :func:`scaled_rope_frequencies`.
    """
    kind = scaling["rope_type"]
    if kind not in LENGTH_DEPENDENT:
        raise ValueError(f"rope_type {kind!r} does not depend on the sequence length")
    exponent = torch.from_numpy(rope_ladder(rotary_dim)).to(lengths.device)
    original = scaling["original_max_position_embeddings"]
    n = lengths.to(torch.float64).unsqueeze(-1)  # (b, n, 1)
    long = n > original
    if kind == "dynamic":
        factor = scaling["factor"]
        # ln θ' = ln θ + r/(r-2)·ln(factor·n/L - factor + 1), for n > L (the argument is > 1)
        growth = (factor * n.clamp_min(original) / original - factor + 1).log()
        log_base = math.log(theta) + ntk_power(rotary_dim) * growth
        inv = torch.where(long, (-exponent * log_base).exp(), theta ** (-exponent))
    else:
        factors = longrope_factors(rotary_dim, scaling)
        short_f, long_f = (torch.from_numpy(f).to(lengths.device) for f in factors)
        inv = theta ** (-exponent) / torch.where(long, long_f, short_f)
    return inv.to(dtype)
