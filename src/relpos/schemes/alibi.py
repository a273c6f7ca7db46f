"""ALiBi (Press, Smith and Lewis, 2022, "Train Short, Test Long: Attention with Linear Biases"),
with fixed or learned slopes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from ..functional.alibi import alibi_slopes
from ..functional.dtypes import compute_dtype
from .base import DistanceBiasScheme, LinearBiasScheme, SchemeConfig, register
from .heads import check_heads_field, head_selection, select_heads

__all__ = ["ALiBi", "ALiBiConfig", "LearnedALiBi", "LearnedALiBiConfig"]


def _check_slopes(slopes) -> tuple[float, ...] | None:
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
        object.__setattr__(self, "slopes", _check_slopes(self.slopes))
        object.__setattr__(self, "heads", check_heads_field(self.heads))


@dataclass(frozen=True)
class ALiBiConfig(_SlopeFields):
    """Args:
    slopes: one slope per head instead of the paper's geometric sequence; a slope of 0 leaves
        that head without a bias (per-head control: bias some heads, not others).
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "alibi"


@register
class ALiBi(LinearBiasScheme):
    """A fixed per-head linear penalty on distance, ``slope_h · (p_j - p_i)`` for causal attention
    and ``-slope_h · |p_j - p_i|`` (symmetric) for bidirectional attention. No parameters;
    extrapolates to any length.
    """

    config_class = ALiBiConfig

    def __init__(self, config: ALiBiConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        slopes = alibi_slopes(self.num_heads, self.config.slopes)
        # Heads left out of ``heads`` get slope 0: no bias, on every backend's fused path too.
        slopes = select_heads(slopes, head_selection(self.config.heads, self.num_heads))
        self.register_buffer("slopes", slopes, persistent=False)


@dataclass(frozen=True)
class LearnedALiBiConfig(_SlopeFields):
    """Args:
    slopes: initial slopes, one per head (default: ALiBi's geometric sequence).
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "learned_alibi"


@register
class LearnedALiBi(DistanceBiasScheme):
    """ALiBi whose per-head slopes are trained: ``slope_h · (p_j - p_i)`` (causal) or
    ``-slope_h · |p_j - p_i|`` (bidirectional), slopes initialised to ALiBi's (or the given ones)
    and kept ``>= 0`` at use. A linear :class:`~relpos.schemes.base.DistanceBiasScheme`: its
    gradient flows through the distance table on ``flex`` and ``sdpa``; ``chunked`` runs ALiBi's
    fused parts over plain positions and computes the slopes' gradient in their backward pass.

    Shapes:
        ``score_bias`` returns float32 ``(b|1, h, i, j)``.
    """

    config_class = LearnedALiBiConfig

    def __init__(self, config: LearnedALiBiConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        self.slopes = nn.Parameter(alibi_slopes(self.num_heads, self.config.slopes))

    linear = True

    def linear_slopes(self) -> Tensor:
        slopes = self.slopes.to(compute_dtype(self.slopes.dtype)).clamp(min=0.0)
        return select_heads(slopes, self.bias_heads)

    def distance_bias(self, distance: Tensor) -> Tensor:
        slopes = self.linear_slopes().unsqueeze(-1)
        d = distance.to(slopes.dtype).unsqueeze(0)
        return slopes * (d if self.causal else -d.abs())
