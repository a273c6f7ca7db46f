"""ALiBi (Press, Smith and Lewis, 2022, "Train Short, Test Long", §3): configs and slopes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .base import SchemeConfig, check_heads_field, check_int, head_mask, register_config

__all__ = ["ALiBiConfig", "LearnedALiBiConfig", "alibi_slopes", "check_slopes"]


def _power_of_two_slopes(n: int) -> list[float]:
    # Geometric sequence starting at 2^(-8/n) with the same ratio (the paper's choice).
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int, given: tuple[float, ...] | None = None) -> np.ndarray:
    """Per-head slopes, float32 ``(h,)``: ``given`` (one per head), or the paper's.

    For a power of two ``n``: ``2^(-8/n), 2^(-16/n), …``. Otherwise (the paper's recipe): the slopes
    of the nearest lower power of two ``p``, then every other slope of ``2p`` for the remaining
    heads.
    """
    check_int("num_heads", num_heads, minimum=1)
    if given is not None:
        if len(given) != num_heads:
            raise ValueError(f"slopes has {len(given)} entries; the layer has {num_heads} heads")
        return np.asarray(given, dtype=np.float32)
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(p)
    if p < num_heads:
        slopes += _power_of_two_slopes(2 * p)[0::2][: num_heads - p]
    return np.asarray(slopes, dtype=np.float32)


def check_slopes(slopes) -> tuple[float, ...] | None:
    """Custom slopes as a tuple of finite floats ``>= 0`` (JSON gives a list), or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, list | tuple) or not slopes:
        raise ValueError(
            f"slopes must be a non-empty list of numbers (one per head), got {slopes!r}"
        )
    for h, s in enumerate(slopes):
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s < math.inf:
            raise ValueError(f"slopes[{h}] must be a finite number >= 0, got {s!r}")
    return tuple(float(s) for s in slopes)


@dataclass(frozen=True)
class _SlopeFields(SchemeConfig):
    """The fields and checks both ALiBi configs share (siblings, not parent and child: a scheme
    refuses another scheme's config)."""

    slopes: tuple[float, ...] | None = None
    heads: tuple[int, ...] | None = None

    def validate(self) -> None:
        object.__setattr__(self, "slopes", check_slopes(self.slopes))
        object.__setattr__(self, "heads", check_heads_field(self.heads))

    def validate_dims(self, *, num_heads: int, head_dim: int, causal: bool) -> None:
        super().validate_dims(num_heads=num_heads, head_dim=head_dim, causal=causal)
        if self.slopes is not None and len(self.slopes) != num_heads:
            raise ValueError(
                f"slopes has {len(self.slopes)} entries; the layer has {num_heads} heads"
            )

    def initial_slopes(self, num_heads: int) -> np.ndarray:
        """The slopes, float32 ``(h,)``: the config's, or the paper's geometric sequence."""
        return alibi_slopes(num_heads, self.slopes)


@register_config
@dataclass(frozen=True)
class ALiBiConfig(_SlopeFields):
    """Args:
    slopes: one slope per head instead of the paper's geometric sequence; a slope of 0 leaves
        that head without a bias (per-head control: bias some heads, not others).
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "alibi"

    def head_slopes(self, num_heads: int) -> np.ndarray:
        """The fixed slopes in use, float32 ``(h,)``: 0 for the heads left out of ``heads``."""
        slopes = self.initial_slopes(num_heads)
        mask = head_mask(self.heads, num_heads)
        return slopes if mask is None else np.where(mask, slopes, np.float32(0.0))


@register_config
@dataclass(frozen=True)
class LearnedALiBiConfig(_SlopeFields):
    """Args:
    slopes: initial slopes, one per head (default: ALiBi's geometric sequence).
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "learned_alibi"
