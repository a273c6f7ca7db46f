"""Sandwich (Chi et al., 2023, §5): config and per-head scales."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import (
    SchemeConfig,
    check_heads_field,
    check_int,
    check_positive_float,
    register_config,
)

__all__ = ["SandwichConfig", "sandwich_head_scales"]


def sandwich_head_scales(num_heads: int) -> np.ndarray:
    """Each head's divisor ``8h/H`` for ``h = 1..H``, float64 ``(H,)`` (ALiBi's ratios)."""
    return np.arange(1, num_heads + 1, dtype=np.float64) * 8.0 / num_heads


@register_config
@dataclass(frozen=True)
class SandwichConfig(SchemeConfig):
    """Args:
    dim: ``d̄``, the width of the sinusoidal embeddings whose inner product is the bias (even;
        the paper's experiments use 128). Larger ``d̄`` reaches further before it oscillates.
    base: the sinusoid's base.
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "sandwich"
    dim: int = 128
    base: float = 10000.0
    heads: tuple[int, ...] | None = None

    def validate(self) -> None:
        check_int("dim", self.dim, minimum=2)
        if self.dim % 2:
            raise ValueError(f"dim must be even (sine and cosine pairs), got {self.dim}")
        check_positive_float("base", self.base)
        if not self.base > 1:
            raise ValueError(f"base must be > 1, got {self.base}")
        object.__setattr__(self, "heads", check_heads_field(self.heads))
